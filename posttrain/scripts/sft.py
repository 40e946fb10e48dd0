"""``posttrain sft`` (and examples/sft.py): supervised fine-tuning with the model on its own
DeepSpeed plugin.

With no model it trains the built-in tiny default (a randomly initialised tiny Llama) on the bundled
corpus (one sentence a row, TRL's language-modelling format) under the demo settings
(posttrain/scripts/demo/sft.yaml) and reports the held-out loss before and after. With
``--model_name_or_path`` and ``--dataset_name`` (text, messages, prompt/completion or tokenized
``input_ids``; a hub name or a local json/jsonl/parquet/csv file) TRL's SFTConfig defaults apply, as
in ``trl sft``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from ..demo import tiny
from ..modelcard import write_model_card
from ..trainers.sft import SFTConfig, SFTTrainer
from .args import demo_config, parse_config, require_dataset, run_script
from .data import trainer_on_data
from .hub import push_to_hub

BUNDLED = "posttrain's bundled corpus (one sentence a row)"


@dataclass
class DataArguments:
    """Beside TRL's ScriptArguments (dataset_name, dataset_train_split, dataset_test_split, ...)."""

    # Hold out this fraction of the training split (or this many rows, if >= 1) for evaluation, when
    # the dataset has no test split (a single file has only "train").
    test_split_size: float = 0.0
    corpus_eval_size: int = 300  # bundled corpus (no dataset_name): its last rows are held out


def bundled_corpus(data: DataArguments) -> tuple[list[dict], list[dict]]:
    """The bundled corpus (no dataset_name) as (train, held-out) rows: its last rows are held out."""
    lines, n = tiny.corpus(), data.corpus_eval_size
    return [{"text": t} for t in lines[:-n]], [{"text": t} for t in lines[-n:]]


def main(argv: list[str] | None = None) -> None:
    script, data, cfg = parse_config((ScriptArguments, DataArguments, SFTConfig), demo_config("sft"), argv,
                                     prog="posttrain sft")
    require_dataset([script, cfg])
    trainer, before = trainer_on_data(SFTTrainer, cfg, script, data.test_split_size, lambda: bundled_corpus(data))
    history = trainer.train()
    final = trainer.save_model()  # the output dir itself, as TRL
    if not trainer.session.is_main_process:
        return
    summary: dict[str, Any] = {"steps": trainer.step, "final_model": str(final),
                               "train_loss_first": history[0].get("loss") if history else None,
                               "train_loss_last": next((r["loss"] for r in reversed(history) if "loss" in r), None)}
    if before:
        after = next(r for r in reversed(history) if "eval/loss" in r)
        summary.update({"eval_loss_before": before["eval/loss"], "eval_loss": after["eval/loss"],
                        "eval_mean_token_accuracy": after["eval/mean_token_accuracy"]})
        print(f"held-out eval/loss: {before['eval/loss']:.4f} -> {after['eval/loss']:.4f} (eval/mean_token_accuracy "
              f"{before['eval/mean_token_accuracy']:.3f} -> {after['eval/mean_token_accuracy']:.3f})")
    Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    # The card written at the end of training cannot know the data (the trainer takes rows): name it.
    write_model_card(cfg.output_dir, cfg, "sft", trainer.session, dataset_name=script.dataset_name or BUNDLED)
    print(f"model saved to {final}; metrics in {cfg.output_dir}/metrics.jsonl")
    if cfg.push_to_hub:
        print(f"pushed to {push_to_hub(cfg, final)}")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
