"""``posttrain dpo``: DPO; with no model named, the built-in tiny default on bundled preference pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    parsed: list[DataArguments] = []

    @dataclass
    class Arguments(DataArguments):
        __doc__ = DataArguments.__doc__

        def __post_init__(self) -> None:  # the parsed settings, for the trainer's ref_model
            parsed.append(self)

    def trainer(**kwargs: Any) -> DPOTrainer:
        return DPOTrainer(ref_model=parsed[-1].ref_model_name_or_path, **kwargs)

    trainer.name = DPOTrainer.name  # type: ignore[attr-defined]
    run(trainer, DPOConfig, Arguments, argv, demo_model=tiny.sft_model_path,
        metrics=("rewards/accuracies", "loss", "rewards/margins"), saved="policy", check=preference.check_rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
