"""Where the decode step's time goes at few live rows (issue 39: the step at 8 rows within 2.5x of its weight-read
floor): the engine's step for ``--rows`` rows over the bucket of ``--prompt-len`` + ``--new-tokens`` columns,
timed as a CUDA graph replay and eagerly, and profiled (torch.profiler) kernel by kernel.

The model is the random-weight preset of ``--shape`` (bf16). The rows are admitted once (random prompts), then
``--steps`` steps are replayed: the figure is milliseconds per step (CUDA events) against the floor, the weights'
bytes plus the bucket's KV bytes at 4.8 TB/s. The profile lists each kernel's calls and microseconds per step, so
the kernels per layer and the gaps between them show (the step's time minus the kernels' sum).

    python benchmarks/rollout/step_profile.py --out step_8rows_1b.json          # one GPU
    python benchmarks/rollout/step_profile.py --shape tiny --steps 2             # CPU: host ops only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.rollout.rollout_bench import BANDWIDTH, build  # noqa: E402


def kernel_table(prof: Any, steps: int, cuda: bool) -> list[dict[str, Any]]:
    """Each kernel's (on CPU: each op's) calls and microseconds per step, the costliest first."""
    rows = []
    for e in prof.key_averages():
        us = (e.self_device_time_total if cuda else e.self_cpu_time_total) / steps
        if us > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            rows.append({"name": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": round(us, 2)})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1b", help="a preset of posttrain.planner.memory.SHAPES")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=30, help="kernels listed")
    ap.add_argument("--out", default=None, help="a JSON file for the result")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from posttrain.rollout import Rollout, SamplingParams
    from posttrain.rollout.engine import Clock

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    model = build(args.shape, dev, torch.bfloat16)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.rows, args.prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, pad_token_id=0)
    r = Rollout(None, "policy", sampling, max_batch=args.rows, max_prompt_len=args.prompt_len, model=model)
    r.generate(ids, mask)  # compiles and captures what a rollout uses
    e = r.engine
    e.begin(1, args.new_tokens, args.prompt_len)
    e.admit(list(range(args.rows)), list(range(args.rows)), ids, mask)
    rows = e.rows_bucket(args.rows)
    length = e.length_bucket_for(e.columns(args.new_tokens))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * model.config.num_hidden_layers * rows * length * e.spec.kv_heads * e.spec.head_dim * 2
    result: dict[str, Any] = {"shape": args.shape, "rows": args.rows, "bucket_rows": rows, "columns": length,
                              "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "floor_ms": (params + kv) / BANDWIDTH * 1e3, "weight_bytes": params, "kv_bytes": kv}
    for mode, graphs in (("graph", True), ("eager", False)):
        if graphs and not e.use_graphs:
            continue
        e.use_graphs = graphs and cuda
        e.run(rows, length, args.steps)  # warm (a graph captured on its first use)
        clock = Clock(dev)
        e.run(rows, length, args.steps)
        ms = clock.lap() / args.steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            e.run(rows, length, args.steps)
            if cuda:
                torch.cuda.synchronize()
        table = kernel_table(prof, args.steps, cuda)
        summed = sum(k["us_per_step"] for k in table) / 1e3
        result[mode] = {"ms_per_step": ms, "ratio_to_floor": ms / result["floor_ms"],
                        "kernels_ms_per_step": summed, "kernel_calls_per_step": sum(k["calls_per_step"] for k in table),
                        "top": table[: args.top]}
    e.use_graphs = cuda
    result["degraded"] = r.degraded
    print(json.dumps({k: v for k, v in result.items() if k not in ("graph", "eager")}, indent=1))
    for mode in ("graph", "eager"):
        if mode in result:
            m = result[mode]
            print(f"{mode}: {m['ms_per_step']:.3f} ms/step ({m['ratio_to_floor']:.2f}x the floor), kernels "
                  f"{m['kernels_ms_per_step']:.3f} ms in {m['kernel_calls_per_step']:.0f} calls")
            for k in m["top"][:12]:
                print(f"  {k['us_per_step']:9.2f} us  {k['calls_per_step']:6.1f}x  {k['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
