"""``posttrain dpo`` (and examples/dpo.py): DPO with the policy and the reference on their own
DeepSpeed plugins.

With no model it trains the built-in tiny default on bundled synthetic preference pairs under the
demo settings (posttrain/scripts/demo/dpo.yaml) and reports held-out reward accuracy. With
``--model_name_or_path`` and ``--dataset_name`` (a hub name or a local json/jsonl/parquet/csv file)
TRL's DPOConfig defaults apply, as in ``trl dpo``; ``--config FILE`` gives settings of your own.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import ScriptArguments

from .. import preference
from ..modelcard import write_model_card
from ..trainers.dpo import DPOConfig, DPOTrainer
from .args import demo_config, parse_config, require_dataset, run_script
from .data import bundled_pairs, trainer_on_data
from .hub import push_to_hub


@dataclass
class DataArguments:
    """Beside TRL's ScriptArguments (dataset_name, dataset_train_split, dataset_test_split, ...)."""

    # Hold out this fraction of the training split (or this many rows, if >= 1) for evaluation, when
    # the dataset has no test split (a single file has only "train").
    test_split_size: float = 0.0
    synthetic_train_size: int = 512  # bundled pairs (no dataset_name)
    synthetic_eval_size: int = 128


def main(argv: list[str] | None = None) -> None:
    script, data, cfg = parse_config((ScriptArguments, DataArguments, DPOConfig), demo_config("dpo"), argv,
                                     prog="posttrain dpo")
    require_dataset([script, cfg])
    trainer, before = trainer_on_data(DPOTrainer, cfg, script, data.test_split_size,
                                      lambda: bundled_pairs(data.synthetic_train_size, data.synthetic_eval_size),
                                      check=preference.check_rows)
    trainer.train()
    if trainer.session.is_main_process and before:
        after = next(r for r in reversed(trainer.history) if "eval/rewards/accuracies" in r)
        print(f"held-out eval/rewards/accuracies: {before['eval/rewards/accuracies']:.3f} -> "
              f"{after['eval/rewards/accuracies']:.3f} (eval/loss {before['eval/loss']:.4f} -> {after['eval/loss']:.4f})")
    if trainer.session.is_main_process:
        # The card written at the end of training cannot know the data (the trainer takes rows): name it.
        write_model_card(cfg.output_dir, cfg, "dpo", trainer.session,
                         dataset_name=script.dataset_name or "posttrain's bundled synthetic preference pairs")
    final = trainer.save_model()  # the output dir itself, as TRL
    if cfg.push_to_hub and trainer.session.is_main_process:
        print(f"pushed to {push_to_hub(cfg, final)}")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
