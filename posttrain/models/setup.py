"""A trained role's model made ready to train, in TRL 1.16's order: adapters, activation
checkpointing, dropout off, optimizer and LR schedule, then the role's engine."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from posttrain.models.lora import add_adapters, zero3_adapters

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from posttrain.placement.session import Session


def prepare_trained(session: Session, role: str, model: torch.nn.Module, cfg: Any, peft_config: Any, *,
                    total_steps: int, gradient_checkpointing: bool | None = None,
                    disable_dropout: bool | None = None, adapter_seed: int | None = None,
                    learning_rate: float | None = None,
                    before_optimizer: Callable[[torch.nn.Module], None] | None = None) -> Any:
    """``role``'s engine: adapters, checkpointing, no dropout, ``before_optimizer``, AdamW+LR; None: cfg's.
    The adapters start as TRL's trainers start them at ``adapter_seed`` (None: ``cfg.seed``)."""
    if peft_config is not None:
        model = adapters_as_trl(session, role, model, peft_config, cfg.seed if adapter_seed is None else adapter_seed)
    base = model.get_base_model() if peft_config is not None else model
    if cfg.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing:
        enable_gradient_checkpointing(base, **checkpointing_kwargs(cfg, zero3_adapters(session, role, peft_config)))
    if getattr(cfg, "disable_dropout", False) if disable_dropout is None else disable_dropout:
        from trl.trainer.utils import disable_dropout_in_model

        disable_dropout_in_model(model)
    if before_optimizer is not None:
        before_optimizer(base)
    opt, sched = optimizer_and_scheduler(model, cfg, total_steps, lr=learning_rate)
    return session.prepare(role, model, opt, sched)


def adapters_as_trl(session: Session, role: str, model: torch.nn.Module, peft_config: Any, seed: int) -> torch.nn.Module:
    """``model`` with peft's adapters drawn as in TRL's trainers: ``set_seed(seed)``, the model's loading, then
    ``get_peft_model``; torch's generator is left as it was (the run's own draws do not depend on adapters)."""
    with torch.random.fork_rng(devices=[]):  # peft draws its adapters on the CPU, then moves them
        torch.default_generator.manual_seed(seed)
        drawn = session.load_rng.get(role)
        # Loading drew from the seeded generator (a new head's init) in TRL's order too: continue after it.
        if drawn is not None and torch.equal(drawn[0], torch.get_rng_state()):
            torch.set_rng_state(drawn[1])
        return add_adapters(model, peft_config, session, role)


def checkpointing_kwargs(cfg: Any, zero3_lora: bool) -> dict[str, Any]:
    """``gradient_checkpointing_kwargs`` as TRL hands them to transformers: non-reentrant unless set, and
    reentrant for adapters trained under ZeRO-3 whatever was set (TRL's rule, said once when it overrides)."""
    kwargs = dict(getattr(cfg, "gradient_checkpointing_kwargs", None) or {})
    if zero3_lora:
        if kwargs.get("use_reentrant") is False:
            logger.warning("gradient_checkpointing_kwargs use_reentrant false: adapters trained under ZeRO-3 need "
                           "reentrant checkpointing, which is used (TRL's rule); unset it to silence this")
        kwargs["use_reentrant"] = True
    kwargs.setdefault("use_reentrant", False)
    return kwargs


def enable_gradient_checkpointing(model: torch.nn.Module, use_reentrant: bool = False, **more: Any) -> None:
    """Recompute activations in backward; ``use_reentrant``: TRL's setting for LoRA under ZeRO-3; ``more``:
    torch.utils.checkpoint's other arguments (``gradient_checkpointing_kwargs``)."""
    kwargs = {"use_reentrant": use_reentrant, **more}
    # Newer transformers' name; older versions have only gradient_checkpointing_enable.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def optimizer_and_scheduler(model: torch.nn.Module, cfg: Any, total_steps: int,
                            lr: float | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over trainable parameters at ``lr`` (None: cfg's) and cfg's schedule over ``total_steps``."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr or cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=warmup_steps(cfg, total_steps),
                          num_training_steps=max(1, total_steps),
                          scheduler_specific_kwargs=getattr(cfg, "lr_scheduler_kwargs", None) or None)
    return opt, sched


def warmup_steps(cfg: Any, total_steps: int | None) -> int:
    """TrainingArguments' rule: warmup_steps below 1 is a fraction of the run's steps."""
    if 0 < cfg.warmup_steps < 1 and total_steps:
        return math.ceil(cfg.warmup_steps * total_steps)
    return int(cfg.warmup_steps)
