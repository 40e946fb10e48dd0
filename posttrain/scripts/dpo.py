"""``posttrain dpo``: DPO; with no model named, the built-in tiny default on bundled preference pairs."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.rows import PairArguments, run
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


@dataclass
class DataArguments(PairArguments):
    """PairArguments and the reference model, a script setting (TRL's script has none: its reference is the
    policy's initial weights, as here by default). The trainer takes it as ``ref_model=``."""

    ref_model_name_or_path: str | None = None  # with --use_peft, a reference of its own instead of the base


def main(argv: list[str] | None = None) -> None:
    run(DPOTrainer, DPOConfig, DataArguments, argv, demo_model=tiny.sft_model_path,
        metrics=("rewards/accuracies", "loss", "rewards/margins"), saved="policy", check=preference.check_rows,
        trainer_kwargs=lambda data: {"ref_model": data.ref_model_name_or_path})


if __name__ == "__main__":
    raise SystemExit(run_script(main))
