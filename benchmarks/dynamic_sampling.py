"""DAPO's dynamic sampling on the tiny default (CPU, 2 processes): GRPO with a reward that saturates (1 when a
completion holds a positive adjective and no negative one, else 0), with and without ``dynamic_sampling``, the
same seed and settings otherwise. Writes each run's per-step rows (the reward of the step's first generation
batch, as sampled; the step's wall time; the dynamic-sampling counters), a figure and a table.

    python benchmarks/dynamic_sampling.py [--steps 120] [--seeds 3] [--out benchmarks/results/<folder>]

Each run is one ``torchrun --nproc_per_node 2`` launch of this file (``--worker``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def saturating_reward(completions: list[str], **_: object) -> list[float]:
    """1 for a completion with a positive adjective and no negative one: groups saturate as the policy learns."""
    from posttrain.demo import words

    w = words()
    pos, neg = set(w["positive"]), set(w["negative"])
    out = []
    for c in completions:
        tokens = set(c.replace(".", " ").split())
        out.append(float(bool(tokens & pos) and not tokens & neg))
    return out


def worker(args: argparse.Namespace) -> None:
    """One run per seed, one after the other in this process group; rank 0 writes their rows."""
    from posttrain.demo import tiny
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    keys = ("step", "reward", "frac_reward_zero_std", "time/step", "dynamic_sampling/extra_rounds",
            "dynamic_sampling/dropped_groups", "dynamic_sampling/underfilled")
    runs = []
    for seed in range(args.seeds):
        cfg = GRPOConfig(output_dir=f"{args.run_dir}-{seed}", overwrite_output_dir=True, seed=seed,
                         learning_rate=1e-4, lr_scheduler_type="constant", per_device_train_batch_size=32,
                         num_generations=8, max_completion_length=8, max_prompt_length=16, temperature=1.0,
                         beta=0.0, loss_type="dapo", max_steps=args.steps, logging_steps=1, save_strategy="no",
                         report_to=[], dynamic_sampling=args.dynamic, dynamic_sampling_max_rounds=4)
        trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=saturating_reward, args=cfg,
                              train_dataset=bundled_prompts(512))
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        trainer.end()
        rows = [{k: r[k] for k in keys if k in r} for r in trainer.state.log_history if "reward" in r]
        runs.append({"seed": seed, "wall_s": wall, "rows": rows})
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps({"dynamic_sampling": args.dynamic, "runs": runs}))


def launch(dynamic: bool, steps: int, seeds: int, out: Path) -> dict:
    result = out / f"{'dynamic' if dynamic else 'plain'}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--steps", str(steps), "--seeds", str(seeds), "--result", str(result), "--run_dir", str(Path(tempfile.gettempdir()) / f"posttrain-ds-{result.stem}")]
    if dynamic:
        cmd.append("--dynamic")
    root = str(Path(__file__).resolve().parents[1])  # this checkout's posttrain, not an installed one
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(result.read_text())


def smooth(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def report(modes: dict[str, dict], out: Path, targets: list[float]) -> str:
    """Per seed: the step and training time at which the 5-step mean reward first reaches each target; the
    figure: the seeds' mean reward against step and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    reach = "".join(f" step (training time) to reward >= {t} |" for t in targets)
    lines = [f"| run | seed |{reach} whole run | mean reward, last 10 steps | extra rounds | dropped groups "
             "| underfilled batches |", "|---|---|" + "---|" * len(targets) + "---|---|---|---|---|"]
    for (name, mode), color in zip(modes.items(), ("tab:blue", "tab:orange")):
        for run in mode["runs"]:
            rows = run["rows"]
            reward = smooth([r["reward"] for r in rows])
            clock = [sum(r["time/step"] for r in rows[: i + 1]) for i in range(len(rows))]
            label = name if run["seed"] == 0 else None
            axes[0].plot([r["step"] for r in rows], reward, color=color, alpha=0.8, lw=1, label=label)
            axes[1].plot(clock, reward, color=color, alpha=0.8, lw=1, label=label)
            hits = [next((i for i, v in enumerate(reward) if v >= t), None) for t in targets]
            cells = "".join(f" {rows[h]['step']} ({clock[h]:.1f} s) |" if h is not None else " not reached |"
                            for h in hits)
            total = {k: sum(r.get(f"dynamic_sampling/{k}", 0.0) for r in rows)
                     for k in ("extra_rounds", "dropped_groups", "underfilled")}
            last = [r["reward"] for r in rows[-10:]]
            lines.append(f"| {name} | {run['seed']} |{cells} {clock[-1]:.1f} s | "
                         f"{sum(last) / len(last):.3f} | {total['extra_rounds']:.0f} | {total['dropped_groups']:.0f} | "
                         f"{total['underfilled']:.0f} |")
    for ax, xlabel in zip(axes, ("optimizer step", "training time (s, sum of step times)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward (5-step mean), one line a seed")
        for t in targets:
            ax.axhline(t, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dynamic_sampling.png", dpi=110)
    table = "\n".join(lines) + "\n"
    (out / "dynamic_sampling.md").write_text(table)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/2026-12-04-cpu-dynamic-sampling")
    p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.95])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--result", default="")
    p.add_argument("--run_dir", default="")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"without dynamic sampling": launch(False, args.steps, args.seeds, out),
            "dynamic_sampling: true": launch(True, args.steps, args.seeds, out)}
    print(report(runs, out, args.targets))


if __name__ == "__main__":
    main()
