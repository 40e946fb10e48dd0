"""Continuous batching: which sequence decodes in which engine slot, and when. One :class:`Scheduler` runs a
rollout (:func:`generate`) or, kept across optimizer steps, a stream of batches (``rollout/stream.py``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from posttrain.rollout.engine import Clock, DecodeEngine

if TYPE_CHECKING:
    from posttrain.rollout.turns import Turns


@dataclass
class Batch:
    """Sequences submitted together (left-padded prompts, one sampling key): a rollout's, or one generation
    batch of a stream; ``tokens``/``logprobs`` [n, max_new_tokens] fill in as its sequences finish."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    key: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    tag: Any = None  # the submitter's label (a stream's generation batch index)
    groups: list[int] | None = None  # each row's prompt as an id (shared prompt slots)
    admitted_at: list[int] = field(default_factory=list)  # the weight version each row started under (-1: not yet)
    finished: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


class Scheduler:
    """The slots' occupancy over one or more :class:`Batch` es, admitted in submission order."""

    def __init__(self, engine: DecodeEngine, max_new_tokens: int, profile: bool = False,
                 turns: Turns | None = None, group_size: int = 1) -> None:
        self.engine, self.max_new, self.turns = engine, max_new_tokens, turns
        # Sequences are admitted in whole groups of this many (submitted group by group): a group then starts
        # under one weight version, and none is dropped as stale for members that waited for slots.
        self.group_size = max(1, min(group_size, len(engine.slots)))
        self.last_step = max_new_tokens - 1  # a row's last token has step index max_new_tokens - 1
        self.slot_seq: dict[int, int] = {}  # occupied slot -> sequence number (its submission order)
        self.age: dict[int, int] = {}  # decode steps run since the sequence entered
        # Sequence number (submission order) -> (its batch, its row there), while it waits or decodes.
        self.rows: dict[int, tuple[Batch, int]] = {}
        self.submitted = 0
        self.waiting: deque[int] = deque()
        self.version = 0  # the weights' version, recorded when a row is admitted
        self.timings = {"prefill_ms": 0.0, "decode_ms": 0.0, "append_ms": 0.0, "decode_steps": 0, "row_steps": 0}
        self.clock = Clock(engine.device) if profile else None

    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, key: int, tag: Any = None) -> Batch:
        """Queue sequences behind those already waiting; returns their :class:`Batch`."""
        n, dev, pad = prompt_ids.shape[0], self.engine.device, self.engine.sampling.pad_token_id
        groups = None
        if self.engine.prompts is not None:  # shared prompt slots: each sequence's prompt as an id
            content = prompt_ids.masked_fill(prompt_mask == 0, -1)
            groups = torch.unique(content, dim=0, return_inverse=True)[1].tolist()
        batch = Batch(prompt_ids, prompt_mask, key,
                      torch.full((n, self.max_new), pad, dtype=torch.long, device=dev),
                      torch.zeros(n, self.max_new, dtype=torch.float32, device=dev), tag, groups, [-1] * n,
                      [False] * n)
        first, self.submitted = self.submitted, self.submitted + n
        self.rows.update((first + i, (batch, i)) for i in range(n))
        self.waiting.extend(range(first, first + n))
        return batch

    @property
    def live(self) -> int:
        """Sequences in slots."""
        return len(self.slot_seq)

    @property
    def idle(self) -> bool:
        """Nothing decoding and nothing waiting."""
        return not self.slot_seq and not self.waiting

    def drop(self, batch: Batch, rows: list[int]) -> int:
        """Drop ``batch``'s ``rows`` that have not finished (waiting or decoding; their slots free); returns
        how many."""
        gone = set(rows)

        def dropped(q: int) -> bool:
            return self.rows[q][0] is batch and self.rows[q][1] in gone

        gone_waiting = [q for q in self.waiting if dropped(q)]
        self.waiting = deque(q for q in self.waiting if not dropped(q))
        slots = [s for s, q in self.slot_seq.items() if dropped(q)]
        if slots:
            self.engine.free(slots)
        for s in slots:
            del self.rows[self.slot_seq.pop(s)], self.age[s]
        for q in gone_waiting:
            del self.rows[q]
        return len(gone_waiting) + len(slots)

    def _width(self, slot: int) -> int:
        return self.rows[self.slot_seq[slot]][0].prompt_ids.shape[1]

    def _retire(self) -> None:
        engine, slot_seq, age = self.engine, self.slot_seq, self.age
        flags = engine.done_flags(max(slot_seq) + 1) if engine.stop_ids is not None else None
        finished = [s for s in slot_seq if age[s] >= self.last_step or (flags is not None and flags[s])]
        if finished and self.turns is not None:  # ended turns wait in their slots for their tools
            finished = self.turns.collect(engine, finished, slot_seq)
        by_batch: dict[int, tuple[Batch, list[int], list[int]]] = {}
        for s in finished:
            batch, row = self.rows[slot_seq[s]]
            entry = by_batch.setdefault(id(batch), (batch, [], []))
            entry[1].append(s)
            entry[2].append(row)
        for batch, slots, rows in by_batch.values():
            engine.harvest(slots, rows, batch.tokens, batch.logprobs)
            for s, row in zip(slots, rows):
                batch.finished[row] = True
                del self.rows[slot_seq.pop(s)], age[s]

    def _admit(self, slots: list[int], k: int) -> None:
        """The next ``k`` waiting sequences into ``slots``: one prefill per run of one batch."""
        engine, taken = self.engine, [self.waiting.popleft() for _ in range(k)]
        start = 0
        while start < k:
            batch = self.rows[taken[start]][0]
            end = start
            while end < k and self.rows[taken[end]][0] is batch:
                end += 1
            rows = [self.rows[q][1] for q in taken[start:end]]
            sel = torch.tensor(rows, device=batch.prompt_ids.device)
            engine.admit(slots[start:end], rows, batch.prompt_ids[sel], batch.prompt_mask[sel],
                         [batch.groups[r] for r in rows] if batch.groups is not None else None, key=batch.key)
            for s, q, r in zip(slots[start:end], taken[start:end], rows):
                self.slot_seq[s], self.age[s] = q, 0
                batch.admitted_at[r] = self.version
            start = end

    def round(self) -> bool:
        """Retire finished rows, admit waiting ones, decode up to ``sync_every`` steps; False once idle."""
        engine, slot_seq, age, timings, clock, turns = (self.engine, self.slot_seq, self.age, self.timings,
                                                        self.clock, self.turns)
        if slot_seq:
            self._retire()
        free, waiting = len(engine.slots) - len(slot_seq), len(self.waiting)
        k = min(free, waiting)
        if k < waiting:
            k -= k % self.group_size
        if engine.prompts is not None and k:  # and as many as the free prompt slots and member places take
            k = engine.fits([self.rows[self.waiting[i]][0].groups[self.rows[self.waiting[i]][1]] for i in range(k)])
        admit = k > 0 and (k == waiting or k >= engine.admit_min or not slot_seq)
        live = len(slot_seq) + (k if admit else 0)
        if live == 0:
            return False
        highest = max(slot_seq, default=-1) + 1
        if admit or engine.rows_bucket(len(slot_seq)) < engine.rows_bucket(highest):
            # Compact: rows at or above `live` move into the holes below it; new rows fill the rest.
            holes = [s for s in range(live) if s not in slot_seq]
            movers = sorted(s for s in slot_seq if s >= live)
            if movers:
                length = engine.length_bucket_for(max(engine.columns(age[s] + 1, self._width(s)) for s in movers))
                engine.move(movers, holes[: len(movers)], length)
                for s, d in zip(movers, holes):
                    slot_seq[d], age[d] = slot_seq.pop(s), age.pop(s)
            if admit:
                if clock is not None:
                    timings["decode_ms"] += clock.lap()
                self._admit(holes[len(movers):], k)
                if clock is not None:
                    timings["prefill_ms"] += clock.lap()
        steps = min(engine.sync_every, max(self.last_step - a for a in age.values()))
        if turns is not None and turns.pending and len(turns.pending) == len(slot_seq):
            self._resolve()  # nothing else decodes: the tools now
            return True
        if steps <= 0:
            return True  # every live row has its last token: retire them
        engine.compact_prompts()
        rows = engine.rows_bucket(max(slot_seq) + 1)
        length = engine.length_bucket_for(max(engine.columns(age[s] + steps, self._width(s)) for s in slot_seq))
        engine.run(rows, length, steps)
        timings["decode_steps"] += steps
        timings["row_steps"] += steps * rows
        for s in age:
            age[s] += steps
        if turns is not None and turns.pending:
            self._resolve()  # on CUDA the steps just queued run meanwhile
        return True

    def _resolve(self) -> None:
        """The waiting turns' tools and their appended tokens' prefill (timed apart when profiling)."""
        if self.clock is not None:
            self.timings["decode_ms"] += self.clock.lap()
        self.turns.resolve(self.engine, self.slot_seq, self.age)
        if self.clock is not None:
            self.timings["append_ms"] += self.clock.lap()

    def lap(self) -> dict[str, float]:
        """The timings so far (the last decode lap closed)."""
        if self.clock is not None:
            self.timings["decode_ms"] += self.clock.lap()
        return self.timings


def generate(engine: DecodeEngine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, key: int,
             max_new_tokens: int, profile: bool = False, turns: Turns | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Completions and log-probs [n, max_new_tokens] of left-padded prompts; timings if ``profile``;
    ``turns``: a multi-turn rollout (a row whose turn ends may be extended and decode on)."""
    engine.begin(key, max_new_tokens, prompt_ids.shape[1])
    scheduler = Scheduler(engine, max_new_tokens, profile, turns)
    batch = scheduler.submit(prompt_ids, prompt_mask, key)
    while scheduler.round():
        pass
    return batch.tokens, batch.logprobs, scheduler.lap()
