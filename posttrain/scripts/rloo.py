"""``posttrain rloo`` (and examples/rloo.py): RLOO (TRL 1.16's RLOOTrainer: leave-one-out
baseline, KL folded into the reward) with GRPO's roles and placement: a ZeRO-2 policy, a ZeRO-3
reference (none at ``beta: 0``) and reward models as ZeRO-3 roles.

With no model it runs on the built-in tiny default under the demo settings
(posttrain/scripts/demo/rloo.yaml); with ``--model_name_or_path`` the RLOOConfig defaults (TRL's).
``--use_peft`` (with TRL's ``lora_*`` flags) trains LoRA adapters, with the base as the reference.
"""

from __future__ import annotations

from posttrain.scripts.args import run_script
from posttrain.scripts.grpo import run
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def main(argv: list[str] | None = None) -> None:
    run(RLOOConfig, RLOOTrainer, "rloo", argv)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
