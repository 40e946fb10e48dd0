"""Changing a frozen role's weights in place, whatever its placement; a mixin of
:class:`posttrain.placement.session.Session`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.errors import ConfigError


class FrozenWeightsMixin:
    """Session methods that change a frozen role's weights; collective: call them on every rank."""

    @torch.no_grad()
    def update_weights(self, name: str, fn: Callable[[str, torch.Tensor], None]) -> None:
        """Change a frozen role's weights in place: ``fn(name, full_tensor)`` per param. Collective."""
        if self.role(name).trains:
            raise ConfigError(f"role {name!r} trains: its weights change through its optimizer (or load_state)")
        module = self.engines[name].module
        names = {id(p): n for n, p in module.named_parameters()}
        if name in self.fast_frozen:
            self.fast_frozen[name].update_(lambda p: fn(names[id(p)], p.data))
        elif self.zero_stage(name) == 3:
            import deepspeed

            # TRL's SyncRefModelCallback: rank 0 changes the gathered weights, repartitioned on exit.
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                if self.process_index == 0:
                    for n, p in module.named_parameters():
                        fn(n, p.data)
        else:
            for n, p in module.named_parameters():
                fn(n, p.data)

    def load_weights(self, name: str, directory: str | os.PathLike) -> None:
        """Overwrite a frozen role's weights with a ``save_pretrained`` folder's safetensors. Collective."""
        from safetensors.torch import load_file

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no {name} weights; the checkpoint predates sync_ref_model")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))

        def copy(param: str, tensor: torch.Tensor) -> None:
            if param not in state:
                raise KeyError(f"{directory} has no {param!r}: not a checkpoint of this {name}")
            tensor.copy_(state[param])

        self.update_weights(name, copy)

    @torch.no_grad()
    def blend(self, target: str, source: str, alpha: float) -> None:
        """``target = (1 - alpha) * target + alpha * source`` (TR-DPO), any placement. Collective."""
        import deepspeed

        src_module = self.engines[source].module
        sharded = self.zero_stage(source) == 3 and source not in self.fast_frozen
        gathered = (deepspeed.zero.GatheredParameters(list(src_module.parameters()), modifier_rank=None)
                    if sharded else contextlib.nullcontext())
        with gathered:
            src = dict(src_module.named_parameters())
            want = [n for n, _ in self.engines[target].module.named_parameters()]
            missing = [n for n in want if n not in src]
            if missing or len(want) != len(src):
                raise ConfigError(f"cannot blend role {source!r} into {target!r}: their parameters differ "
                                  f"(e.g. {(missing or sorted(set(src) - set(want)))[:3]}); both need the "
                                  "same architecture")
            self.update_weights(target, lambda n, t: t.mul_(1.0 - alpha).add_(src[n].data.to(t.dtype), alpha=alpha))
