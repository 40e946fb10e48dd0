"""The trained model's settings and set-up that the SFT, reward and DPO trainers share, as TRL's
SFT, Reward and DPO trainers have them: the config fields (TRL's names, meanings and defaults),
the model and its tokenizer as the trainer was given them, the tokenizer's chat template and EOS
token, and the trained model's engine (activation checkpointing, adapters, optimizer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dsconfig import ConfigError
from ..lora import add_adapters, zero3_adapters
from .common import enable_gradient_checkpointing, one_tokenizer, optimizer_and_scheduler, policy_source


@dataclass
class ModelFields:
    """The trained model's fields of ``trl.SFTConfig``, ``RewardConfig`` and ``DPOConfig``."""

    model_name_or_path: str | None = None
    model_init_kwargs: dict[str, Any] | None = None
    gradient_checkpointing: bool = True  # TRL's default: activations recomputed in backward


@dataclass
class TokenizerFields:
    """The tokenizer's fields of ``trl.SFTConfig`` and ``RewardConfig``."""

    chat_template_path: str | None = None  # a .jinja file: the chat template to render conversations with
    eos_token: str | None = None  # the token that ends a turn or sequence; None: the tokenizer's own

    def check_tokenizer_fields(self) -> None:
        if self.chat_template_path is not None and not str(self.chat_template_path).endswith((".jinja", ".j2")):
            raise ConfigError(f"chat_template_path {self.chat_template_path!r} is not a .jinja/.j2 file: give the "
                              "template as a Jinja file")


def set_tokens(tokenizer: Any, cfg: TokenizerFields) -> None:
    """The config's chat template and EOS token on ``tokenizer``; the EOS token pads when it has no
    pad token (TRL's default)."""
    if cfg.chat_template_path is not None:
        tokenizer.chat_template = Path(cfg.chat_template_path).read_text()
    if cfg.eos_token is not None:
        if cfg.eos_token not in tokenizer.get_vocab():
            raise ConfigError(f"eos_token {cfg.eos_token!r} is not in the tokenizer's vocabulary: give one of its tokens")
        tokenizer.eos_token = cfg.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def model_and_tokenizer(cfg: ModelFields, model: Any, processing_class: Any, tokenizer: Any, *,
                        default: Callable[[], Any] | None = None, what: str = "policy") -> tuple[Any, Any, str]:
    """:func:`~posttrain.trainers.common.policy_source` for a trainer that takes TRL's arguments
    (``model=``, ``processing_class=`` or its earlier name ``tokenizer=``): a tokenizer it is not
    given is loaded from the model's path with ``model_init_kwargs``' revision and remote-code
    setting, and pads with its EOS token when it has no pad token, as TRL loads it."""
    return policy_source(cfg, model, one_tokenizer(processing_class, tokenizer),
                         lambda path: _load_tokenizer(path, cfg), default=default, what=what)


def _load_tokenizer(path: str, cfg: ModelFields) -> Any:
    from transformers import AutoTokenizer

    kwargs = {k: v for k, v in (cfg.model_init_kwargs or {}).items() if k in ("revision", "trust_remote_code")}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.pad_token is None:  # TRL's default
        tok.pad_token = tok.eos_token
    return tok


def prepare_trained(session: Any, role: str, model: torch.nn.Module, cfg: Any, peft_config: Any,
                    total_steps: int) -> Any:
    """``role``'s engine for the loaded ``model``: activation checkpointing (``cfg.gradient_checkpointing``;
    reentrant for ZeRO-3 adapters, as TRL), then the LoRA adapters (``peft_config``, None for none),
    then AdamW and the LR schedule over what trains, prepared under the role's plugin."""
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, use_reentrant=zero3_adapters(session, role, peft_config))
    if peft_config is not None:
        model = add_adapters(model, peft_config, session, role)
    opt, sched = optimizer_and_scheduler(model, cfg, total_steps)
    return session.prepare(role, model, opt, sched)
