"""Prompts for the online trainers: prompt rows, tokenizing, left-padded batches and positions."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.errors import ConfigError


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a left-padded batch (ids, attention mask): every prompt ends where generation starts."""
    width = max(len(p) for p in seqs)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in seqs], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in seqs], dtype=torch.long, device=device)
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that follow the attention mask, so a left-padded prompt starts at 0."""
    return attention_mask.long().cumsum(1) - attention_mask.long()


def padded_inputs(sequences: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Model inputs for padded prompt + completion ids (TRL's PPOTrainer): pads masked, ids 0."""
    attention_mask = sequences != pad_token_id
    input_ids = torch.masked_fill(sequences, ~attention_mask, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids(attention_mask)}


def prompt_rows(train_dataset: Any, algorithm: str) -> list[dict]:
    """The rows of ``train_dataset`` (a Dataset or list of dicts with a "prompt"), required as in TRL."""
    if train_dataset is None:
        raise ConfigError(f"{algorithm} needs prompts: pass train_dataset= (a datasets.Dataset or a list of dicts "
                          "with a 'prompt'), as TRL's trainers take it; posttrain.scripts.data.bundled_prompts(n) "
                          "gives the tiny default's bundled ones")
    return check_prompt_rows(train_dataset, "train_dataset", algorithm)


def check_prompt_rows(ds: Any, name: str, algorithm: str) -> list[dict]:
    """``ds``'s rows; refused without a "prompt" column or with an empty prompt."""
    rows = list(ds) if isinstance(ds, (list, tuple)) else ds.to_list()
    columns = ds.column_names if hasattr(ds, "column_names") else list(rows[0]) if rows else []
    if "prompt" not in columns:
        raise ConfigError(f"{name}: {algorithm} needs a 'prompt' column (text or a list of messages); "
                          f"the columns are {columns}")
    for i, r in enumerate(rows):
        if not r.get("prompt"):
            raise ConfigError(f"{name}: row {i} has an empty 'prompt'")
    return rows


def tokenize_prompt(prompt: Any, tokenizer: Any, cfg: Any) -> list[int]:
    """A prompt's ids as TRL builds them, kept to the last ``max_prompt_length`` tokens."""
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    example = {"prompt": prompt}
    if is_conversational(example):
        text = maybe_apply_chat_template(example, tokenizer, **(cfg.chat_template_kwargs or {}))["prompt"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError(f"prompt {prompt!r} tokenizes to nothing")
    return ids[-cfg.max_prompt_length:] if cfg.max_prompt_length else ids


def policy_text(prompt: str | list[dict], tokenizer: Any) -> str:
    """What the policy reads: the text, or its chat template over conversational messages."""
    if isinstance(prompt, list):  # conversational: a list of {"role", "content"} messages
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt
