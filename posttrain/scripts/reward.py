"""``posttrain reward``: a Bradley-Terry reward model; with no model named, the tiny SFT policy's."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.rows import PairArguments, run
from posttrain.trainers.reward import RewardConfig, RewardTrainer


@dataclass
class DataArguments(PairArguments):
    """PairArguments with more bundled pairs than DPO's."""

    synthetic_train_size: int = 1024
    synthetic_eval_size: int = 256


def main(argv: list[str] | None = None) -> None:
    run(RewardTrainer, RewardConfig, DataArguments, argv, demo_model=tiny.sft_model_path,
        metrics=("accuracy", "loss", "margin"), saved="reward model", check=preference.check_rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
