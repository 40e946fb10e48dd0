"""GRPO/RLOO end to end: posttrain's trainer under its mixes against TRL's own trainer (rows
``trl-zero2``, ``trl-zero3``), each mix in a fresh process group through the harness's ``run_one``
and saved into the same results directory, table and plot.

    python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 2 --micro-batch 16 \\
        --seq-len 384 --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2,trl-zero3

``--micro-batch``: completions per GPU per step (TRL's per_device_train_batch_size); ``--seq-len``:
prompt plus completion. See benchmarks/harness/grpo_e2e.py for what runs (benchmarks/harness/workloads.py runs it).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import harness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["grpo", "rloo"], default="grpo")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--mixes", default="zero2-zero3,trl-zero2,trl-zero3")
    ap.add_argument("--generation-backend", choices=["posttrain", "hf"], default="posttrain")
    ap.add_argument("--compile-layers", choices=["auto", "on", "off"], default="auto",
                    help="posttrain's compile_layers (auto: its default, on a GPU where it applies)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", choices=["bf16", "no"], default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--memory-at-rest", action="store_true", help="as the harness's: what is live between steps, "
                    "by origin (a diagnostic run: recording slows the steps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if (args.micro_batch * args.nproc) % args.num_generations:
        raise SystemExit("--micro-batch x --nproc must be a multiple of --num-generations (whole prompt groups)")
    import torch

    precision = args.precision or ("bf16" if torch.cuda.is_available() else "no")
    out = Path(args.out or ROOT / "benchmarks" / "results" /
               f"{datetime.date.today().isoformat()}-{harness.machine_name(args.nproc)}")
    out.mkdir(parents=True, exist_ok=True)
    base = dict(workload=args.workload, shapes=harness.parse_shapes(args.workload, args.shape, []),
                micro_batch=args.micro_batch, seq_len=args.seq_len, response_len=args.response_len,
                num_generations=args.num_generations, beta=args.beta, warmup=args.warmup, steps=args.steps,
                precision=precision, generation_backend=args.generation_backend, memory_at_rest=args.memory_at_rest,
                compile_layers={"auto": None, "on": True, "off": False}[args.compile_layers])
    command = shlex.join(["python", "benchmarks/races/grpo_bench.py", *argv])
    env = harness.environment()
    rows = []
    for mix in [m.strip() for m in args.mixes.split(",") if m.strip()]:
        spec = {**base, "mix": mix}
        name = f"{harness.case_name(spec)}-g{args.num_generations}"
        # A row whose rollout engine fell back is "degraded" (harness.rollout_verdict).
        row = harness.run_one(spec, out / "runs" / f"{name}-{mix}", args.nproc, args.timeout)
        row.update(case=name, env=env, command=command, num_generations=args.num_generations, beta=args.beta)
        peak = max(row["peak_allocated_gib"]) if row.get("peak_allocated_gib") else None
        print(f"[grpo-bench] {name} {mix}: {row['status']} step {row.get('step_s')} s, peak {peak} GiB, "
              f"wall {row.get('wall_s')} s" + (f" :: {row['error'][:300]}" if row["status"] != "ok" else ""),
              flush=True)
        rows.append(row)
        harness.save(out, [row], command if len(rows) == 1 else "")
    print(f"[grpo-bench] results in {out}")
    return 0 if all(r["status"] in ("ok", "oom", "degraded") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
