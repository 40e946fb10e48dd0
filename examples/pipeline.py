"""The whole RLHF pipeline on the built-in tiny default, two CPU processes per stage:
SFT -> reward model -> GRPO, each stage's saved model the next stage's input.

    python examples/pipeline.py            # or: make pipeline
    python examples/pipeline.py --output_dir runs/pipeline --launcher torchrun

1. SFT (examples/sft.py, configs/sft.yaml): the randomly initialised tiny Llama on the bundled
   corpus, packed padding-free; headline: the held-out loss.
2. Reward (examples/reward.py, configs/reward.yaml): the SFT model with a new one-logit head on
   bundled preference pairs (positive over negative continuations); headline: held-out accuracy.
3. GRPO (examples/grpo.py, configs/grpo.yaml): the SFT model as the policy, the reward model of
   stage 2 as its only reward (a ZeRO-3 role); headline: the mean reward of the first and last
   tenth of the run.

Each stage is launched as `make demo` launches PPO (accelerate launch with
configs/accelerate/cpu_2proc.yaml), or with torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(launcher: str, script: str, args: list[str]) -> None:
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/cpu_2proc.yaml")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "examples" / script), *args]
    env = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", **os.environ}
    print(f"\n$ {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"pipeline: {script} failed with exit status {proc.returncode}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output_dir", default="runs/pipeline")
    ap.add_argument("--launcher", choices=["accelerate", "torchrun"], default="accelerate")
    ap.add_argument("--grpo_steps", type=int, default=None, help="GRPO optimizer steps (configs/grpo.yaml's otherwise)")
    opts = ap.parse_args(argv)
    out = Path(opts.output_dir)
    # Stages 2 and 3 are given their data by name, as a run on your own model must be (a model
    # without --dataset_name is refused): the tiny default's bundled pairs and prompts, as files.
    from posttrain.data.preference import write_jsonl
    from posttrain.demo import synthetic
    from posttrain.scripts.data import PromptArguments, bundled_prompts

    pairs = write_jsonl(synthetic.preference_pairs(1024, seed=0) + synthetic.preference_pairs(256, seed=1),
                        out / "data" / "pairs.jsonl")
    # The prompts `posttrain grpo` draws on the tiny default (its --num_prompts, configs/grpo.yaml's seed).
    prompts = write_jsonl(bundled_prompts(PromptArguments.num_prompts, seed=42), out / "data" / "prompts.jsonl")
    quiet = ["--disable_tqdm", "true", "--overwrite_output_dir", "true"]
    start = time.perf_counter()
    times = {}

    t = time.perf_counter()
    launch(opts.launcher, "sft.py", ["--config", str(ROOT / "configs/sft.yaml"), "--output_dir", str(out / "sft"), *quiet])
    times["sft"] = time.perf_counter() - t
    sft = json.loads((out / "sft" / "summary.json").read_text())

    t = time.perf_counter()
    launch(opts.launcher, "reward.py", ["--config", str(ROOT / "configs/reward.yaml"), "--output_dir", str(out / "reward"),
                                        "--model_name_or_path", sft["final_model"], "--dataset_name", str(pairs),
                                        "--test_split_size", "256", *quiet])
    times["reward"] = time.perf_counter() - t
    reward = json.loads((out / "reward" / "summary.json").read_text())

    t = time.perf_counter()
    grpo_args = ["--config", str(ROOT / "configs/grpo.yaml"), "--output_dir", str(out / "grpo"),
                 "--model_name_or_path", sft["final_model"], "--reward_model_name_or_path", reward["final_model"],
                 "--dataset_name", str(prompts), *quiet]
    if opts.grpo_steps:
        grpo_args += ["--max_steps", str(opts.grpo_steps)]
    launch(opts.launcher, "grpo.py", grpo_args)
    times["grpo"] = time.perf_counter() - t
    grpo = json.loads((out / "grpo" / "summary.json").read_text())

    summary = {
        "sft": {"eval_loss_before": sft["eval_loss_before"], "eval_loss": sft["eval_loss"],
                "eval_mean_token_accuracy": sft["eval_mean_token_accuracy"], "model": sft["final_model"]},
        "reward": {"eval_accuracy_before": reward["eval_accuracy_before"], "eval_accuracy": reward["eval_accuracy"],
                   "model": reward["final_model"]},
        "grpo": {"reward_first_tenth": grpo["reward_first_tenth"], "reward_last_tenth": grpo["reward_last_tenth"],
                 "policy": str(out / "grpo")},
        "seconds": {**{k: round(v, 1) for k, v in times.items()}, "total": round(time.perf_counter() - start, 1)},
    }
    (out / "pipeline.json").write_text(json.dumps(summary, indent=1))
    print("\nPIPELINE summary (tiny default, 2 CPU processes per stage)")
    print(f"  1. SFT     held-out loss {sft['eval_loss_before']:.3f} -> {sft['eval_loss']:.3f} "
          f"(token accuracy {sft['eval_mean_token_accuracy']:.3f})  [{times['sft']:.0f} s]")
    print(f"  2. reward  held-out accuracy {reward['eval_accuracy_before']:.3f} -> {reward['eval_accuracy']:.3f}"
          f"  [{times['reward']:.0f} s]")
    print(f"  3. GRPO    reward-model score, first tenth {grpo['reward_first_tenth']:+.3f} -> last tenth "
          f"{grpo['reward_last_tenth']:+.3f}  [{times['grpo']:.0f} s]")
    print(f"  total {summary['seconds']['total']:.0f} s; summary in {out / 'pipeline.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
