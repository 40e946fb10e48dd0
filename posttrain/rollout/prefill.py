"""Prompts into the engine's cache: each distinct prompt prefilled once, in chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.rollout import decoder
from posttrain.rollout.decoder import DecoderSpec
from posttrain.rollout.prompt_cache import SharedPrompts
from posttrain.rollout.slots import Slots

Writer = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, keys, values) of a prefill chunk


def _chunks(spec: DecoderSpec, weights: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, chunk_tokens: int,
            writer: Callable[[int, int], Writer], dtype: torch.dtype) -> torch.Tensor:
    """Prefill distinct prompts in chunks, ``writer(u0, u1)`` storing their k/v; last logits [u, V]."""
    u, p = ids.shape
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = torch.empty(u, spec.vocab, dtype=dtype, device=ids.device)
    chunk = max(1, chunk_tokens // max(1, p))
    for u0 in range(0, u, chunk):
        u1 = min(u, u0 + chunk)
        logits[u0:u1] = decoder.prefill(spec, weights, ids[u0:u1], positions[u0:u1], mask[u0:u1], writer(u0, u1))
    return logits


@torch.no_grad()
def into_rows(spec: DecoderSpec, weights: dict[str, Any], slots: Slots, dst: torch.Tensor, ids: torch.Tensor,
              mask: torch.Tensor, chunk_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Rows' prompts into their slots, each distinct prompt once; (first logits, prompts prefilled)."""
    content = ids.masked_fill(mask == 0, -1)
    uniq, inv = torch.unique(content, dim=0, return_inverse=True)

    def writer(u0: int, u1: int) -> Writer:
        sel = ((inv >= u0) & (inv < u1)).nonzero()[:, 0]  # the chunk's rows (one host sync a chunk)
        rows, src = dst[sel], inv[sel] - u0

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            slots.store(i, rows, k.index_select(0, src), v.index_select(0, src))

        return write

    logits = _chunks(spec, weights, uniq.clamp(min=0), (uniq >= 0).long(), chunk_tokens, writer, dtype)
    return logits[inv], uniq.shape[0]


@torch.no_grad()
def into_prompt_slots(spec: DecoderSpec, weights: dict[str, Any], prompts: SharedPrompts, rows: list[int],
                      ids: torch.Tensor, mask: torch.Tensor, groups: list[int], chunk_tokens: int,
                      dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """Rows into shared prompt slots; (first logits, prompts prefilled, rows that joined)."""
    placed, taken = prompts.enter(rows, groups)
    new = {s for s, _ in taken}
    joins = sum(s not in new for s in placed)
    if taken:
        dev = ids.device
        dst = torch.tensor([s for s, _ in taken], dtype=torch.long, device=dev)
        first = torch.tensor([i for _, i in taken], dtype=torch.long, device=dev)
        pmask = mask[first]

        def writer(u0: int, u1: int) -> Writer:
            def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
                prompts.store(i, dst[u0:u1], k, v)

            return write

        prompts.fill(dst, _chunks(spec, weights, ids[first], pmask, chunk_tokens, writer, dtype), pmask.bool())
    return prompts.logits.index_select(0, torch.tensor(placed, dtype=torch.long, device=ids.device)), len(taken), joins
