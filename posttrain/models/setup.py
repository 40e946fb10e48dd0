"""A trained role's model made ready to train, in TRL 1.16's order: adapters, activation
checkpointing, dropout off, the optimizer and its LR schedule, then the role's engine.

Every trainer prepares each trained model with :func:`prepare_trained`; what a trainer does
differently from TRL (PPO trains without activation checkpointing, GRPO seeds its adapters and
compiles its layers) is a keyword of that one function, so the order is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from posttrain.models.lora import add_adapters, zero3_adapters

if TYPE_CHECKING:
    from posttrain.placement.session import Session


def prepare_trained(session: Session, role: str, model: torch.nn.Module, cfg: Any, peft_config: Any, *,
                    total_steps: int, gradient_checkpointing: bool | None = None,
                    disable_dropout: bool | None = None, adapter_seed: int | None = None,
                    learning_rate: float | None = None,
                    before_optimizer: Callable[[torch.nn.Module], None] | None = None) -> Any:
    """``role``'s engine for ``model`` (loaded by ``session.load(role, ...)``), prepared in TRL's order:

    1. LoRA adapters from ``peft_config`` (None: full fine-tuning); with ``adapter_seed`` the
       torch RNG is seeded first, so every placement starts from the same adapters;
    2. activation checkpointing on the base model when ``gradient_checkpointing`` (None:
       ``cfg.gradient_checkpointing``), reentrant for ZeRO-3 adapters as TRL has it;
    3. every dropout off, the adapters' too, when ``disable_dropout`` (None: ``cfg.disable_dropout``,
       off for a config without that field, as TRL's SFT);
    4. ``before_optimizer(base)``: a trainer's own change to the base model (the transformers
       model under any adapters), made before the optimizer sees the parameters;
    5. AdamW over the parameters that train (the adapters only, with LoRA) at ``learning_rate``
       (None: ``cfg.learning_rate``) and ``cfg.lr_scheduler_type``'s schedule over ``total_steps``
       optimizer steps;
    6. ``session.prepare`` under the role's plugin, whose engine is returned.

    ``cfg`` is a trainer config (``TrainConfig`` and its optimizer fields)."""
    if peft_config is not None:
        if adapter_seed is not None:
            torch.manual_seed(adapter_seed)
        model = add_adapters(model, peft_config, session, role)
    base = model.get_base_model() if peft_config is not None else model
    if cfg.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing:
        enable_gradient_checkpointing(base, use_reentrant=zero3_adapters(session, role, peft_config))
    if getattr(cfg, "disable_dropout", False) if disable_dropout is None else disable_dropout:
        from trl.trainer.utils import disable_dropout_in_model

        disable_dropout_in_model(model)
    if before_optimizer is not None:
        before_optimizer(base)
    opt, sched = optimizer_and_scheduler(model, cfg, total_steps, lr=learning_rate)
    return session.prepare(role, model, opt, sched)


def enable_gradient_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """Recompute a trained model's activations in backward (TRL's default for SFT, DPO, GRPO and
    RLOO). It acts only in a forward with gradients in train mode; no_grad passes (generation, old or
    reference log-probs) run the layers as they are. transformers also makes the embeddings' outputs
    require grad, so gradients reach the adapters of checkpointed layers. ``use_reentrant``: TRL's
    setting for LoRA under ZeRO-3 (non-reentrant recomputation meets released ZeRO-3 shards,
    DeepSpeed#4332)."""
    kwargs = {"use_reentrant": use_reentrant}
    # transformers 5.24's name; the GPU image's 5.17 may have only the older one.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def optimizer_and_scheduler(model: torch.nn.Module, cfg: Any, total_steps: int,
                            lr: float | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``model``'s trainable parameters with ``cfg``'s betas, epsilon and weight decay at
    ``lr`` (None: ``cfg.learning_rate``), and transformers' ``cfg.lr_scheduler_type`` schedule with
    ``cfg.warmup_steps``, stepped once per optimizer step over ``total_steps``."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr or cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps,
                          num_training_steps=max(1, total_steps))
    return opt, sched
