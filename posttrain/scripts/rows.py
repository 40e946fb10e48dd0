"""The run ``posttrain sft|reward|dpo`` share, in TRL's scripts' order: parse, build the trainer on its
data, evaluate, train, save; then held-out metrics before -> after, ``summary.json``, card and upload."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from trl import ModelConfig, ScriptArguments

from posttrain.scripts.args import (
    demo_config,
    finish,
    model_arguments,
    parse_config,
    record_script_arguments,
    require_dataset,
)
from posttrain.scripts.data import bundled_pairs, trainer_on_data


@dataclass
class PairArguments:
    """Beside TRL's ScriptArguments (dataset_name, dataset_train_split, dataset_test_split, ...)."""

    test_split_size: float = 0.0  # held out of train (a fraction, or rows if >= 1) without a test split
    synthetic_train_size: int = 512  # bundled pairs (no dataset_name)
    synthetic_eval_size: int = 128
    bundled_name: ClassVar[str] = "posttrain's bundled synthetic preference pairs"  # in the model card

    def bundled(self) -> tuple[list[dict], list[dict]]:
        return bundled_pairs(self.synthetic_train_size, self.synthetic_eval_size)


def run(trainer_cls: Any, config_cls: type, data_cls: type, argv: list[str] | None, *,
        demo_model: Callable[[], Any], metrics: tuple[str, ...], saved: str,
        check: Callable[[Any, str], None] | None = None,
        train_summary: Callable[[list[dict]], dict] | None = None,
        trainer_kwargs: Callable[[Any], dict] | None = None) -> None:
    """Parse, train, save, report. ``demo_model()``: model if none named; ``data_cls``: ``test_split_size``,
    ``bundled()``, ``bundled_name``; ``metrics``: for ``summary.json``, first two printed before -> after."""
    name = trainer_cls.name
    script, data, cfg, model_args = parse_config((ScriptArguments, data_cls, config_cls, ModelConfig),
                                                 demo_config(name), argv, prog=f"posttrain {name}")
    require_dataset([script, model_args])
    model, peft_config = model_arguments(model_args, cfg, demo_model)
    trainer, before = trainer_on_data(trainer_cls, cfg, script, data.test_split_size, data.bundled, check=check,
                                      model=model, peft_config=peft_config,
                                      **(trainer_kwargs(data) if trainer_kwargs else {}))
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    history = trainer.state.log_history
    final = trainer.save_model()
    if trainer.is_world_process_zero():
        summary: dict[str, Any] = {"steps": trainer.step, "final_model": str(final),
                                   **(train_summary(history) if train_summary else {})}
        if before:
            after = next(r for r in reversed(history) if f"eval/{metrics[0]}" in r)
            summary[f"eval_{metrics[0]}_before"] = before[f"eval/{metrics[0]}"]
            summary.update({f"eval_{m}": after[f"eval/{m}"] for m in metrics})
            first, second = (f"eval/{m}" for m in metrics[:2])
            print(f"held-out {first}: {_shown(first, before)} -> {_shown(first, after)} "
                  f"({second} {_shown(second, before)} -> {_shown(second, after)})")
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        record_script_arguments(cfg.output_dir, script, data, model_args)
        print(f"{saved} saved to {final}; metrics in {cfg.output_dir}/metrics.jsonl")
    finish(trainer, script.dataset_name or data.bundled_name)


def _shown(key: str, row: dict) -> str:
    """Losses to 4 decimals, rates to 3."""
    return f"{row[key]:.4f}" if key.endswith("loss") else f"{row[key]:.3f}"
