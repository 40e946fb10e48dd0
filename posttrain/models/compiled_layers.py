"""Regional compilation (``fullgraph``) of a trained policy's decoder layers in place, for its training
forward and backward; parameters, state dict and DeepSpeed hooks see the model unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from posttrain.errors import ConfigError

BACKEND = "inductor"  # the CPU tests take "aot_eager": no C++ toolchain, and bit-equal to eager


def blockers(session: Any, role: str, adapters: bool, generation_backend: str) -> list[str]:
    """What keeps ``role``'s layers from being compiled for training, in words (empty: nothing)."""
    out = []
    if session.engine_kind(role) == "deepspeed" and session.zero_stage(role) == 3:
        out.append("a ZeRO-3 policy (its parameters are gathered by hooks inside the layers' calls)")
    if adapters:
        out.append("LoRA adapters")
    if generation_backend != "posttrain":
        out.append(f"generation_backend {generation_backend!r} (transformers' generate calls the layers at every "
                   "length)")
    return out


def wanted(setting: bool | None, session: Any, role: str, adapters: bool, generation_backend: str) -> bool:
    """Whether to compile: None compiles on a GPU where nothing blocks it; True with a blocker raises."""
    found = blockers(session, role, adapters, generation_backend)
    if setting is None:
        return torch.cuda.is_available() and not found
    if setting and found:
        raise ConfigError(f"compile_layers=True does not go with {' or '.join(found)}: set compile_layers to false "
                          "(or leave it unset: it is on where it applies)")
    return bool(setting)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder layers of a transformers causal LM (or a peft model's base)."""
    from accelerate.utils.other import is_repeated_blocks

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if not is_repeated_blocks(layers):
        raise ConfigError(f"{type(base).__name__}: compile_layers needs one list of identical decoder layers "
                          "(model.model.layers); set compile_layers to false for this model")
    return layers


def compile_layers(model: torch.nn.Module, required: bool = True) -> int:
    """Compile ``model``'s decoder layers in place; returns how many (0 if none and not ``required``)."""
    from accelerate.utils import compile_regions_deepspeed

    try:
        layers = decoder_layers(model)
    except ConfigError:
        if required:
            raise
        return 0
    compile_regions_deepspeed(layers, backend=BACKEND, fullgraph=True)
    return len(layers)


@contextmanager
def no_eager_fallback(active: bool = True) -> Iterator[None]:
    """While ``active``, a recompile past dynamo's limit or a graph break raises, never runs eagerly."""
    from torch._dynamo import exc

    if not active:  # the layers are not compiled: dynamo's settings stay the user's
        yield
        return
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    except (exc.BackendCompilerFailed, exc.Unsupported, exc.FailOnRecompileLimitHit) as err:
        raise RuntimeError(f"the policy's compiled decoder layers failed ({type(err).__name__}, above); set "
                           "compile_layers: false to train them eagerly") from err
