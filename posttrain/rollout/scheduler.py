"""Continuous batching: which sequence decodes in which engine slot, and when."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain.rollout.engine import Clock, DecodeEngine

if TYPE_CHECKING:
    from posttrain.rollout.turns import Turns


def generate(engine: DecodeEngine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, key: int,
             max_new_tokens: int, profile: bool = False, turns: Turns | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Completions and log-probs [n, max_new_tokens] of left-padded prompts; timings if ``profile``;
    ``turns``: a multi-turn rollout (a row whose turn ends may be extended and decode on)."""
    n, width = prompt_ids.shape
    engine.begin(key, max_new_tokens, width)
    dev, pad = engine.device, engine.sampling.pad_token_id
    tokens = torch.full((n, max_new_tokens), pad, dtype=torch.long, device=dev)
    logprobs = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=dev)
    slot_seq: dict[int, int] = {}  # occupied slot -> sequence index
    age: dict[int, int] = {}  # decode steps run since the sequence entered
    admitted = 0
    groups = None
    if engine.prompts is not None:  # shared prompt slots: each sequence's prompt as an id
        content = prompt_ids.masked_fill(prompt_mask == 0, -1)
        groups = torch.unique(content, dim=0, return_inverse=True)[1].tolist()
    last_step = max_new_tokens - 1  # a row's last token has step index max_new_tokens - 1
    timings = {"prefill_ms": 0.0, "decode_ms": 0.0, "decode_steps": 0, "row_steps": 0}
    clock = Clock(dev) if profile else None
    while True:
        if slot_seq:  # retire finished rows
            flags = engine.done_flags(max(slot_seq) + 1) if engine.stop_ids is not None else None
            finished = [s for s in slot_seq if age[s] >= last_step or (flags is not None and flags[s])]
            if finished and turns is not None:  # ended turns wait in their slots for their tools
                finished = turns.collect(engine, finished, slot_seq)
            if finished:
                engine.harvest(finished, [slot_seq[s] for s in finished], tokens, logprobs)
                for s in finished:
                    del slot_seq[s], age[s]
        free, waiting = len(engine.slots) - len(slot_seq), n - admitted
        k = min(free, waiting)
        if groups is not None:  # and as many as the free prompt slots and member places take
            k = engine.fits(groups[admitted : admitted + k])
        admit = k > 0 and (k == waiting or k >= engine.admit_min or not slot_seq)
        live = len(slot_seq) + (k if admit else 0)
        if live == 0:
            break
        highest = max(slot_seq, default=-1) + 1
        if admit or engine.rows_bucket(len(slot_seq)) < engine.rows_bucket(highest):
            # Compact: rows at or above `live` move into the holes below it; new rows fill the rest.
            holes = [s for s in range(live) if s not in slot_seq]
            movers = sorted(s for s in slot_seq if s >= live)
            if movers:
                oldest = max(age[s] for s in movers)
                length = engine.length_bucket_for(engine.columns(oldest + 1))
                engine.move(movers, holes[: len(movers)], length)
                for s, d in zip(movers, holes):
                    slot_seq[d], age[d] = slot_seq.pop(s), age.pop(s)
            if admit:
                if clock is not None:
                    timings["decode_ms"] += clock.lap()
                new_slots = holes[len(movers):]
                wave = slice(admitted, admitted + k)
                engine.admit(new_slots, list(range(admitted, admitted + k)), prompt_ids[wave], prompt_mask[wave],
                             groups[wave] if groups is not None else None)
                for i, s in enumerate(new_slots):
                    slot_seq[s], age[s] = admitted + i, 0
                admitted += k
                if clock is not None:
                    timings["prefill_ms"] += clock.lap()
        steps = min(engine.sync_every, max(last_step - a for a in age.values()))
        if turns is not None and turns.pending and len(turns.pending) == len(slot_seq):
            turns.resolve(engine, slot_seq, age)  # nothing else decodes: the tools now
            continue
        if steps <= 0:
            continue  # every live row has its last token: retire them
        engine.compact_prompts()
        rows = engine.rows_bucket(max(slot_seq) + 1)
        length = engine.length_bucket_for(engine.columns(max(age.values()) + steps))
        engine.run(rows, length, steps)
        timings["decode_steps"] += steps
        timings["row_steps"] += steps * rows
        for s in age:
            age[s] += steps
        if turns is not None and turns.pending:
            turns.resolve(engine, slot_seq, age)  # on CUDA the steps just queued run meanwhile
    if clock is not None:
        timings["decode_ms"] += clock.lap()
    return tokens, logprobs, timings
