"""LoRA for every trainer: TRL's ``ModelConfig`` flags, peft's adapters, the base as the reference.

A trainer config that mixes in :class:`LoraFields` takes ``--use_peft`` and the ``lora_*`` flags
with TRL's names and defaults; :func:`lora_config` builds the adapter settings with TRL's own
``get_peft_config`` so the two agree on every default. With adapters, the reference model of
DPO/GRPO/RLOO/PPO is the trained model's base with its adapters switched off
(:func:`adapters_disabled`, TRL's ``use_adapter``): no reference role, no reference memory.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from posttrain.errors import ConfigError


@dataclass
class LoraFields:
    """TRL ``ModelConfig``'s LoRA flags (same names and defaults), for a trainer's config."""

    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # None: peft's default for the architecture (q_proj, v_proj on Llama); "all-linear": every linear
    # layer but the LM head.
    lora_target_modules: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    use_rslora: bool = False
    # The final save: False keeps the adapter (PEFT format, PeftModel.from_pretrained loads it, as TRL
    # saves); True saves the base with the adapters merged in, a plain transformers model.
    merge_adapters: bool = False


def check_lora_fields(cfg: LoraFields) -> None:
    """Refuse impossible LoRA settings by flag before anything loads."""
    if not cfg.use_peft:
        return
    if not isinstance(cfg.lora_r, int) or cfg.lora_r < 1:
        raise ConfigError(f"lora_r must be a whole number >= 1, got {cfg.lora_r!r}: set --lora_r (TRL's default is 16)")
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha must be > 0, got {cfg.lora_alpha}: set --lora_alpha (TRL's default is 32)")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}: set --lora_dropout (TRL's "
                          "default is 0.05)")


def lora_config(cfg: LoraFields, task_type: str = "CAUSAL_LM") -> Any:
    """peft's ``LoraConfig`` for ``cfg`` (None without ``use_peft``), built by TRL's ``get_peft_config``."""
    if not cfg.use_peft:
        return None
    from trl import ModelConfig
    from trl.trainer.utils import get_peft_config

    # ModelConfig turns a one-name list into the string peft wants for "all-linear".
    return get_peft_config(ModelConfig(
        use_peft=True, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        lora_target_modules=cfg.lora_target_modules, lora_modules_to_save=cfg.lora_modules_to_save, lora_task_type=task_type,
        use_rslora=cfg.use_rslora))


def zero3_adapters(session: Any, role: str, peft_config: Any) -> bool:
    """Whether ``role`` trains adapters under a ZeRO-3 DeepSpeed engine, where TRL applies two peft
    rules: the adapters keep the base's dtype (ZeRO-3's gather of mixed bf16/fp32 parameters fails,
    DeepSpeed#8072) and activation checkpointing is reentrant (non-reentrant recomputation meets
    released ZeRO-3 shards, DeepSpeed#4332)."""
    return (peft_config is not None and session.engine_kind(role) == "deepspeed"
            and session.zero_stage(role) == 3)


def add_adapters(model: nn.Module, peft_config: Any, session: Any, role: str) -> nn.Module:
    """``model`` wrapped by peft with ``peft_config``'s adapters (only they train); under ZeRO-3
    they keep the base's dtype (:func:`zero3_adapters`; peft's default makes them fp32)."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config,
                          autocast_adapter_dtype=not zero3_adapters(session, role, peft_config))


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` (a peft model, or a module inside a DeepSpeed engine) carries adapters."""
    return hasattr(getattr(model, "module", model), "peft_config")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model under ``model``'s adapters: the reference when a trainer has adapters."""
    from trl.trainer.utils import use_adapter

    with use_adapter(getattr(model, "module", model), adapter_name=None):
        yield


_HEAD_ADAPTER = ("lora_target_modules puts an adapter on lm_head, which the fused LM head bypasses (it would never "
                 "train): drop lm_head from --lora_target_modules")


def check_no_head_adapter(model_or_config: Any) -> None:
    """TRL's GRPO/RLOO rule: the fused LM head scores completions from ``lm_head.weight`` itself, so
    an adapter on the head would never train; refused by name. Given a peft config (before
    anything loads) it reads the target names; given the adapted model, the head itself (a
    pattern that matched it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model_or_config, nn.Module):
        if isinstance(model_or_config.get_output_embeddings(), BaseTunerLayer):
            raise ConfigError(_HEAD_ADAPTER)
        return
    targets = getattr(model_or_config, "target_modules", None) or ()
    if "lm_head" in ([targets] if isinstance(targets, str) else list(targets)):
        raise ConfigError(_HEAD_ADAPTER)


def save_merged(model: nn.Module, state_dict: dict[str, Any], directory: str | os.PathLike) -> None:
    """Save ``model`` (a peft model) with its adapters merged into the base weights, as a plain
    transformers model that ``from_pretrained`` loads; ``state_dict`` is its full state (gathered
    under ZeRO-3). Call it on one process.

    The model is rebuilt as an empty skeleton that takes the given tensors, so it works for any
    placement (the live model's parameters may be ZeRO-3 shards); peft's ``safe_merge`` writes the
    merged weights into new tensors, so the live model (whose tensors a ZeRO-2 or torch-engine
    state dict shares) is left as it was."""
    from accelerate import init_empty_weights

    base = model.get_base_model()
    name = model.active_adapter
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not loaded
        # The live model's peft class: a task's own modules to save (a classifier's score head) come with it.
        skeleton = type(model)(type(base)(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[name]),
                               adapter_name=name)
    skeleton.load_state_dict(state_dict, strict=True, assign=True)
    merged = skeleton.merge_and_unload(safe_merge=True)
    merged.tie_weights()  # assign=True gave tied weights separate tensors
    if getattr(base, "generation_config", None) is not None:  # causal LMs only
        merged.generation_config = copy.deepcopy(base.generation_config)
    merged.save_pretrained(str(directory), safe_serialization=True)
