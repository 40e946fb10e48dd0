"""ZeRO-3: a persistent full copy of the model's weights, gathered once per rollout."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class ShadowModel:
    """Per-dtype flat buffers holding every parameter, refreshed in chunks; fixed addresses."""

    def __init__(self, module: nn.Module, fast_frozen: Any = None) -> None:
        self.source, self.fast = module, fast_frozen
        named = list(module.named_parameters())  # tied parameters once
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for _, p in named]
        dtypes = sorted({p.dtype for _, p in named}, key=str)
        device = getattr(named[0][1], "ds_tensor", named[0][1]).device
        numels = [math.prod(s) for s in shapes]
        # One flat buffer per dtype (peft keeps float32 adapters beside a bf16 base).
        self.flats = {d: torch.empty(sum(n for (_, p), n in zip(named, numels) if p.dtype == d), dtype=d, device=device)
                      for d in dtypes}
        self.flat = self.flats[named[0][1].dtype]
        self.views: dict[int, torch.Tensor] = {}
        offsets = dict.fromkeys(dtypes, 0)
        for (_, p), shape, n in zip(named, shapes, numels):
            o = offsets[p.dtype]
            self.views[id(p)] = self.flats[p.dtype][o : o + n].view(shape)
            offsets[p.dtype] = o + n

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
