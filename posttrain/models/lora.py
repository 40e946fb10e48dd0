"""LoRA for every trainer: TRL ``ModelConfig``'s flags, peft's adapters, and the adapter-free base
as the reference model (no reference role, no reference memory)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

from torch import nn

from posttrain.errors import ConfigError


def check_lora_fields(cfg: Any) -> None:
    """Refuse impossible LoRA settings of TRL's ``ModelConfig`` by flag before anything loads."""
    if not cfg.use_peft:
        return
    if not isinstance(cfg.lora_r, int) or cfg.lora_r < 1:
        raise ConfigError(f"lora_r must be a whole number >= 1, got {cfg.lora_r!r}: set --lora_r (TRL's default is 16)")
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha must be > 0, got {cfg.lora_alpha}: set --lora_alpha (TRL's default is 32)")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}: set --lora_dropout (TRL's "
                          "default is 0.05)")


def zero3_adapters(session: Any, role: str, peft_config: Any) -> bool:
    """Whether ``role`` trains adapters under ZeRO-3 (TRL: base dtype, DeepSpeed#8072; reentrant, #4332)."""
    return (peft_config is not None and session.engine_kind(role) == "deepspeed"
            and session.zero_stage(role) == 3)


def add_adapters(model: nn.Module, peft_config: Any, session: Any, role: str) -> nn.Module:
    """``model`` wrapped by peft with ``peft_config``'s adapters (only they train)."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config,
                              autocast_adapter_dtype=not zero3_adapters(session, role, peft_config))
    except ValueError as err:  # peft's NoMatchingPeftModuleError is a ValueError
        if "not found in the base model" not in str(err):
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora_target_modules {sorted(peft_config.target_modules or [])} match no module of the "
                          f"{role}: name some of its linear layers ({', '.join(linear[:8])}) or all-linear") from None


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
    """Refuse an adapter on the LM head (the fused head bypasses it), given a peft config or the model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model_or_config, nn.Module):
        if isinstance(model_or_config.get_output_embeddings(), BaseTunerLayer):
            raise ConfigError(_HEAD_ADAPTER)
        return
    targets = getattr(model_or_config, "target_modules", None) or ()
    if "lm_head" in ([targets] if isinstance(targets, str) else list(targets)):
        raise ConfigError(_HEAD_ADAPTER)


def save_merged(model: nn.Module, state_dict: dict[str, Any], directory: str | os.PathLike) -> None:
    """Save peft ``model`` merged, as a plain transformers model, from its full ``state_dict``; one rank."""
    from accelerate import init_empty_weights

    base = model.get_base_model()
    name = model.active_adapter
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not loaded
        # The live model's peft class, so modules_to_save (a classifier's head) come along.
        skeleton = type(model)(type(base)(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[name]),
                               adapter_name=name)
    skeleton.load_state_dict(state_dict, strict=True, assign=True)
    merged = skeleton.merge_and_unload(safe_merge=True)
    merged.tie_weights()  # assign=True gave tied weights separate tensors
    if getattr(base, "generation_config", None) is not None:  # causal LMs only
        merged.generation_config = copy.deepcopy(base.generation_config)
    merged.save_pretrained(str(directory), safe_serialization=True)
