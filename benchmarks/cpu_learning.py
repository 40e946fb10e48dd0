"""GRPO settings compared by learning on the tiny default (CPU, 2 processes), a reward that saturates (1 when a
completion holds a positive adjective and no negative one, else 0), the same seeds and settings otherwise:

- ``--study dynamic_sampling``: with and without DAPO's ``dynamic_sampling``;
- ``--study streaming``: synchronous against ``async_generation`` at ``max_staleness`` 1 and 2, and at 1 without
  the sampling correction (``vllm_importance_sampling_correction: false``), over the same number of samples.

Writes each run's per-step rows (the reward of the step's batch, as sampled; the step's wall time; the study's
counters), a figure and a table.

    python benchmarks/cpu_learning.py --study streaming [--steps 120] [--seeds 3] [--out benchmarks/results/<folder>]

Each variant is one ``torchrun --nproc_per_node 2`` launch of this file (``--worker``)."""

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


# Each study's variants: name -> the GRPOConfig fields that differ.
STUDIES = {
    "dynamic_sampling": {"without dynamic sampling": {},
                         "dynamic_sampling: true": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 4}},
    "streaming": {
        "synchronous": {},
        "max_staleness 1": {"async_generation": True, "max_staleness": 1},
        "max_staleness 2": {"async_generation": True, "max_staleness": 2},
        "max_staleness 1, no correction": {"async_generation": True, "max_staleness": 1,
                                           "vllm_importance_sampling_correction": False},
    },
}
# The study's own settings beside the shared ones (streaming: completions of scattered lengths through half
# the slots, so groups start and finish across steps).
SETTINGS = {"dynamic_sampling": {"max_completion_length": 8},
            "streaming": {"max_completion_length": 16, "generation_kv_slots": 16}}
COUNTERS = {"dynamic_sampling": ("dynamic_sampling/extra_rounds", "dynamic_sampling/dropped_groups",
                                 "dynamic_sampling/underfilled"),
            "streaming": ("sample/staleness_mean", "streaming/dropped_groups")}


def worker(args: argparse.Namespace) -> None:
    """One run per seed, one after the other in this process group; rank 0 writes their rows."""
    from posttrain.demo import tiny
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    keys = ("step", "reward", "frac_reward_zero_std", "time/step", *COUNTERS[args.study])
    variant = STUDIES[args.study][args.variant]
    runs = []
    for seed in range(args.seeds):
        cfg = GRPOConfig(output_dir=f"{args.run_dir}-{seed}", overwrite_output_dir=True, seed=seed,
                         learning_rate=1e-4, lr_scheduler_type="constant", per_device_train_batch_size=32,
                         num_generations=8, max_prompt_length=16, temperature=1.0,
                         beta=0.0, loss_type="dapo", max_steps=args.steps, logging_steps=1, save_strategy="no",
                         report_to=[], **SETTINGS[args.study], **variant)
        trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=saturating_reward, args=cfg,
                              train_dataset=bundled_prompts(512))
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        trainer.end()
        rows = [{k: r[k] for k in keys if k in r} for r in trainer.state.log_history if "reward" in r]
        runs.append({"seed": seed, "wall_s": wall, "rows": rows})
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps({"variant": args.variant, "fields": variant, "runs": runs}))


def launch(study: str, variant: str, steps: int, seeds: int, out: Path) -> dict:
    stem = variant.replace(":", "").replace(",", "").replace(" ", "_")
    result = out / f"{stem}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--study", study, "--variant", variant, "--steps", str(steps), "--seeds", str(seeds),
           "--result", str(result), "--run_dir", str(Path(tempfile.gettempdir()) / f"posttrain-{study}-{stem}")]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's posttrain, not an installed one
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(result.read_text())


def smooth(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def report(study: str, modes: dict[str, dict], out: Path, targets: list[float]) -> str:
    """Per seed: the step and training time at which the 5-step mean reward first reaches each target, the mean
    reward over the last tenth of the steps and the study's counters; the figure: reward against step and
    against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    reach = "".join(f" step (training time) to reward >= {t} |" for t in targets)
    counters = COUNTERS[study]
    lines = [f"| run | seed |{reach} whole run | mean reward, last tenth |"
             + "".join(f" {c} (sum) |" for c in counters),
             "|---|---|" + "---|" * len(targets) + "---|---|" + "---|" * len(counters)]
    summary = []
    for (name, mode), color in zip(modes.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        tenth = []
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
            last = [r["reward"] for r in rows[-max(1, len(rows) // 10):]]
            tenth.append(sum(last) / len(last))
            sums = "".join(f" {sum(r.get(c, 0.0) for r in rows):.1f} |" for c in counters)
            lines.append(f"| {name} | {run['seed']} |{cells} {clock[-1]:.1f} s | {tenth[-1]:.3f} |{sums}")
        summary.append(f"| {name} | {sum(tenth) / len(tenth):.3f} | {min(tenth):.3f} .. {max(tenth):.3f} |")
    for ax, xlabel in zip(axes, ("optimizer step", "training time (s, sum of step times)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward (5-step mean), one line a seed")
        for t in targets:
            ax.axhline(t, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{study}.png", dpi=110)
    table = "\n".join(["| run | mean reward in the last tenth, mean of seeds | range over seeds |", "|---|---|---|",
                       *summary, "", *lines]) + "\n"
    (out / f"{study}.md").write_text(table)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--study", choices=sorted(STUDIES), default="streaming")
    p.add_argument("--out", default="")
    p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.95])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--variant", default="")
    p.add_argument("--result", default="")
    p.add_argument("--run_dir", default="")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y-%m-%d')}-cpu-{args.study.replace('_', '-')}")
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: launch(args.study, name, args.steps, args.seeds, out) for name in STUDIES[args.study]}
    print(report(args.study, runs, out, args.targets))


if __name__ == "__main__":
    main()
