"""The trained model's tokenizer as TRL's SFT, reward and DPO trainers set it up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError


@dataclass
class TokenizerFields:
    """The tokenizer's fields of ``trl.SFTConfig`` and ``RewardConfig``."""

    chat_template_path: str | None = None  # a .jinja file: the chat template to render conversations with
    eos_token: str | None = None  # the token that ends a turn or sequence; None: the tokenizer's own

    def check_tokenizer_fields(self) -> None:
        if self.chat_template_path is not None and not str(self.chat_template_path).endswith((".jinja", ".j2")):
            raise ConfigError(f"chat_template_path {self.chat_template_path!r} is not a .jinja/.j2 file: give the "
                              "template as a Jinja file")


def load_tokenizer(path: str, model_init_kwargs: dict[str, Any] | None = None) -> Any:
    """``path``'s tokenizer as TRL loads it (revision, trust_remote_code; EOS pads when no pad token)."""
    from transformers import AutoTokenizer

    kwargs = {k: v for k, v in (model_init_kwargs or {}).items() if k in ("revision", "trust_remote_code")}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def set_tokens(tokenizer: Any, cfg: TokenizerFields) -> None:
    """Apply the config's chat template and EOS token; EOS pads when there is no pad token (TRL)."""
    if cfg.chat_template_path is not None:
        tokenizer.chat_template = Path(cfg.chat_template_path).read_text()
    if cfg.eos_token is not None:
        if cfg.eos_token not in tokenizer.get_vocab():
            raise ConfigError(f"eos_token {cfg.eos_token!r} is not in the tokenizer's vocabulary: give one of its tokens")
        tokenizer.eos_token = cfg.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
