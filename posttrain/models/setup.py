"""The trained model's settings and set-up that the SFT, reward and DPO trainers share, as TRL's
SFT, Reward and DPO trainers have them: the config fields (TRL's names, meanings and defaults),
the model and its tokenizer as the trainer was given them, the tokenizer's chat template and EOS
token, and the trained model's engine (activation checkpointing, adapters, optimizer)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.models.lora import add_adapters, zero3_adapters
from posttrain.trainers.config import optimizer_and_scheduler

# LOCK_FILE, checkpoints, lock_output_dir, resume_dir and save_checkpoint are imported from here too
# (loop.py, scripts/hub.py, tests), as before the output dir had its own module.


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
    """:func:`policy_source` for a trainer that takes TRL's arguments
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


def given_once(obj: Any, path: Any, what: str, arg: str, field: str) -> Any:
    """A model a trainer takes either as an object (``arg=``) or by its config's ``field``; both
    given is one sentence. Returns the one given (None when neither is)."""
    if obj is not None and path is not None:
        raise ConfigError(f"the {what} is given twice ({arg}= and {field}): give one of them")
    return obj if obj is not None else path


def one_tokenizer(processing_class: Any, tokenizer: Any) -> Any:
    """The tokenizer under TRL's name (``processing_class=``) or this trainer's earlier one
    (``tokenizer=``); both is one sentence."""
    return given_once(processing_class, tokenizer, "tokenizer", "processing_class", "tokenizer=")


def distinct_objects(**models: Any) -> None:
    """Each role needs a model of its own: one object given for two roles would be trained and
    frozen (or trained twice) at once, as TRL refuses ``ref_model is model``."""
    seen: dict[int, str] = {}
    for name, model in models.items():
        if isinstance(model, torch.nn.Module):
            if id(model) in seen:
                raise ConfigError(f"{seen[id(model)]}= and {name}= are the same object: each role needs a model of "
                                  f"its own, so pass a copy (copy.deepcopy) or leave {name} unset")
            seen[id(model)] = name


def policy_source(cfg: Any, model: Any, processing_class: Any,
                  load_tokenizer: Callable[[str], Any] | None = None, *,
                  default: Callable[[], Any] | None = None, what: str = "policy") -> tuple[Any, Any, str]:
    """The policy as a trainer was given it, as TRL's trainers take it: a model object or a hub
    name / local path (``model``, else ``cfg.model_name_or_path``, else ``default()``, the tiny
    default's SFT policy unless given); returns it, its tokenizer (``processing_class``, else
    ``load_tokenizer`` of the path) and its name. ``what`` names the model in refusals."""
    load_tokenizer = load_tokenizer or tiny.load_tokenizer
    model = given_once(model, cfg.model_name_or_path, what, "model", "model_name_or_path")
    if isinstance(model, torch.nn.Module):
        name = str(getattr(model, "name_or_path", "") or "")
        if getattr(cfg, "model_init_kwargs", None):  # TRL warns the same way
            logging.getLogger(__name__).warning("model_init_kwargs is set but the %s is already built (model=): "
                                                "model_init_kwargs is ignored", what)
        if processing_class is None:
            if not (name and Path(name).is_dir()):
                raise ConfigError("a model object needs its tokenizer: pass processing_class=")
            processing_class = load_tokenizer(name)
        return model, processing_class, name or type(model).__name__
    path = str(model or (default or tiny.sft_model_path)())
    return path, processing_class or load_tokenizer(path), path


def model_config(source: Any) -> Any:
    """A model's config, from the object itself or read from its path (nothing loads)."""
    if isinstance(source, torch.nn.Module):
        return source.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source)


def reference_source(ref_model: Any, policy: Any) -> Any:
    """The reference model's source: its own object or path, else the policy's initial weights (the
    policy's path loaded again, or a copy of a given policy object, taken before it trains or takes
    adapters)."""
    if isinstance(ref_model, torch.nn.Module) or ref_model:
        return ref_model
    return copy.deepcopy(policy) if isinstance(policy, torch.nn.Module) else policy


def enable_gradient_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """Recompute a trained model's activations in backward (TRL's default for DPO, GRPO and RLOO).
    It acts only in a forward with gradients in train mode; no_grad passes (generation, old or
    reference log-probs) run the layers as they are. ``use_reentrant``: TRL's setting for LoRA
    under ZeRO-3 (non-reentrant recomputation meets frozen ZeRO-3 shards, DeepSpeed#4332)."""
    # transformers 5.24 renamed it activation checkpointing; the GPU image's 5.17 may only have the old name.
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
