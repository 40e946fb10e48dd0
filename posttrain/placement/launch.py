"""Launching on several processes: the shipped accelerate configs (``posttrain accelerate-config
NAME``) and a check that refuses a launch which asked for several processes and started one."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from posttrain.errors import ConfigError

ACCELERATE_DIR = Path(__file__).resolve().parents[1] / "presets" / "accelerate"


def accelerate_configs() -> dict[str, Path]:
    """The shipped accelerate configs by name (also ``configs/accelerate/`` in a clone)."""
    return {p.stem: p for p in sorted(ACCELERATE_DIR.glob("*.yaml"))}


def accelerate_config_path(name: str) -> Path:
    found = accelerate_configs()
    if name not in found:
        raise ConfigError(f"no accelerate config named {name!r}: choose one of {', '.join(found)}")
    return found[name]


def _relaunch_target(argv: list[str]) -> str:
    """What the user launched, for the sentence that names the right command."""
    if argv and Path(argv[0]).name == "posttrain":
        return "$(which posttrain)" + (f" {argv[1]}" if len(argv) > 1 else "")
    return argv[0] if argv else "SCRIPT"


def check_launch(env: Mapping[str, str] | None = None, argv: list[str] | None = None) -> None:
    """Refuse a process that ``accelerate launch --num_processes N`` (N > 1) started alone."""
    env = os.environ if env is None else env
    argv = sys.argv if argv is None else argv
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in env  # exported by every accelerate launcher
    if not launched_by_accelerate or "WORLD_SIZE" in env or "MASTER_ADDR" not in env:
        return
    target = _relaunch_target(argv)
    raise ConfigError("accelerate launch started 1 process where several were asked (with no accelerate "
                      "config, --use_deepspeed or several GPUs it starts only one): launch with `accelerate "
                      "launch --config_file $(posttrain accelerate-config cpu_2proc) --num_processes "
                      f"N {target}` or `torchrun --nproc_per_node N {target}` (for one process, leave "
                      "MASTER_ADDR unset)")


def accelerate_config_command(argv: list[str]) -> int:
    """``posttrain accelerate-config [NAME]``: a shipped config's path, or every name and path."""
    if not argv:
        for name, path in accelerate_configs().items():
            print(f"{name:12s} {path}")
        return 0
    if argv[0] in ("-h", "--help"):
        print("usage: posttrain accelerate-config [NAME]   (the path of a shipped accelerate config; none: all)\n"
              "  accelerate launch --config_file $(posttrain accelerate-config cpu_2proc) --num_processes 2 "
              "$(which posttrain) grpo")
        return 0
    try:
        print(accelerate_config_path(argv[0]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
