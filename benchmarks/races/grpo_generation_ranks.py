"""Several GPUs of one host, GRPO on long-tailed completions: separate generation ranks against the colocated
layout on the same GPUs (issue 39: "generation ranks + training ranks against the colocated layout").

Rows (each one ``torchrun --nproc_per_node --nproc`` launch of this file, ``--worker``; rank 0 writes the row):

- ``colocated``: every rank trains and generates, ``async_generation: true``, ``max_staleness`` as given;
- ``generation-ranks``: the last ``--generation-processes`` ranks only generate, the others only train
  (``generation_processes``), the same ``max_staleness``; the same completions per optimizer step over all
  training ranks as the colocated row (``--prompts`` x ``--num-generations``), so each training rank trains more.

The workload is benchmarks/races/grpo_streaming_race.py's (random-weight Llama of ``--shape``, a stop set of
``--stop-frac`` of the vocabulary, the same stop set through `generation_kwargs`): useful tokens trained per second (completions'
tokens the loss reads, over the timed steps' wall time) and the phase times of rank 0.

The completions of a step must split into whole micro-batches on the training ranks of both layouts (``--nproc``
and ``--nproc`` less ``--generation-processes``), each rank's share whole groups.

    python benchmarks/races/grpo_generation_ranks.py --nproc 2 --out DIR       # 2 GPUs: 1 trains + 1 generates
    python benchmarks/races/grpo_generation_ranks.py --nproc 4 --prompts 96 --out DIR   # 4 GPUs: 3 + 1
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_generation_ranks.py --shape tiny --nproc 3 --steps 2 --warmup 1 \\
        --prompts 6 --num-generations 2 --micro 1 --prompt-len 8 --max-completion 16 --stop-frac 0.05 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races.grpo_streaming_race import length_reward, stop_ids  # noqa: E402

LAYOUTS = ("colocated", "generation-ranks")


def worker(args: argparse.Namespace) -> None:
    """One layout's run in this process group; rank 0 appends its row to ``--result``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from benchmarks.harness.bench_models import model_dir, prompt_rows
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    world = int(os.environ["WORLD_SIZE"])
    gen = args.generation_processes if args.layout == "generation-ranks" else 0
    train_ranks = world - gen
    rows_per_step = args.prompts * args.num_generations
    if rows_per_step % (train_ranks * args.micro):
        raise SystemExit(f"{rows_per_step} completions a step do not split into {train_ranks} ranks x micro-batches "
                         f"of {args.micro}")
    path = model_dir(args.shape, torch.bfloat16)
    stops = stop_ids(AutoConfig.from_pretrained(path).vocab_size, args.stop_frac)
    steps = args.warmup + args.steps
    cfg = GRPOConfig(output_dir=str(Path(args.workdir) / args.layout), overwrite_output_dir=True, save_strategy="no",
                     per_device_train_batch_size=args.micro,
                     gradient_accumulation_steps=rows_per_step // (train_ranks * args.micro),
                     num_generations=args.num_generations, max_completion_length=args.max_completion, beta=0.0,
                     temperature=1.0, learning_rate=1e-6, max_steps=steps, bf16=torch.cuda.is_available(), seed=0,
                     logging_steps=1, disable_tqdm=True, gradient_checkpointing=True, async_generation=True,
                     max_staleness=args.max_staleness, generation_processes=gen,
                     generation_kwargs={"eos_token_id": stops})
    trainer = GRPOTrainer(str(path), reward_funcs=[length_reward], args=cfg,
                          train_dataset=prompt_rows((steps + args.max_staleness + 2) * args.prompts, args.prompt_len))
    stamps: list[float] = []
    if not trainer.session.generates:
        step = trainer.session.step

        def stamped(name: str) -> bool:
            stepped = step(name)
            if stepped:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())
            return stepped

        trainer.session.step = stamped
    stamps.append(time.perf_counter())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    trainer.end()
    if dist.get_rank() == 0:
        times = [b - a for a, b in zip(stamps, stamps[1:])]
        tokens = [float(h["completions/mean_length"]) * rows_per_step for h in history]
        timed = slice(args.warmup, None)
        row = {"layout": args.layout, "processes": world, "training_ranks": train_ranks, "generation_processes": gen,
               "max_staleness": args.max_staleness, "step_times": times, "tokens_per_step": tokens,
               "tokens_per_s": sum(tokens[timed]) / max(sum(times[timed]), 1e-9),
               "staleness_max": [h.get("sample/staleness_max") for h in history],
               "phase_s": {k.removeprefix("time/"): sum(h.get(k, 0.0) for h in history[timed]) / max(args.steps, 1)
                           for k in sorted({k for h in history for k in h if k.startswith("time/")})},
               "peak_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)}
        with open(args.result, "a") as f:
            f.write(json.dumps(row) + "\n")


def launch(args: argparse.Namespace, layout: str, out: Path) -> dict[str, Any]:
    result = out / "grpo_generation_ranks.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--layout", layout, "--result", str(result), "--workdir", str(out / "work"),
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k not in ("worker", "layout", "result", "workdir", "out", "nproc")]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = out / "logs" / f"grpo_generation_ranks-{layout}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in result.read_text().splitlines()] if result.is_file() else []
    row = next((r for r in reversed(rows) if r["layout"] == layout), None)
    return row if proc.returncode == 0 and row else {"layout": layout, "status": f"failed ({proc.returncode})",
                                                      "log": str(log)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--generation-processes", type=int, default=1)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--prompts", type=int, default=64, help="prompts per optimizer step, over all training ranks")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--micro", type=int, default=32, help="completions per micro-batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-completion", type=int, default=512)
    p.add_argument("--stop-frac", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--layout", choices=LAYOUTS, default="colocated")
    p.add_argument("--result", default="")
    p.add_argument("--workdir", default="")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.nproc <= args.generation_processes:
        raise SystemExit(f"--nproc {args.nproc} leaves no training rank beside --generation-processes "
                         f"{args.generation_processes}")
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y-%m-%d')}-generation-ranks")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(["python", "benchmarks/races/grpo_generation_ranks.py", *sys.argv[1:]]) + "\n")
    rows = {layout: launch(args, layout, out) for layout in LAYOUTS}
    ok = all("tokens_per_s" in r for r in rows.values())
    for layout, r in rows.items():
        print(layout, {k: r.get(k) for k in ("status", "tokens_per_s", "training_ranks", "staleness_max", "log")})
    if ok:
        x = rows["generation-ranks"]["tokens_per_s"] / rows["colocated"]["tokens_per_s"]
        print(f"generation ranks against colocated on {args.nproc} processes: {x:.2f}x useful tokens/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
