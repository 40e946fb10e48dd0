"""``posttrain sft``: supervised fine-tuning; with no model named, the tiny default on the bundled corpus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.rows import run
from posttrain.trainers.sft import SFTConfig, SFTTrainer


@dataclass
class DataArguments:
    """Beside TRL's ScriptArguments (dataset_name, dataset_train_split, dataset_test_split, ...)."""

    test_split_size: float = 0.0  # held out of train (a fraction, or rows if >= 1) without a test split
    corpus_eval_size: int = 300  # bundled corpus (no dataset_name): its last rows are held out
    bundled_name: ClassVar[str] = "posttrain's bundled corpus (one sentence a row)"  # in the model card

    def bundled(self) -> tuple[list[dict], list[dict]]:
        """The bundled corpus as (train, held-out) rows."""
        lines, n = tiny.corpus(), self.corpus_eval_size
        return [{"text": t} for t in lines[:-n]], [{"text": t} for t in lines[-n:]]


def train_losses(history: list[dict]) -> dict:
    return {"train_loss_first": history[0].get("loss") if history else None,
            "train_loss_last": next((r["loss"] for r in reversed(history) if "loss" in r), None)}


def main(argv: list[str] | None = None) -> None:
    run(SFTTrainer, SFTConfig, DataArguments, argv, demo_model=tiny.model_path,
        metrics=("loss", "mean_token_accuracy"), saved="model", train_summary=train_losses)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
