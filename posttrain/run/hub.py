"""``--push_to_hub``: upload the final model as ``transformers.Trainer.push_to_hub`` does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from posttrain.run.output_dir import LOCK_FILE

RUN_FILES = ["README.md", "*.png"]  # the model card and learning curves
IGNORED = ["_*", "checkpoint-*", LOCK_FILE]


def hub_repo_id(cfg: Any) -> str:
    """``hub_model_id``, or the output dir's name (Trainer's default)."""
    return cfg.hub_model_id or Path(cfg.output_dir).resolve().name


def push_to_hub(cfg: Any, model_dir: str | os.PathLike, commit_message: str = "End of training") -> str:
    """Upload ``model_dir`` (and the run's card and plots); returns the repo's URL. Main process only."""
    from huggingface_hub import HfApi

    api = HfApi(token=getattr(cfg, "hub_token", None))
    repo = api.create_repo(hub_repo_id(cfg), private=cfg.hub_private_repo, exist_ok=True)
    repo_id = repo.repo_id
    api.upload_folder(repo_id=repo_id, folder_path=str(model_dir), commit_message=commit_message,
                      ignore_patterns=IGNORED)
    elsewhere = Path(model_dir).resolve() != Path(cfg.output_dir).resolve()
    if elsewhere and any(any(Path(cfg.output_dir).glob(p)) for p in RUN_FILES):
        api.upload_folder(repo_id=repo_id, folder_path=cfg.output_dir, allow_patterns=RUN_FILES,
                          commit_message=f"{commit_message}: model card")
    return str(repo)
