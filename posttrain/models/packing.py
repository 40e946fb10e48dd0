"""Padding-free forwards: a padded ``[B, T]`` batch packed into one row of its attended tokens, position ids
restarting per sequence (the varlen kernels' ``cu_seq_lens``), and per-token outputs put back in the padded layout."""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_WARNED: set[str] = set()


@dataclass(frozen=True)
class Packing:
    """Where each attended token of a padded batch sits in the packed row (row-major, so sequences follow
    each other in batch order)."""

    index: torch.Tensor  # (N,) flat ``row * T + column`` of each packed token
    lengths: torch.Tensor  # (B,) attended tokens per row
    shape: tuple[int, int]  # (B, T)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> Packing:
        """The packing of a ``[B, T]`` 0/1 attention mask (any padding side)."""
        valid = attention_mask.bool()
        return cls(valid.flatten().nonzero().squeeze(1), valid.sum(1), tuple(valid.shape))

    @property
    def rows(self) -> torch.Tensor:
        """(N,) the batch row of each packed token."""
        return self.index // self.shape[1]

    @property
    def columns(self) -> torch.Tensor:
        """(N,) the padded column of each packed token."""
        return self.index % self.shape[1]

    @property
    def cu_seq_lens(self) -> torch.Tensor:
        """(B + 1,) int32 sequence boundaries in the packed row, as the varlen kernels take them."""
        return F.pad(self.lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def position_ids(self) -> torch.Tensor:
        """(1, N) positions restarting at 0 for each sequence: the padded batch's positions of its tokens."""
        starts = self.cu_seq_lens[:-1].long().repeat_interleave(self.lengths)
        return (torch.arange(self.index.numel(), device=self.index.device) - starts).unsqueeze(0)

    def same_sequence_next(self) -> torch.Tensor:
        """(N,) whether the next packed token belongs to the same sequence (the token predicts it)."""
        rows = self.rows
        return torch.cat([rows[1:] == rows[:-1], rows.new_zeros(1, dtype=torch.bool)])

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[1, N, ...]``: the attended tokens' values in one row."""
        return values.flatten(0, 1)[self.index].unsqueeze(0)

    def unpack(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, T, ...]``, ``fill`` at padding (differentiable)."""
        batch, length = self.shape
        out = values.new_full((batch * length, *values.shape[1:]), fill)
        return out.index_copy(0, self.index, values).view(batch, length, *values.shape[1:])

    def model_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
        """A causal LM's keyword inputs for the packed row: no attention mask, position ids restarting per
        sequence (transformers' block mask for sdpa/eager) and the boundaries varlen/flash attention read.
        Call the model with ``use_cache=False`` too: with a cache, transformers does not look for packed rows."""
        cu = self.cu_seq_lens
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        return {"input_ids": self.pack(input_ids), "position_ids": self.position_ids(), "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def last_non_pad(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """(B,) each row's rightmost token that is not ``pad_token_id``: where transformers' sequence classifiers
    read their score."""
    if pad_token_id is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


_FALLBACKS = [0]  # padding-free forwards run padded in this process (a model that cannot read a packed row)


def fallbacks() -> int:
    """How many padding-free forwards this process ran padded: trainers log the run's count."""
    return _FALLBACKS[0]


@functools.cache
def _takes_position_ids(cls: type) -> bool:
    """Whether ``cls.forward`` takes position ids (read once per class: every training forward asks)."""
    try:
        return "position_ids" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def packs(model: Any) -> bool:
    """Whether ``model`` reads a packed row as separate sequences: its forward takes position ids (transformers
    then attends each sequence apart) and it has no ALiBi bias (built from the attention mask). Else padding-free
    forwards run padded, said once per model class."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    base = module.get_base_model() if hasattr(module, "get_base_model") else module  # a peft model's
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if _takes_position_ids(type(base)) and not getattr(text, "alibi", False):
        return True
    _FALLBACKS[0] += 1
    name = type(base).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        logging.getLogger(__name__).warning("%s takes no position ids (or has an ALiBi bias), so a packed row would "
                                            "attend across its sequences: its padding_free forwards run padded", name)
    return False
