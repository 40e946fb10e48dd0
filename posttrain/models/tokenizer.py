"""The trained model's tokenizer as TRL's SFT, reward and DPO trainers set it up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError


def check_tokenizer_fields(cfg: Any) -> None:
    """Refuse a chat template that is not a Jinja file, before anything loads."""
    path = cfg.chat_template_path
    if path is not None and not str(path).endswith((".jinja", ".j2")):
        raise ConfigError(f"chat_template_path {path!r} is not a .jinja/.j2 file: give the template as a Jinja file")
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"chat_template_path {path!r} does not exist: give the path of a .jinja file")


def load_tokenizer(path: str, model_init_kwargs: dict[str, Any] | None = None) -> Any:
    """``path``'s tokenizer as TRL loads it (revision, trust_remote_code; EOS pads when no pad token)."""
    from transformers import AutoTokenizer

    kwargs = {k: v for k, v in (model_init_kwargs or {}).items() if k in ("revision", "trust_remote_code")}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def set_tokens(tokenizer: Any, cfg: Any) -> None:
    """Apply the config's chat template, EOS and pad tokens; EOS pads when there is no pad token (TRL)."""
    if cfg.chat_template_path is not None:
        tokenizer.chat_template = Path(cfg.chat_template_path).read_text()
    if cfg.eos_token is not None:
        if cfg.eos_token not in tokenizer.get_vocab():
            raise ConfigError(f"eos_token {cfg.eos_token!r} is not in the tokenizer's vocabulary: give one of its tokens")
        tokenizer.eos_token = cfg.eos_token
    if getattr(cfg, "pad_token", None) is not None:
        if cfg.pad_token not in tokenizer.get_vocab():
            raise ConfigError(f"pad_token {cfg.pad_token!r} is not in the tokenizer's vocabulary: give one of its tokens")
        tokenizer.pad_token = cfg.pad_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
