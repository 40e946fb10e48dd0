"""``posttrain rloo``: RLOO with GRPO's roles, placement and script."""

from __future__ import annotations

from posttrain.scripts.args import run_script
from posttrain.scripts.grpo import run
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def main(argv: list[str] | None = None) -> None:
    run(RLOOConfig, RLOOTrainer, "rloo", argv)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
