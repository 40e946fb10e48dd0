"""``posttrain kto``: KTO; with no model named, the built-in tiny default on bundled unpaired feedback."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from posttrain.data import unpaired
from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.data import bundled_pairs
from posttrain.scripts.rows import PairArguments, run
from posttrain.trainers.kto import KTOConfig, KTOTrainer


@dataclass
class DataArguments(PairArguments):
    """PairArguments and the reference model, a script setting (TRL's script has none: its reference is the
    policy's initial weights, as here by default). The trainer takes it as ``ref_model=``."""

    ref_model_name_or_path: str | None = None  # with --use_peft, a reference of its own instead of the base
    bundled_name: ClassVar[str] = "posttrain's bundled synthetic unpaired feedback"  # in the model card

    def bundled(self) -> tuple[list[dict], list[dict]]:
        train, test = bundled_pairs(self.synthetic_train_size, self.synthetic_eval_size)
        return unpaired_feedback(train, seed=0), unpaired_feedback(test, seed=1)


def unpaired_feedback(pairs: list[dict], seed: int) -> list[dict]:
    """Each pair's completions as thumbs-up / thumbs-down rows, shuffled: KTO reads rows in order, and
    TRL's unpairing of pairs puts all desirable rows first."""
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]
    random.Random(seed).shuffle(rows)
    return rows


def check_split(dataset: object, name: str) -> None:
    """A split's columns and values; a training set of one label only is the trainer's to refuse (a held-out
    split may have one)."""
    unpaired.check_rows(dataset, name, both_labels=False)


def main(argv: list[str] | None = None) -> None:
    run(KTOTrainer, KTOConfig, DataArguments, argv, demo_model=tiny.sft_model_path,
        metrics=("rewards/margins", "loss", "rewards/chosen", "rewards/rejected", "kl"), saved="policy",
        check=check_split, trainer_kwargs=lambda data: {"ref_model": data.ref_model_name_or_path})


if __name__ == "__main__":
    raise SystemExit(run_script(main))
