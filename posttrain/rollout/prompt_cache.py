"""Shared prompt slots (``shared_prompt_kv``): one copy of a prompt's keys and values for all the rows that
continue it."""

from __future__ import annotations

import math

import torch

from posttrain.rollout.decoder import DecoderSpec
from posttrain.rollout.slots import release, restore


def default_prompt_slots(slots: int, group_size: int) -> int:
    """One prompt slot per group, plus one when ``slots`` is not whole groups."""
    return math.ceil(slots / group_size) + (1 if slots % group_size else 0)


def bucket_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` below ``largest``, and ``largest``."""
    sizes, b = {largest}, max(1, smallest)
    while b < largest:
        sizes.add(b)
        b *= 2
    return sorted(sizes)


class SharedPrompts:
    """The prompt slots, their assignment and the index tensors the decode step reads."""

    def __init__(self, spec: DecoderSpec, layers: int, prompt_slots: int, group_size: int, max_prompt_len: int,
                 slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity, self.group, self.slots, self.device = prompt_slots, group_size, slots, device
        shape = (prompt_slots, spec.kv_heads, max_prompt_len, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.valid = torch.zeros(prompt_slots, max_prompt_len, dtype=torch.bool, device=device)
        self.logits = torch.zeros(prompt_slots, spec.vocab, dtype=dtype, device=device)
        # members[s, j]: slot s's j-th member row (``slots``: none); place[r] = s * group_size + j.
        self.members = torch.full((prompt_slots, group_size), slots, dtype=torch.long, device=device)
        self.place = torch.zeros(slots, dtype=torch.long, device=device)
        self.buckets = bucket_sizes(1, prompt_slots)
        self.reset()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def sleep(self) -> None:
        """Free the prompt cache's memory until :meth:`wake` (rollout/slots.py)."""
        release(self.keys + self.values)

    def wake(self) -> None:
        restore(self.keys + self.values)

    def reset(self) -> None:
        """A new rollout: every prompt slot free."""
        self.owner: list[int | None] = [None] * self.capacity  # the group (prompt) in each slot
        self.rows: list[list[int | None]] = [[None] * self.group for _ in range(self.capacity)]
        self.where: dict[int, tuple[int, int]] = {}  # row slot -> (prompt slot, member index)
        self._upload()

    def _upload(self) -> None:
        members = [[self.slots if r is None else r for r in row] for row in self.rows]
        place = [0] * self.slots
        for r, (s, j) in self.where.items():
            place[r] = s * self.group + j
        self.members.copy_(torch.tensor(members, dtype=torch.long))
        self.place.copy_(torch.tensor(place, dtype=torch.long))

    def store(self, layer: int, dst: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Prompts' keys and values [k, kv_heads, width, d] of ``layer`` into prompt slots ``dst``."""
        width = keys.shape[2]
        self.keys[layer][:, :, :width].index_copy_(0, dst, keys)
        self.values[layer][:, :, :width].index_copy_(0, dst, values)

    def fill(self, dst: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Prompt slots ``dst``' last logits and key mask [k, width] (later columns masked)."""
        self.logits.index_copy_(0, dst, logits)
        valid = torch.zeros(len(dst), self.valid.shape[1], dtype=torch.bool, device=self.device)
        valid[:, : mask.shape[1]] = mask
        self.valid.index_copy_(0, dst, valid)

    def _open(self) -> dict[int, list[int]]:
        """Each group's slots that have a free member place."""
        out: dict[int, list[int]] = {}
        for s, g in enumerate(self.owner):
            if g is not None and None in self.rows[s]:
                out.setdefault(g, []).append(s)
        return out

    def fits(self, groups: list[int]) -> int:
        """How many of the sequences of ``groups`` (their prompts' ids, in order) can enter now."""
        places = {g: sum(self.rows[s].count(None) for s in ss) for g, ss in self._open().items()}
        free = self.owner.count(None)
        for n, g in enumerate(groups):
            if places.get(g, 0) > 0:
                places[g] -= 1
            elif free > 0:
                free -= 1
                places[g] = places.get(g, 0) + self.group - 1
            else:
                return n
        return len(groups)

    def enter(self, slots: list[int], groups: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Member places for ``slots``; (each row's prompt slot, new slots as (slot, first row index))."""
        open_slots = self._open()
        taken: list[tuple[int, int]] = []
        out = []
        for i, (r, g) in enumerate(zip(slots, groups)):
            ss = open_slots.get(g, [])
            while ss and None not in self.rows[ss[0]]:
                ss.pop(0)
            if not ss:
                s = self.owner.index(None)
                self.owner[s] = g
                taken.append((s, i))
                ss.append(s)
                open_slots[g] = ss
            s = ss[0]
            j = self.rows[s].index(None)
            self.rows[s][j] = r
            self.where[r] = (s, j)
            out.append(s)
        self._upload()
        return out, taken

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Rows moved from slots ``src`` to ``dst`` (the engine's compaction)."""
        for a, b in zip(src, dst):
            s, j = self.where.pop(a)
            self.rows[s][j] = b
            self.where[b] = (s, j)
        self._upload()

    def leave(self, slots: list[int]) -> None:
        """Harvested rows leave their places; a prompt slot without members is free."""
        for r in slots:
            s, j = self.where.pop(r)
            self.rows[s][j] = None
            if all(x is None for x in self.rows[s]):
                self.owner[s] = None
        self._upload()

    def bucket(self) -> int:
        """The prompt slots the step reads: the smallest bucket holding the highest slot in use."""
        highest = max((s for s, g in enumerate(self.owner) if g is not None), default=0) + 1
        return next(b for b in self.buckets if b >= highest)

    @torch.no_grad()
    def compact(self, width: int) -> bool:
        """Move the highest used prompt slots down if that shrinks :meth:`bucket`; whether any moved."""
        used = [s for s, g in enumerate(self.owner) if g is not None]
        target = next(b for b in self.buckets if b >= max(1, len(used)))
        if self.bucket() <= target:
            return False
        holes = [s for s in range(len(used)) if self.owner[s] is None]
        movers = sorted(s for s in used if s >= len(used))
        src = torch.tensor(movers, dtype=torch.long, device=self.device)
        dst = torch.tensor(holes[: len(movers)], dtype=torch.long, device=self.device)
        for cache in self.keys + self.values:
            view = cache[:, :, :width]
            view.index_copy_(0, dst, view.index_select(0, src))
        for buf in (self.valid, self.logits):
            buf.index_copy_(0, dst, buf.index_select(0, src))
        for a, b in zip(movers, holes):
            self.owner[b], self.owner[a] = self.owner[a], None
            self.rows[b], self.rows[a] = self.rows[a], [None] * self.group
            for j, r in enumerate(self.rows[b]):
                if r is not None:
                    self.where[r] = (b, j)
        self._upload()
        return True
