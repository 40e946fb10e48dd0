"""One GPU, DPO: TRL's own DPOTrainer against posttrain's, fp32 and bf16 optimizer states (issue 25).

One invocation runs the rows side by side, alternating, each in a fresh process (a clean allocator
peak and accelerate state), ``--rounds`` times:

- ``trl``: ``trl.DPOTrainer`` on a bf16 model with a bf16 reference, no DeepSpeed, AdamW on the
  bf16 parameters (no fp32 master weights): TRL's strongest single-GPU setting;
- ``posttrain-{torch,ds}-{bf16,fp32}``: posttrain's DPOTrainer, default mix, ``master_weights``
  bf16 or fp32, its policy trained without a DeepSpeed engine (``single_process_engine: torch``,
  posttrain/plain.py: the model and torch's fused AdamW) or by DeepSpeed's ZeRO-2 engine
  (``deepspeed``). What ``auto`` runs on one GPU: torch for bf16, DeepSpeed for fp32.

Both sides: the same random-weight model (Llama 1.1B shape, hidden 2048, 22 layers, built from a
config and saved once, as benchmarks/grpo_e2e.py does), ``--pairs`` preference pairs of
``--seq-len`` tokens each side per step, bf16, gradient checkpointing, learning rate 1e-6, one
optimizer step per batch, a log line every step. A step's time is the wall time between two
consecutive optimizer steps (device synchronised), so data, loss and logging count on both sides;
the median excludes the ``--warmup`` first steps. Memory: ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` over the whole run. Each row is printed as a JSON line as it finishes (and
appended to ``--out``); the last line has each row's median over rounds and the planner's figures.

    python benchmarks/dpo_race.py --out results.jsonl            # one GPU
    DS_ACCELERATOR=cpu python benchmarks/dpo_race.py --tiny --steps 2 --warmup 1 --rounds 1   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIDES = ("trl", "posttrain-torch-bf16", "posttrain-ds-bf16", "posttrain-torch-fp32", "posttrain-ds-fp32")
ENGINES = {"torch": "torch", "ds": "deepspeed"}
GiB = 2**30


def preference_rows(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` pairs whose prompt + completion is longer than ``seq_len`` tokens on either side, so
    that truncation to ``max_length = seq_len`` makes every sequence exactly that long."""
    from benchmarks.grpo_e2e import prompt_rows

    texts = prompt_rows(3 * n, seq_len // 2 + 8)
    return [{"prompt": texts[3 * i]["prompt"], "chosen": texts[3 * i + 1]["prompt"],
             "rejected": texts[3 * i + 2]["prompt"]} for i in range(n)]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: list[float]) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from posttrain.demo import tiny

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            stamps.append(time.perf_counter())

    cpu = not torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    args = DPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=spec["pairs"], max_length=spec["seq_len"],
                     learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"], bf16=True,
                     gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                     use_cpu=cpu, disable_tqdm=True, dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tiny.load_tokenizer(path), callbacks=[Stamp()])
    _sync()
    stamps.append(time.perf_counter())
    trainer.train()


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: list[float],
                  engine: str, master_weights: str) -> dict[str, Any]:
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    cfg = DPOConfig(output_dir=str(out / f"posttrain-{engine}-{master_weights}"), overwrite_output_dir=True,
                    model_name_or_path=str(path), per_device_train_batch_size=spec["pairs"],
                    max_length=spec["seq_len"], learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"],
                    bf16=True, master_weights=master_weights, gradient_checkpointing=True, logging_steps=1,
                    disable_tqdm=True, seed=0, single_process_engine=ENGINES[engine])
    trainer = DPOTrainer(cfg, train_dataset=rows)
    s = trainer.session
    step = s.step

    def stamped(name: str) -> bool:
        stepped = step(name)
        if stepped:
            _sync()
            stamps.append(time.perf_counter())
        return stepped

    s.step = stamped
    _sync()
    stamps.append(time.perf_counter())
    history = [h for h in trainer.train() if "loss" in h][spec["warmup"]:]
    # posttrain's own phase times (time/reference, time/backward, ...), medians of the measured steps.
    phases = sorted({k for h in history for k in h if k.startswith("time/")})
    return {"placements": {n: s.zero_stage(n) for n in s.roles}, "master_weights": s.master_weights("policy"),
            "engine": s.engine_kind("policy"),
            "one_rank_changes": s.one_rank_changes, "losses": [h["loss"] for h in history],
            "phase_s": {k.removeprefix("time/"): statistics.median(h.get(k, 0.0) for h in history) for k in phases}}


