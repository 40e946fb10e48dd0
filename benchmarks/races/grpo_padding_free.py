"""One GPU, GRPO's training phase on completions of mixed lengths: posttrain padded against padding-free
(issue 40, target: padding-free at least 1.5x faster).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``posttrain-padded``: ``padding_free: false``, the batch padded to its longest prompt (left) and its longest
  completion (right), the model on sdpa;
- ``posttrain-padding-free``: ``padding_free: true`` (the default), each micro-batch packed into one row, the
  model on posttrain's choice (``varlen``, torch's FlashAttention varlen kernel, on CUDA).

Both: the same random-weight model (Llama 1.1B shape, benchmarks/harness/bench_models.py), bf16, gradient
checkpointing (TRL's default), beta 0, one optimizer step per micro-batch of ``--completions`` completions. Only
the training phase is timed (the real trainer's ``compute_loss``, backward and optimizer step): generation is
left out, since a random model's completions would all run to ``--max-completion``. Instead each step trains the
same synthetic batch on both sides: prompts of ``--prompt-len`` / 2 to ``--prompt-len`` tokens, and completion
lengths from an exponential cut at ``--max-completion`` whose mean is a quarter of it, one completion per
micro-batch truncated at the maximum (as a reasoning run's longest are), so the padded width is
``--max-completion``. The row records the mean completion length it trained and the tokens per step (attended
tokens: the same on both sides).

    python benchmarks/races/grpo_padding_free.py --out DIR                     # one H200
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_padding_free.py --shape tiny --steps 1 --warmup 1 --rounds 1
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import Stamps  # noqa: E402

SIDES = ("posttrain-padded", "posttrain-padding-free")
BASELINES = {"posttrain-padding-free": "posttrain-padded"}
# The truncated exponential on [0, 1] with rate 3.6 has mean 1/3.6 - 1/(e^3.6 - 1) = 0.2497: a quarter.
RATE = 3.6
TARGET = 1.5


def completion_lengths(n: int, longest: int, generator: Any) -> list[int]:
    """``n`` lengths in [1, ``longest``], mean about ``longest / 4``; the first one is ``longest``."""
    import torch

    u = torch.rand(n - 1, generator=generator, dtype=torch.float64)
    frac = -torch.log1p(-u * (1 - math.exp(-RATE))) / RATE
    return [longest] + [max(1, min(longest, math.ceil(f * longest))) for f in frac.tolist()]


def synthetic_batch(spec: dict[str, Any], step: int, pad: int, device: Any) -> dict[str, Any]:
    """One micro-batch as GRPO's ``compute_loss`` takes it (prompts left-padded, completions right-padded)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    n, longest, plen = spec["completions"], spec["max_completion"], spec["prompt_len"]
    prompt_lens = torch.randint(max(1, plen // 2), plen + 1, (n,), generator=g).tolist()
    comp_lens = completion_lengths(n, longest, g)
    width = max(prompt_lens)
    prompt_ids = torch.full((n, width), pad, dtype=torch.long)
    prompt_mask = torch.zeros(n, width, dtype=torch.long)
    completion_ids = torch.full((n, longest), pad, dtype=torch.long)
    completion_mask = torch.zeros(n, longest, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_lens, comp_lens)):
        prompt_ids[i, width - p:] = torch.randint(3, 500, (p,), generator=g)  # ids every preset's vocabulary has
        prompt_mask[i, width - p:] = 1
        completion_ids[i, :c] = torch.randint(3, 500, (c,), generator=g)
        completion_mask[i, :c] = 1
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.randn(n, generator=g),
             "num_items_in_batch": completion_mask.sum().float()}
    return {k: v.to(device) for k, v in batch.items()}


def constant_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [0.0] * len(completion_ids)


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import model_dir, prompt_rows
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    path = model_dir(spec["shape"], torch.bfloat16)
    steps = spec["warmup"] + spec["steps"]
    cfg = GRPOConfig(output_dir=str(out / side), overwrite_output_dir=True, save_strategy="no", report_to=[],
                     per_device_train_batch_size=spec["completions"], num_generations=spec["completions"],
                     max_completion_length=spec["max_completion"], beta=0.0, learning_rate=1e-6, bf16=True,
                     gradient_checkpointing=True, max_steps=steps, seed=0, disable_tqdm=True,
                     padding_free=side.endswith("padding-free"),
                     compile_layers=spec["compile_layers"] == "true")
    trainer = GRPOTrainer(str(path), reward_funcs=constant_reward, args=cfg,
                          train_dataset=prompt_rows(2, spec["prompt_len"]))
    s = trainer.session
    stamps.wrap_session(s)
    pad = trainer.tokenizer.pad_token_id
    batches = [synthetic_batch(spec, k, pad, s.device) for k in range(steps)]
    losses, tokens = [], []
    stamps.mark()
    for batch in batches:
        loss, _ = trainer.compute_loss(batch)
        s.backward("policy", loss * trainer.backward_scale())
        s.step("policy")
        losses.append(loss.item())
        tokens.append(float(batch["prompt_mask"].sum() + batch["completion_mask"].sum()))
    ran = {"attn_implementation": s.unwrap("policy").config._attn_implementation, "engine": s.engine_kind("policy")}
    trainer.end()
    mean_len = sum(float(b["completion_mask"].sum()) for b in batches) / (steps * spec["completions"])
    return {**ran, "padding_free": cfg.padding_free,
            "compiled_layers": trainer.compiled_layers, "losses": losses[spec["warmup"]:],
            "tokens_per_step": tokens, "mean_completion_len": mean_len,
            "padded_tokens_per_step": spec["completions"] * (max(b["prompt_mask"].shape[1] for b in batches)
                                                             + spec["max_completion"])}


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 40's target, as measured, and what each side ran."""
    lines = []
    padded, packed = summary.get("posttrain-padded", {}), summary.get("posttrain-padding-free", {})
    if padded.get("step_s") and packed.get("step_s"):
        speed = padded["step_s"] / packed["step_s"]
        lines.append(f"training step: padded {padded['step_s']:.3f} s, padding-free {packed['step_s']:.3f} s: "
                     f"{speed:.2f}x (target >= {TARGET}: {'met' if speed >= TARGET else 'missed'})")
    seen = set()
    for r in rows:
        if r.get("mean_completion_len") is not None and r["side"] not in seen:
            seen.add(r["side"])
            lines.append(f"{r['side']}: attention {r.get('attn_implementation')}, mean completion "
                         f"{r['mean_completion_len']:.0f} tokens, {r.get('padded_tokens_per_step')} tokens per padded step, "
                         f"compiled layers {r.get('compiled_layers')}")
    return lines


RACE = race.Race(name="grpo_padding_free", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side,
                 baselines=BASELINES, targets=targets, steps=8, warmup=3, rounds=2,
                 knobs={"completions": (16, 4, "completions per micro-batch (one optimizer step each)"),
                        "max_completion": (1024, 32, "max_completion_length: the longest completion"),
                        "prompt_len": (128, 8, "the longest prompt (prompts are half to all of it)"),
                        "compile_layers": ("false", "false", "true: compile the policy's decoder layers on both sides")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
