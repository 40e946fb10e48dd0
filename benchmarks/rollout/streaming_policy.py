"""What ``stale_groups`` costs and what it saves, predicted: posttrain's own Scheduler, Stream and StreamingGeneration
decide every admission, step and drop over an engine whose sequences decode for scripted lengths
(benchmarks/harness/scripted_engine.py), and time is charged from costs measured on one H200 at 1.1B. A prediction
for the GPU streaming race (benchmarks/races/grpo_streaming_race.py), not a measurement.

The case is the race's: ``--prompts`` prompts x ``--num-generations`` completions a step, prompts of
``--prompt-len`` tokens, completions ending on any of a stop set of ``--stop-frac`` of the vocabulary on random
weights (geometric lengths, cut at ``--max-new``), ``--slots`` engine slots, a scheduling round of
``--sync-every`` decode steps. Rows: synchronous (``max_staleness`` 0: one generation batch at a time, trained
whole), then streaming at each ``--bounds`` with ``stale_groups`` drop (TRL AsyncGRPO's way) and wait, with
``--inflight-steps`` steps' worth of sequences in flight (default ``max_staleness`` + 1).

Costs (``--step-ms``): a decode step of R rows, interpolated over measured points (1.31 ms at 16 rows and 512
columns, 1.81 at 128 rows and 768 columns: NOTES 26) and extended on their slope beyond them; a prompt token's
prefill ``--prefill-us`` (16,384 prompt tokens in 78.5 ms, NOTES 44); the training phase ``--train-s`` for a step of
the race's mean tokens (1.82 s for 512 x (128 + 99), NOTES 44), scaled by the step's prompt and completion tokens.

    python benchmarks/rollout/streaming_policy.py --out streaming_policy.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness.scripted_engine import (  # noqa: E402
    ScriptedEngine,
    ScriptedRollout,
    completion_lengths,
    streaming_config,
)
from posttrain.rollout.sampling import SamplingParams  # noqa: E402
from posttrain.trainers.streaming import StreamingGeneration  # noqa: E402


def step_cost(points: list[tuple[int, float]]):
    """Milliseconds of a decode step of ``rows`` rows: linear between measured points, on the last slope past them."""
    points = sorted(points)

    def ms(rows: int) -> float:
        for (r0, m0), (r1, m1) in zip(points, points[1:]):
            if rows <= r1 or (r1, m1) == points[-1]:
                return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
        return points[0][1]

    return ms


def lengths_of(seed: int, stop_frac: float, max_new: int, group: int):
    """Each sequence's length: geometric (a stop token with chance ``stop_frac`` per token), cut at ``max_new``;
    fixed per (prompt, member) so every row of the study decodes the same completions."""
    table: dict[tuple[int, int], int] = {}

    def length(prompt: list[int], row: int) -> int:
        key = (prompt[0], row % group)
        if key not in table:
            rng = random.Random(hash((seed, key)))
            n = 1
            while n < max_new and rng.random() >= stop_frac:
                n += 1
            table[key] = n
        return table[key]

    return length


def run(args: argparse.Namespace, bound: int, policy: str) -> dict[str, Any]:
    """One row: ``args.steps`` steps after ``args.warmup``, timed by the cost model."""
    g, per_step = args.num_generations, args.prompts
    sampling = SamplingParams(max_new_tokens=args.max_new, pad_token_id=0)
    engine = ScriptedEngine(args.slots, sampling, lengths_of(args.seed, args.stop_frac, args.max_new, g),
                            sync_every=args.sync_every, step_ms=step_cost(args.step_ms),
                            prefill_ms=args.prefill_us / 1000)
    inflight = -1 if args.inflight_steps < 0 or not bound else args.inflight_steps * per_step * g
    cfg = streaming_config(g, per_step, bound, policy, inflight)

    def rows_of(cycle: int) -> list[int]:
        return [i for i in range(cycle * per_step, (cycle + 1) * per_step) for _ in range(g)]

    total = (args.warmup + args.steps + bound + 2) * per_step
    st = StreamingGeneration(ScriptedRollout(engine, args.prompt_len), cfg, 1, rows_of,
                             [[1000 + i] + [2] * (args.prompt_len - 1) for i in range(total)], 0)
    mean_tokens = args.num_generations * args.prompts * (args.prompt_len + args.mean_len)
    seconds = generating = useful = dropped = held = 0.0
    trained_lengths, staleness = [], []
    for step in range(args.warmup + args.steps):
        before = engine.ms
        groups = st.next_groups(drain=False)
        lengths = [int(n) for grp in groups for n in completion_lengths(grp.tokens)]
        train_s = args.train_s * (len(lengths) * args.prompt_len + sum(lengths)) / mean_tokens
        st.weights_changed()
        if step >= args.warmup:
            seconds += (engine.ms - before) / 1000 + train_s
            generating += (engine.ms - before) / 1000
            useful += sum(lengths)
            trained_lengths += lengths
            staleness += [st.version - 1 - grp.version for grp in groups]
            dropped += st.dropped
            held += st.held
        st.dropped = st.held = 0
    return {"max_staleness": bound, "stale_groups": policy if bound else "synchronous",
            "s_per_step": seconds / args.steps, "generate_s_per_step": generating / args.steps,
            "useful_tokens_per_s": useful / seconds,
            "dropped_groups_per_step": dropped / args.steps, "held_rounds_per_step": held / args.steps,
            "trained_mean_length": sum(trained_lengths) / len(trained_lengths),
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--stop-frac", type=float, default=0.01)
    ap.add_argument("--slots", type=int, default=512, help="the engine's slots (generation_kv_slots)")
    ap.add_argument("--sync-every", type=int, default=16, help="decode steps a scheduling round")
    ap.add_argument("--bounds", default="1,2,4", help="max_staleness values of the streaming rows")
    ap.add_argument("--inflight-steps", type=int, default=-1,
                    help="max_inflight_tasks of the streaming rows in steps' worth (-1: max_staleness + 1)")
    ap.add_argument("--step-ms", default="16:1.31,128:1.81", help="rows:ms of a decode step, measured")
    ap.add_argument("--prefill-us", type=float, default=78.5e3 / 16384, help="microseconds a prompt token")
    ap.add_argument("--train-s", type=float, default=1.82, help="training seconds of a step of mean tokens")
    ap.add_argument("--mean-len", type=float, default=99.0, help="the mean completion length --train-s was at")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="a JSON file of the rows")
    args = ap.parse_args(argv)
    args.step_ms = [(int(r), float(m)) for r, m in (p.split(":") for p in args.step_ms.split(","))]
    rows = [run(args, 0, "wait")]
    for bound in (int(b) for b in args.bounds.split(",")):
        rows += [run(args, bound, "drop"), run(args, bound, "wait")]
    base = rows[0]["useful_tokens_per_s"]
    columns = [("s/step", 8, "s_per_step", ".3f"), ("generate", 10, "generate_s_per_step", ".3f"),
               ("useful tok/s", 14, "useful_tokens_per_s", ".0f"), ("x sync", 8, "x_sync", ".3f"),
               ("dropped/step", 14, "dropped_groups_per_step", ".2f"), ("held/step", 11, "held_rounds_per_step", ".2f"),
               ("trained len", 13, "trained_mean_length", ".1f"), ("staleness", 11, "staleness_mean", ".2f")]
    print(f"{'rows':<22}" + "".join(f"{head:>{w}}" for head, w, _, _ in columns))
    for r in rows:
        r["x_sync"] = r["useful_tokens_per_s"] / base
        name = r["stale_groups"] if not r["max_staleness"] else f"{r['stale_groups']} @ {r['max_staleness']}"
        print(f"{name:<22}" + "".join(f"{r[key]:>{w}{fmt}}" for _, w, key, fmt in columns))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
