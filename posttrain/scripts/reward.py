"""``posttrain reward`` (and examples/reward.py): a Bradley-Terry reward model (a one-logit sequence
classifier) with the model on its own DeepSpeed plugin; its saved folder is what PPO's
``--reward_model_path`` and GRPO/RLOO's ``--reward_funcs`` take.

With no model it starts from the built-in tiny default's SFT policy (a new score head) on bundled
synthetic preference pairs under the demo settings (posttrain/scripts/demo/reward.yaml) and reports
held-out accuracy. With ``--model_name_or_path`` and ``--dataset_name`` (chosen/rejected, optional
prompt and margin, standard or conversational) TRL's RewardConfig defaults apply, as in ``trl reward``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from .. import preference
from ..modelcard import write_model_card
from ..trainers.reward import RewardConfig, RewardTrainer
from .args import demo_config, parse_config, require_dataset, run_script
from .data import bundled_pairs, trainer_on_data
from .hub import push_to_hub

BUNDLED = "posttrain's bundled synthetic preference pairs"


@dataclass
class DataArguments:
    """Beside TRL's ScriptArguments (dataset_name, dataset_train_split, dataset_test_split, ...)."""

    test_split_size: float = 0.0  # held-out fraction (or rows, if >= 1) when there is no test split
    synthetic_train_size: int = 1024  # bundled pairs (no dataset_name)
    synthetic_eval_size: int = 256


def main(argv: list[str] | None = None) -> None:
    script, data, cfg = parse_config((ScriptArguments, DataArguments, RewardConfig), demo_config("reward"), argv,
                                     prog="posttrain reward")
    require_dataset([script, cfg])
    trainer, before = trainer_on_data(RewardTrainer, cfg, script, data.test_split_size,
                                      lambda: bundled_pairs(data.synthetic_train_size, data.synthetic_eval_size),
                                      check=preference.check_rows)
    history = trainer.train()
    final = trainer.save_model()  # the output dir itself, as TRL
    if not trainer.session.is_main_process:
        return
    summary: dict[str, Any] = {"steps": trainer.step, "final_model": str(final)}
    if before:
        after = next(r for r in reversed(history) if "eval/accuracy" in r)
        summary.update({"eval_accuracy_before": before["eval/accuracy"], "eval_accuracy": after["eval/accuracy"],
                        "eval_loss": after["eval/loss"], "eval_margin": after["eval/margin"]})
        print(f"held-out eval/accuracy: {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f} "
              f"(eval/loss {before['eval/loss']:.4f} -> {after['eval/loss']:.4f})")
    Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    write_model_card(cfg.output_dir, cfg, "reward", trainer.session, dataset_name=script.dataset_name or BUNDLED)
    print(f"reward model saved to {final}; metrics in {cfg.output_dir}/metrics.jsonl")
    if cfg.push_to_hub:
        print(f"pushed to {push_to_hub(cfg, final)}")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
