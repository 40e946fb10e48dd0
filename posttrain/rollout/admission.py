"""Sequences into and out of the engine's slots, driven by the host between decode steps (eager):
admission (the prompts' prefill, each distinct prompt once, into the rows' slots or shared prompt
slots, and each row's first token), moves (compaction) and harvest. ``scheduler.py`` decides who
enters, moves and leaves; these functions do it on the engine's buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.rollout import decoder
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.sampling import choose_tokens


@torch.no_grad()
def admit(engine: DecodeEngine, slots: list[int], seq_ids: list[int], ids: torch.Tensor, mask: torch.Tensor,
          groups: list[int] | None = None) -> None:
    """Prefill sequences ``seq_ids`` (prompts ``ids``/``mask`` [k, width], left-padded) into
    ``slots`` and choose their first token. Rows with the same prompt are prefilled once
    (``share_prefix``) and its keys and values copied into each of their slots; with shared
    prompt slots, ``groups`` (each prompt's id in the rollout) places them, and a row whose
    group's prompt is in flight is not prefilled at all."""
    dev, p = engine.device, engine.width
    slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
    seq_t = torch.tensor(seq_ids, dtype=torch.long, device=dev)
    ids, mask = ids.to(dev), mask.to(dev).long()
    valid = torch.ones(len(slots), engine.cache_len, dtype=torch.bool, device=dev)
    if engine.prompts is not None:
        groups = groups if groups is not None else list(range(len(slots)))
        logits = _into_prompt_slots(engine, slots, ids, mask, groups)
    else:
        logits = _into_rows(engine, slot_t, ids, mask)
        valid[:, :p] = mask.bool()
    tokens, logprobs = choose_tokens(
        logits, torch.zeros(len(slots), dtype=torch.long, device=dev), engine.key, seq=seq_t,
        temperature=engine.temperature, do_sample=engine.do_sample, top_k=engine.top_k, top_p=engine.top_p,
        use_top_p=engine.use_top_p, min_new_tokens=engine.min_new, stop_ids=engine.stop_ids)
    engine.stats["prefill_sequences"] += len(slots)
    engine.stats["admissions"] += 1
    out_t = torch.full((len(slots), engine.max_new), engine.sampling.pad_token_id, dtype=torch.long, device=dev)
    out_l = torch.zeros(len(slots), engine.max_new, dtype=torch.float32, device=dev)
    out_t[:, 0], out_l[:, 0] = tokens, logprobs
    done = engine.limit <= 1
    if engine.stop_ids is not None:
        done = done | engine.stop_mask[tokens]
    col = 0 if engine.prompts is not None else p  # the first completion token's cache column
    for buf, value in ((engine.out_tokens, out_t), (engine.out_logprobs, out_l), (engine.key_valid, valid),
                       (engine.last, tokens), (engine.pos, mask.sum(1)), (engine.col, torch.full_like(tokens, col)),
                       (engine.step, torch.ones_like(tokens)), (engine.seq, seq_t),
                       (engine.done, done.expand(len(slots)).clone())):
        buf.index_copy_(0, slot_t, value)


Writer = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, keys, values) of a prefill chunk


