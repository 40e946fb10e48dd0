"""Regional compilation of a trained policy's decoder layers for its training forward and backward.

Each repeated layer is compiled in place (accelerate's ``compile_regions_deepspeed``, given the
layers alone): one graph serves every layer, activation checkpointing recomputes through it, and
the parameters, the state dict, DeepSpeed's gradient hooks and the rollout engine (which runs the
decoder from the weights, not through the modules) see the model as it was. Eager transformers
layers launch a few dozen kernels each way (RMSNorm's float32 ops, the rotation, SiLU): GRPO's
train phase at 1.1B on one H200 was bound by those launches (benchmarks/NOTES.md, section 27).

The layers run compiled only where that cannot silently fall back: ``fullgraph`` (a graph break
raises) and, around the training forward, a recompile past dynamo's limit raises instead of
running the layers eagerly (:func:`no_eager_fallback`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from posttrain.errors import ConfigError

BACKEND = "inductor"  # the CPU tests take "aot_eager": no C++ toolchain, and bit-equal to eager


def blockers(session: Any, role: str, adapters: bool, generation_backend: str) -> list[str]:
    """What keeps ``role``'s layers from being compiled for training, in words (none: they can be).
    ZeRO-3 gathers parameters in module hooks inside the layers' calls; with LoRA peft's layers sit
    inside them; transformers' ``generate`` calls the layers at every length (a recompile each)."""
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
    """Whether to compile: ``setting`` None (the default) compiles on a GPU where nothing blocks it;
    True where something does is refused in one sentence naming the fix."""
    found = blockers(session, role, adapters, generation_backend)
    if setting is None:
        return torch.cuda.is_available() and not found
    if setting and found:
        raise ConfigError(f"compile_layers=True does not go with {' or '.join(found)}: set compile_layers to false "
                          "(or leave it unset: it is on where it applies)")
    return bool(setting)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder layers of a transformers causal LM (or of a peft model's base), as
    accelerate's regional compilation recognises repeated blocks."""
    from accelerate.utils.other import is_repeated_blocks

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if not is_repeated_blocks(layers):
        raise ConfigError(f"{type(base).__name__}: compile_layers needs one list of identical decoder layers "
                          "(model.model.layers); set compile_layers to false for this model")
    return layers


def compile_layers(model: torch.nn.Module, required: bool = True) -> int:
    """Compile ``model``'s decoder layers in place; returns how many (0 for a model without one list
    of them, unless ``required``: compile_layers was asked for by name)."""
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
    """Past dynamo's recompile limit a compiled function runs eagerly from then on, after one
    warning; in here (``active``) it raises, as a failed compilation or a graph break does, naming
    the setting that trains the layers eagerly. Every call of the compiled layers goes through it."""
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
