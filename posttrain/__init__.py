"""posttrain: RLHF and post-training where every model role has its own DeepSpeed plugin."""

import os as _os

from posttrain.run.cache import cache_dir, torch_extensions_dir


def _default_accelerator() -> None:
    # DeepSpeed picks its accelerator at import: without CUDA it must be told "cpu" first.
    if "DS_ACCELERATOR" not in _os.environ:
        import torch

        if not torch.cuda.is_available():
            _os.environ["DS_ACCELERATOR"] = "cpu"
    # Build DeepSpeed's JIT ops into posttrain's cache, never into site-packages.
    _os.environ["TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir())


_default_accelerator()

import warnings as _warnings  # noqa: E402

# Deprecations raised inside DeepSpeed/transformers on every step, not actionable by users.
for _message in (r".*all_gather_into_tensor.* is deprecated", r".*is_gradient_checkpointing.* is deprecated"):
    _warnings.filterwarnings("ignore", message=_message, category=FutureWarning)

from posttrain.errors import ConfigError  # noqa: E402
from posttrain.placement.roles import DEFAULT_MIX, MIXES, Role, roles_for, roles_from_yaml  # noqa: E402
from posttrain.placement.session import Session  # noqa: E402

# TRL's class names: ``from posttrain import GRPOTrainer, GRPOConfig`` where a script had ``from trl import``.
# Imported on first use, so that ``import posttrain`` stays light.
_TRAINERS = {
    "SFTTrainer": "sft", "SFTConfig": "sft", "RewardTrainer": "reward", "RewardConfig": "reward",
    "DPOTrainer": "dpo", "DPOConfig": "dpo", "GRPOTrainer": "grpo", "GRPOConfig": "grpo", "RLOOTrainer": "rloo",
    "RLOOConfig": "rloo", "PPOTrainer": "ppo", "PPOConfig": "ppo", "DistillationTrainer": "distill",
    "DistillationConfig": "distill", "MultiTrainer": "multi", "MultiConfig": "multi",
    "KTOTrainer": "kto", "KTOConfig": "kto",
}


def __getattr__(name: str) -> object:
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(f"posttrain.trainers.{_TRAINERS[name]}"), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")


__all__ = ["ConfigError", "cache_dir", "DEFAULT_MIX", "MIXES", "Role", "Session", "roles_for", "roles_from_yaml",
           *_TRAINERS]
__version__ = "0.1.0"
