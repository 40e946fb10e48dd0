"""GRPO/RLOO for the harness: posttrain's trainer under a mix, TRL's own trainer as the baseline.

benchmarks/harness/workloads.py runs them (``python benchmarks/races/grpo_bench.py`` or the harness's
``--workload grpo``). Both sides run the same thing:

- the policy of the spec's shape with random weights (benchmarks/harness/bench_models.py; TRL loads its
  reference from the policy's path), and the tiny default's tokenizer;
- prompts of about ``seq_len - response_len`` tokens, ``num_generations`` completions each of up to
  ``response_len`` tokens, ``micro_batch`` completions per GPU per step, one optimizer step per
  generation; a cheap Python reward function (so the comparison is the models' work);
- ``beta`` (default 0.04): the reference model, frozen.

``trl-zero2`` / ``trl-zero3`` run ``trl.GRPOTrainer`` (``trl.RLOOTrainer``) with that DeepSpeed
config and its own ``generate`` path (ZeRO-3 gathered for generation, TRL's default).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks.harness.bench_models import model_dir, prompt_rows
from posttrain.demo import tiny


def length_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A reward that costs nothing next to the models: the completion's length."""
    return [float(len(ids)) for ids in completion_ids]


def _settings(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPO's own settings, the same on both sides."""
    return dict(num_generations=spec.get("num_generations", 8), max_completion_length=spec["response_len"],
                beta=spec.get("beta", 0.04), temperature=1.0)


def _prompts(spec: dict[str, Any]) -> list[dict[str, str]]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = spec["warmup"] + spec["steps"] + spec.get("profile_steps", 0)
    prompts = steps * spec["micro_batch"] * world // spec.get("num_generations", 8)
    return prompt_rows(max(prompts, 1), spec["seq_len"] - spec["response_len"])


def _policy(spec: dict[str, Any]) -> Path:
    import torch

    return model_dir(spec["shapes"]["policy"], torch.bfloat16 if spec["precision"] == "bf16" else torch.float32)


def posttrain_trainer(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    """posttrain's GRPOTrainer (RLOOTrainer) and its arguments."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if spec["workload"] == "rloo" else (GRPOConfig, GRPOTrainer)
    # No checkpoint (TRL's side saves none either), unless the harness's settings say otherwise.
    cfg = config_cls(**{"save_strategy": "no", **common}, max_prompt_length=spec["seq_len"],
                     generation_backend=spec.get("generation_backend") or "posttrain",
                     compile_layers=spec.get("compile_layers"), **_settings(spec))
    return trainer_cls, dict(model=str(_policy(spec)), reward_funcs=[length_reward], args=cfg,
                             train_dataset=_prompts(spec))


def trl_trainer(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    """TRL's own GRPOTrainer (RLOOTrainer) and its arguments."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if spec["workload"] == "rloo" else (GRPOConfig, GRPOTrainer)
    path = _policy(spec)
    args = config_cls(**_settings(spec), **common)
    return trainer_cls, dict(model=str(path), reward_funcs=[length_reward], args=args,
                             train_dataset=Dataset.from_list(_prompts(spec)), processing_class=tiny.load_tokenizer(path))
