"""``posttrain dpo`` (and examples/dpo.py): DPO with the policy and the reference on their own
DeepSpeed plugins.

With no model it trains the built-in tiny default on bundled synthetic preference pairs under the
demo settings (posttrain/scripts/demo/dpo.yaml) and reports held-out reward accuracy. With
``--model_name_or_path`` and ``--dataset_name`` (a hub name or a local json/jsonl/parquet/csv file)
TRL's DPOConfig defaults apply, as in ``trl dpo``; ``--config FILE`` gives settings of your own.
"""

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
