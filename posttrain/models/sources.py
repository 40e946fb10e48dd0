"""The models a trainer is given, as TRL's trainers take them: an object or a hub name / local path,
given once. Nothing here loads a model: a source is checked, then the trainer loads it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.models.tokenizer import load_tokenizer


def distinct_objects(**models: Any) -> None:
    """Refuse one object given for two roles, as TRL refuses ``ref_model is model``."""
    seen: dict[int, str] = {}
    for name, model in models.items():
        if isinstance(model, torch.nn.Module):
            if id(model) in seen:
                raise ConfigError(f"{seen[id(model)]}= and {name}= are the same object: each role needs a model of "
                                  f"its own, so pass a copy (copy.deepcopy) or leave {name} unset")
            seen[id(model)] = name


def policy_source(cfg: Any, model: Any, processing_class: Any, *, what: str = "policy",
                  load_tokenizer: Callable[[str], Any] | None = None) -> tuple[Any, Any, str]:
    """``(source, tokenizer, name)`` of ``model`` (a name, path or object); ``what``: errors."""
    load_tokenizer = load_tokenizer or _auto_tokenizer
    if model is None:
        raise ConfigError(f"no {what} is given: pass model= (a hub name, a local path or a model object)")
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
    path = str(model)
    if processing_class is None:  # a path's problem (an adapter folder, no config.json) said before its tokenizer
        from posttrain.checks import check_model_path

        check_model_path(path, "model=")
    return path, processing_class or load_tokenizer(path), path


def model_and_tokenizer(cfg: Any, model: Any, processing_class: Any, *,
                        what: str = "model") -> tuple[Any, Any, str]:
    """:func:`policy_source` for SFT, reward and DPO, loading a missing tokenizer as TRL does."""
    return policy_source(cfg, model, processing_class, what=what,
                         load_tokenizer=lambda path: load_tokenizer(path, init_kwargs(cfg)))


def init_kwargs(cfg: Any, **defaults: Any) -> dict[str, Any]:
    """``from_pretrained``'s keywords: ``defaults``, then ``model_init_kwargs`` and ``trust_remote_code``."""
    kwargs = {**defaults, **(cfg.model_init_kwargs or {})}
    if getattr(cfg, "trust_remote_code", False):
        kwargs.setdefault("trust_remote_code", True)
    return kwargs


def _auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def model_config(source: Any) -> Any:
    """A model's config, from the object itself or read from its path (nothing loads)."""
    if isinstance(source, torch.nn.Module):
        return source.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source)


def reference_source(ref_model: Any, policy: Any) -> Any:
    """The reference model's source: its own, else the policy's path or a copy of its object."""
    if isinstance(ref_model, torch.nn.Module) or ref_model:
        return ref_model
    return copy.deepcopy(policy) if isinstance(policy, torch.nn.Module) else policy
