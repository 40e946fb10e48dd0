"""ZeRO-3: a persistent full copy of the model's weights, gathered once per rollout.

The engine's graphs hold the addresses of the weights they read; a ZeRO-3 model has none to hold
(its parameters are gathered into temporary buffers per forward). A shadow module of the same
class views one flat buffer, refreshed from the sharded model once per rollout, so the graphs
read the same addresses every rollout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class ShadowModel:
    """A module of the same class whose parameters view one persistent flat buffer, refreshed from
    a ZeRO-3 model once per rollout (collective), chunk by chunk so that at most about 1/16 of the
    model is gathered beside the buffer. Its addresses never change, so graphs need no recapture."""

    def __init__(self, module: nn.Module, fast_frozen: Any = None) -> None:
        self.source, self.fast = module, fast_frozen
        named = list(module.named_parameters())
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for _, p in named]
        dtype = named[0][1].dtype
        device = getattr(named[0][1], "ds_tensor", named[0][1]).device
        numels = [math.prod(s) for s in shapes]
        self.flat = torch.empty(sum(numels), dtype=dtype, device=device)
        with torch.device("meta"):
            shadow = type(module)(module.config)
        views, offset = {}, 0
        for (name, _), shape, n in zip(named, shapes, numels):
            views[name] = self.flat[offset : offset + n].view(shape)
            offset += n
        # Tied parameters: the shadow shares them as the source does (named_parameters lists one).
        first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        for name, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            sub = shadow.get_submodule(owner) if owner else shadow
            setattr(sub, attr, nn.Parameter(views[first[id(p)]], requires_grad=False))
        for name, buf in module.named_buffers():
            owner, _, attr = name.rpartition(".")
            sub = shadow.get_submodule(owner) if owner else shadow
            sub._buffers[attr] = buf.detach().clone()
        self.names = [n for n, _ in named]
        self.module = shadow.eval()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the current weights in (collective: every rank calls it)."""
        shadow = dict(self.module.named_parameters())
        params = list(self.source.named_parameters())
        if self.fast is not None:
            with self.fast.gathered():
                for name, p in params:
                    shadow[name].copy_(p.data)
            return
        import deepspeed

        budget = max(max(p.ds_numel for _, p in params), sum(p.ds_numel for _, p in params) // 16)
        chunk: list[tuple[str, Any]] = []
        size = 0
        for i, (name, p) in enumerate(params):
            chunk.append((name, p))
            size += p.ds_numel
            if size >= budget or i == len(params) - 1:
                with deepspeed.zero.GatheredParameters([q for _, q in chunk], modifier_rank=None):
                    for n, q in chunk:
                        shadow[n].copy_(q.data)
                chunk, size = [], 0