def _prefill(engine: DecodeEngine, ids: torch.Tensor, mask: torch.Tensor,
             writer: Callable[[int, int], Writer]) -> torch.Tensor:
    """Prefill distinct prompts ``ids`` [u, width] in chunks of ``prefill_tokens``;
    ``writer(u0, u1)`` gives the function that stores chunk rows ``u0:u1``' keys and values of
    each layer. Their last logits [u, V]."""
    u, p = ids.shape
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = torch.empty(u, engine.spec.vocab, dtype=engine.dtype, device=engine.device)
    chunk = max(1, engine.prefill_tokens // max(1, p))
    for u0 in range(0, u, chunk):
        u1 = min(u, u0 + chunk)
        logits[u0:u1] = decoder.prefill(engine.spec, engine.weights, ids[u0:u1], positions[u0:u1], mask[u0:u1],
                                        writer(u0, u1))
    engine.stats["prefill_rows"] += u
    return logits


def _into_rows(engine: DecodeEngine, slot_t: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's prompt into its own slot (a prompt prefilled once, ``share_prefix``); the
    rows' first logits."""
    p = engine.width
    content = ids.masked_fill(mask == 0, -1)
    if engine.share_prefix:
        uniq, inv = torch.unique(content, dim=0, return_inverse=True)
    else:
        uniq, inv = content, torch.arange(len(slot_t), device=engine.device)

    def writer(u0: int, u1: int) -> Writer:
        sel = ((inv >= u0) & (inv < u1)).nonzero()[:, 0]  # the chunk's rows (one host sync a chunk)
        dst, src = slot_t[sel], inv[sel] - u0

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            engine.keys[i][:, :, :p].index_copy_(0, dst, k.index_select(0, src))
            engine.values[i][:, :, :p].index_copy_(0, dst, v.index_select(0, src))

        return write

    return _prefill(engine, uniq.clamp(min=0), (uniq >= 0).long(), writer)[inv]


def _into_prompt_slots(engine: DecodeEngine, slots: list[int], ids: torch.Tensor, mask: torch.Tensor,
                       groups: list[int]) -> torch.Tensor:
    """Rows into their groups' shared prompt slots, prefilling the prompts that take a slot now;
    the rows' first logits (their prompt slot's)."""
    sp, p, dev = engine.prompts, engine.width, engine.device
    placed, taken = sp.enter(slots, groups)
    new = {s for s, _ in taken}
    engine.stats["prompt_joins"] += sum(s not in new for s in placed)  # rows of a prompt in flight: no prefill
    if taken:
        dst = torch.tensor([s for s, _ in taken], dtype=torch.long, device=dev)
        first = torch.tensor([i for _, i in taken], dtype=torch.long, device=dev)
        pmask = mask[first]

        def writer(u0: int, u1: int) -> Writer:
            def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
                sp.keys[i][:, :, :p].index_copy_(0, dst[u0:u1], k)
                sp.values[i][:, :, :p].index_copy_(0, dst[u0:u1], v)

            return write

        sp.logits.index_copy_(0, dst, _prefill(engine, ids[first], pmask, writer))
        valid = torch.zeros(len(taken), sp.valid.shape[1], dtype=torch.bool, device=dev)
        valid[:, :p] = pmask.bool()
        sp.valid.index_copy_(0, dst, valid)
    return sp.logits.index_select(0, torch.tensor(placed, dtype=torch.long, device=dev))


@torch.no_grad()
def move(engine: DecodeEngine, src: list[int], dst: list[int], length: int) -> None:
    """Move sequences from slots ``src`` to free slots ``dst`` (cache columns ``:length`` and
    state); ``src`` are left done."""
    s = torch.tensor(src, dtype=torch.long, device=engine.device)
    d = torch.tensor(dst, dtype=torch.long, device=engine.device)
    for cache in engine.keys + engine.values:
        view = cache[:, :, :length]
        view.index_copy_(0, d, view.index_select(0, s))
    for buf in (engine.last, engine.pos, engine.col, engine.step, engine.seq, engine.done, engine.key_valid,
                engine.out_tokens, engine.out_logprobs):
        buf.index_copy_(0, d, buf.index_select(0, s))
    engine.done.index_fill_(0, s, True)
    if engine.prompts is not None:
        engine.prompts.move_rows(src, dst)
    engine.stats["compactions"] += 1


def compact_prompts(engine: DecodeEngine) -> None:
    """Shared prompt slots: move the highest in use down into free ones, where that lets the
    step read fewer (``prompt_cache.SharedPrompts.compact``)."""
    if engine.prompts is not None and engine.prompts.compact(engine.width):
        engine.stats["prompt_compactions"] += 1


def harvest(engine: DecodeEngine, slots: list[int], seq_ids: list[int], tokens: torch.Tensor,
            logprobs: torch.Tensor) -> None:
    """Copy finished slots' outputs into the rollout's results at their sequences' rows."""
    s = torch.tensor(slots, dtype=torch.long, device=engine.device)
    q = torch.tensor(seq_ids, dtype=torch.long, device=engine.device)
    n = tokens.shape[1]
    tokens.index_copy_(0, q, engine.out_tokens.index_select(0, s)[:, :n])
    logprobs.index_copy_(0, q, engine.out_logprobs.index_select(0, s)[:, :n])
    if engine.prompts is not None:
        engine.prompts.leave(slots)