def child(side: str, spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """One row, in this process: the side's trainer for warm-up + measured steps."""
    import torch

    from benchmarks.grpo_e2e import model_dir

    path = model_dir(spec["shape"], torch.bfloat16)
    rows = preference_rows(spec["pairs"] * (spec["warmup"] + spec["steps"]), spec["seq_len"])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stamps: list[float] = []
    row: dict[str, Any] = {"side": side}
    if side == "trl":
        run_trl(spec, path, rows, out, stamps)
    else:
        _, engine, master_weights = side.split("-")
        row.update(run_posttrain(spec, path, rows, out, stamps, engine, master_weights))
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    if len(steps) != spec["warmup"] + spec["steps"]:
        raise RuntimeError(f"{side}: timed {len(steps)} optimizer steps, expected {spec['warmup'] + spec['steps']}")
    row["step_times"] = steps
    row["step_s"] = statistics.median(steps[spec["warmup"]:])
    if torch.cuda.is_available():
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    else:
        row["peak_allocated_gib"] = row["peak_reserved_gib"] = None
    return row


def planned(spec: dict[str, Any]) -> dict[str, float]:
    """The planner's per-GPU figures for posttrain's DeepSpeed rows (gradient checkpointing on, as run)."""
    from posttrain import memory

    plans = {mw: memory.plan("dpo", spec["shape"], "zero2-zero3", world_size=1, micro_batch=spec["pairs"],
                             seq_len=spec["seq_len"], master_weights=mw, gradient_checkpointing=True)
             for mw in ("fp32", "bf16")}
    return {**{f"planned_peak_{mw}_gib": p.peak / GiB for mw, p in plans.items()},
            **{f"planned_at_rest_{mw}_gib": p.at_rest / GiB for mw, p in plans.items()},
            "planned_fp32_extra_gib": (plans["fp32"].peak - plans["bf16"].peak) / GiB}


def main(argv: list[str] | None = None, *, doc: str = __doc__, all_sides: tuple[str, ...] = SIDES,
         child_fn: Any = None, planned_fn: Any = None, script: str = __file__, name: str = "dpo_race") -> int:
    """The race: every side once per round, alternating, each in a fresh process running ``script
    --child SIDE`` (benchmarks/distill_race.py reuses it with its own sides and rows)."""
    SIDES, child, planned = all_sides, child_fn or globals()["child"], planned_fn or globals()["planned"]  # noqa: N806
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape and 64-token sequences (a CPU check)")
    ap.add_argument("--shape", default=None, help="a preset of posttrain.memory.SHAPES (default 1b; tiny with --tiny)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="preference pairs (DPO) or rows (distillation) per step (default 4; 2 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; 64 with --tiny)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    ap.add_argument("--rounds", type=int, default=2, help="times every row runs, alternating")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    ap.add_argument("--out", default=None, help="a JSON-lines file the rows are appended to as they finish")
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / name), help="where the runs write")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    spec = {"shape": args.shape or ("tiny" if args.tiny else "1b"), "pairs": args.pairs or (2 if args.tiny else 4),
            "seq_len": args.seq_len or (64 if args.tiny else 512), "steps": args.steps, "warmup": args.warmup}
    work = Path(args.workdir)
    if args.child:  # one row in this process, its JSON on the last line of stdout
        row = child(args.child, spec, work)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        ap.error(f"unknown side(s) {sorted(unknown)}: choose from {', '.join(SIDES)}")
    out = Path(args.out) if args.out else None
    rows: list[dict[str, Any]] = []

    def emit(obj: dict[str, Any]) -> None:
        line = json.dumps(obj)
        print(line, flush=True)
        if out is not None:
            with out.open("a") as f:
                f.write(line + "\n")

    emit({"spec": spec, "sides": sides, "rounds": args.rounds, "command": " ".join(sys.argv)})
    for rnd in range(args.rounds):
        for side in sides:  # alternating: every side once per round
            cmd = [sys.executable, str(Path(script).resolve()), "--child", side,
                   "--shape", spec["shape"], "--pairs", str(spec["pairs"]), "--seq-len", str(spec["seq_len"]),
                   "--steps", str(spec["steps"]), "--warmup", str(spec["warmup"]), "--workdir", str(work)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode != 0 or not found:
                tail = (proc.stdout + proc.stderr)[-3000:]
                row = {"side": side, "round": rnd, "status": "error", "returncode": proc.returncode, "tail": tail}
            else:
                row = {**json.loads(found[-1][4:]), "round": rnd, "status": "ok"}
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            emit(row)
    summary: dict[str, Any] = {"summary": {}}
    for side in sides:
        ok = [r for r in rows if r["side"] == side and r["status"] == "ok"]
        if ok:
            peaks = [r["peak_allocated_gib"] for r in ok if r["peak_allocated_gib"] is not None]
            summary["summary"][side] = {"step_s": statistics.median(r["step_s"] for r in ok),
                                        "step_s_per_round": [r["step_s"] for r in ok],
                                        "peak_allocated_gib": max(peaks) if peaks else None}
    summary.update(planned(spec))
    emit(summary)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
