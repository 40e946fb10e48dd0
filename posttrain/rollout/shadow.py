"""ZeRO-3: a persistent full copy of the model's weights, gathered once per rollout."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class ShadowModel:
    """Per-dtype flat buffers holding every parameter, refreshed in chunks; fixed addresses."""

    def __init__(self, module: nn.Module, fast_frozen: Any = None,
                 appended: list[tuple[list[nn.Parameter], int]] = ()) -> None:
        """``appended``: groups of 2-D weights (one dtype, one input width) laid end to end, each followed by room
        for that many more rows (LoRA mode "grouped" appends the adapters' A rows there: rollout/adapters.py)."""
        self.source, self.fast = module, fast_frozen
        named = [p for _, p in module.named_parameters()]  # tied parameters once
        shape = {id(p): tuple(getattr(p, "ds_shape", p.shape)) for p in named}
        group_of: dict[int, tuple[list[nn.Parameter], int]] = {}
        for params, rows in appended:
            shapes = [shape.get(id(p), ()) for p in params]
            if (all(len(s) == 2 for s in shapes) and len({s[1] for s in shapes}) == 1
                    and len({p.dtype for p in params}) == 1):
                group_of.update((id(p), (params, rows)) for p in params)
        # Placement order: named order, a group's members together where its first member comes; None: room.
        order: list[tuple[nn.Parameter | None, int, torch.dtype]] = []
        placed: set[int] = set()
        self.groups: dict[tuple[int, ...], tuple[torch.dtype, int, int, int]] = {}  # ids -> dtype, start, rows, width
        for p in named:
            if id(p) in placed:
                continue
            params, rows = group_of.get(id(p), ([p], 0))
            for q in params:
                order.append((q, math.prod(shape[id(q)]), q.dtype))
                placed.add(id(q))
            if id(p) in group_of:
                order.append((None, rows * shape[id(p)][1], p.dtype))
        dtypes = sorted({d for _, _, d in order}, key=str)
        device = getattr(named[0], "ds_tensor", named[0]).device
        # One flat buffer per dtype (peft keeps float32 adapters beside a bf16 base).
        self.flats = {d: torch.empty(sum(n for _, n, dt in order if dt == d), dtype=d, device=device) for d in dtypes}
        self.flat = self.flats[named[0].dtype]
        self.views: dict[int, torch.Tensor] = {}
        offsets = dict.fromkeys(dtypes, 0)
        for p, n, d in order:
            o = offsets[d]
            if p is not None:
                self.views[id(p)] = self.flats[d][o : o + n].view(shape[id(p)])
            offsets[d] = o + n
        for params, rows in {id(v[0][0]): v for v in group_of.values()}.values():
            first = self.views[id(params[0])]
            out = sum(shape[id(q)][0] for q in params)
            self.groups[tuple(id(q) for q in params)] = (first.dtype, first.storage_offset(), out + rows, first.shape[1])

    def appended(self, params: list[nn.Parameter]) -> torch.Tensor | None:
        """The [out + rows, in] buffer of a group laid out with room (``appended``), or None."""
        found = self.groups.get(tuple(id(p) for p in params))
        if found is None:
            return None
        dtype, start, rows, width = found
        return self.flats[dtype][start : start + rows * width].view(rows, width)

    def view(self, p: torch.Tensor) -> torch.Tensor:
        return self.views[id(p)]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the current weights in (collective: every rank calls it)."""
        params = list(self.source.named_parameters())
        if self.fast is not None:
            with self.fast.gathered():
                for _, p in params:
                    self.views[id(p)].copy_(p.data)
            return
        import deepspeed

        budget = max(max(p.ds_numel for _, p in params), sum(p.ds_numel for _, p in params) // 16)
        chunk: list[Any] = []
        size = 0
        for i, (_, p) in enumerate(params):
            chunk.append(p)
            size += p.ds_numel
            if size >= budget or i == len(params) - 1:
                with deepspeed.zero.GatheredParameters(chunk, modifier_rank=None):
                    for q in chunk:
                        self.views[id(q)].copy_(q.data)
                chunk, size = [], 0
