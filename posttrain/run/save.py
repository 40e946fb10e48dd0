"""A trained role's final model, saved where TRL's ``save_model`` puts it: its weights (or its
adapter, or the base with the adapter merged in) in the dtype it was loaded in, and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from posttrain.models.lora import has_adapters, save_merged
from posttrain.placement.session import Session

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def save_trained_model(session: Session, role: str, directory: str | os.PathLike, tokenizer: Any = None,
                       merge_adapters: bool = False) -> Path:
    """Save a role's final HF model to ``directory`` (LoRA: adapter or merged); full saves drop adapters."""
    path = Path(directory)
    adapted = has_adapters(session.unwrap(role))
    if session.is_main_process and (merge_adapters or not adapted):
        for name in _ADAPTER_FILES:
            (path / name).unlink(missing_ok=True)
    if not (adapted and merge_adapters):
        session.save_pretrained(role, path, tokenizer=tokenizer)
        return path
    # In the dtype the model was loaded in; collective, under ZeRO-3 only rank 0 gets the weights.
    state_dict = session.saved_state_dict(role)
    if session.is_main_process:
        save_merged(session.unwrap(role), state_dict, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    session.wait_for_everyone()
    return path
