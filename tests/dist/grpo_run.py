"""Runs GRPO or RLOO on the tiny default with JSON overrides; rank 0 writes the metric history.

    torchrun --standalone --nproc_per_node 2 tests/dist/grpo_run.py OUT.json '{"mix": "zero3"}' [rloo]
"""

import json
import sys

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

BASE = dict(learning_rate=1e-3, lr_scheduler_type="constant", per_device_train_batch_size=8, num_generations=4,
            max_completion_length=6, temperature=1.0, max_steps=2, disable_tqdm=True, seed=7)


def main(out: str, overrides: str, algorithm: str = "grpo") -> None:
    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if algorithm == "rloo" else (GRPOConfig, GRPOTrainer)
    cfg = config_cls(**{**BASE, **json.loads(overrides)})
    trainer = trainer_cls(cfg)
    history = trainer.train()
    if trainer.session.is_main_process:
        roles = sorted(trainer.session.roles)
        json.dump({"history": history, "roles": roles, "rollout": trainer.rollout.stats}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
