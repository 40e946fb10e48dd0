"""``posttrain`` command line: the trainers (``posttrain sft|reward|dpo|ppo|distill|grpo|rloo``, each the
module ``posttrain.scripts.<name>`` that examples/<name>.py runs too, with the same YAML and
flags), ``posttrain bench`` (the ZeRO-mix benchmark) and ``posttrain plan`` (the memory planner)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from . import memory
from .roles import MIXES


def _bench(argv: list[str]) -> int:
    # The harness lives in the source checkout's benchmarks/ (it is not part of the wheel).
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "harness.py").exists():
        print("posttrain bench needs a source checkout of posttrain (benchmarks/harness.py)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from benchmarks import harness

    return harness.main(argv)


def _plan(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="posttrain plan", description="Per-GPU memory per role and mix; "
                                 "recommends the fastest mix that fits.")
    ap.add_argument("--workload", choices=list(memory.WORKLOADS), default="dpo")
    ap.add_argument("--shape", default="1b", help=f"a preset ({', '.join(memory.SHAPES)}), hub name or local path")
    ap.add_argument("--role-shape", action="append", default=[], metavar="ROLE=SHAPE")
    ap.add_argument("--mix", default="all", help=f"one of {', '.join(MIXES)}, trl-zero2, trl-zero3, or all")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--gpu-memory", type=float, default=139.0, help="GiB per GPU (an H200 shows 139.8)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--generation-backend", choices=["posttrain", "hf"], default="posttrain",
                    help="online workloads: posttrain.rollout (KV cache and graph held for the run) or generate")
    args = ap.parse_args(argv)
    names = memory.WORKLOADS[args.workload]
    shapes = {}.fromkeys(names["trained"] + names["frozen"], args.shape)
    for item in args.role_shape:
        role, _, value = item.partition("=")
        if role not in shapes or not value:
            ap.error(f"--role-shape {item!r}: expected ROLE=SHAPE with ROLE one of {list(shapes)}")
        shapes[role] = value
    mixes = list(MIXES) if args.mix == "all" else [args.mix]
    plans = [memory.plan(args.workload, shapes, m, world_size=args.world_size, micro_batch=args.micro_batch,
                         seq_len=args.seq_len, response_len=args.response_len,
                         generation_backend=args.generation_backend, gpu_memory_gib=args.gpu_memory)
             for m in mixes]
    for p in plans:
        print(memory.format_plan(p) + "\n")
    best, why = memory.recommend(plans)
    print(f"recommended: {best.mix if best else 'none'} — {why}")
    return 0 if best else 1


# Trainer commands: each runs posttrain.scripts.<name>.main(argv), as examples/<name>.py does.
TRAINERS = ("sft", "reward", "dpo", "ppo", "distill", "grpo", "rloo")


def _trainer(name: str, argv: list[str]) -> int:
    from .scripts.args import run_script

    module = f"posttrain.scripts.{name}"
    if importlib.util.find_spec(module) is None:
        print(f"posttrain {name} is not available in this version of posttrain ({module} is missing)",
              file=sys.stderr)
        return 2
    return run_script(importlib.import_module(module).main, argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"bench": _bench, "plan": _plan, **{t: (lambda a, t=t: _trainer(t, a)) for t in TRAINERS}}
    if not argv or argv[0] not in commands:
        names = ",".join(commands)
        print(f"usage: posttrain {{{names}}} [options]   (posttrain COMMAND --help for each)", file=sys.stderr)
        if argv and not argv[0].startswith("-"):
            import difflib

            near = difflib.get_close_matches(argv[0], list(commands), n=1)
            print(f"unknown command {argv[0]!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                  file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
