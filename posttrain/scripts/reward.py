"""``posttrain reward`` (and examples/reward.py): a Bradley-Terry reward model (a one-logit sequence
classifier) with the model on its own DeepSpeed plugin; its saved folder is what PPO's
``--reward_model_path`` and GRPO/RLOO's ``--reward_funcs`` take.

With no model it starts from the built-in tiny default's SFT policy (a new score head) on bundled
synthetic preference pairs under the demo settings (posttrain/scripts/demo/reward.yaml) and reports
held-out accuracy. With ``--model_name_or_path`` and ``--dataset_name`` (chosen/rejected, optional
prompt and margin, standard or conversational) TRL's RewardConfig defaults apply, as in ``trl reward``.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.scripts.args import run_script
from posttrain.scripts.rows import PairArguments, run
from posttrain.trainers.reward import RewardConfig, RewardTrainer


@dataclass
class DataArguments(PairArguments):
    """The preference-pair flags (PairArguments), with more bundled pairs than DPO's."""

    synthetic_train_size: int = 1024
    synthetic_eval_size: int = 256


def main(argv: list[str] | None = None) -> None:
    run(RewardTrainer, RewardConfig, DataArguments, argv, demo_model=tiny.sft_model_path,
        metrics=("accuracy", "loss", "margin"), saved="reward model", check=preference.check_rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
