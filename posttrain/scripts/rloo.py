"""``posttrain rloo``: RLOO as TRL's rloo.py script, with GRPO's roles, placement and script."""

from __future__ import annotations

from trl.scripts.rloo import RLOOScriptArguments

from posttrain.scripts.args import run_script
from posttrain.scripts.grpo import run
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def main(argv: list[str] | None = None) -> None:
    run(RLOOConfig, RLOOTrainer, "rloo", argv, script_cls=RLOOScriptArguments)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
