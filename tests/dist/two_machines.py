"""A short DPO run whose losses tests/test_multi_machine.py compares between one machine of two
processes and two machines of one process each (both on this host). Rank 0 writes JSON."""

import json
import sys
from pathlib import Path

from dpo_train import TRAIN

from posttrain.demo import tiny
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


def main(out: str, tmp: str) -> None:
    cfg = DPOConfig(output_dir=str(Path(tmp) / "run"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    learning_rate=1e-3, max_steps=3, logging_steps=1, max_length=64, disable_tqdm=True)
    trainer = DPOTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=TRAIN)
    trainer.train()
    history = trainer.state.log_history
    s = trainer.session
    if s.is_main_process:
        json.dump({"world": s.num_processes, "losses": [r["loss"] for r in history if "loss" in r]}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
