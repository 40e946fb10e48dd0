"""``posttrain dpo``: DPO; with no model named, the built-in tiny default on bundled preference pairs."""

from __future__ import annotations

from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.rows import PairArguments as DataArguments
from posttrain.scripts.rows import run
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


def main(argv: list[str] | None = None) -> None:
    run(DPOTrainer, DPOConfig, DataArguments, argv, demo_model=tiny.sft_model_path,
        metrics=("rewards/accuracies", "loss", "rewards/margins"), saved="policy", check=preference.check_rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
