"""One GPU, GRPO with LoRA at 8B: TRL's GRPOTrainer against posttrain's, the same peft_config (issue 21).

Rows (each a fresh process, in order, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl-lora``: ``trl.GRPOTrainer`` given ``peft_config``, no DeepSpeed, bf16, its default
  ``generate``, gradient checkpointing (TRL's GRPO default): what TRL runs on one GPU;
- ``posttrain-lora``: posttrain's GRPOTrainer, default mix and engine, the same ``peft_config``
  (passed as ``peft_config=``, as to TRL's), its rollout engine; with adapters the reference is the base with them switched off on both sides;
- ``posttrain-lora-grouped``: the same with ``generation_lora_mode="grouped"`` (the engine decodes from the
  frozen base in place, the adapters' A rows appended to its GEMMs, no merged copy; issue 40's memory target:
  a peak of at most 24 GiB at a step within 1.05x of ``posttrain-lora``'s);
- ``posttrain-full``: the same case without LoRA (a full fine-tune: policy, fp32 master weights
  and Adam states, and a reference): expected to run out of memory on one H200, an ``oom`` row.

The case: the random-weight Llama 3 8B shape (benchmarks/harness/grpo_e2e.py's ``model_dir``), prompts
of ``--prompt-len`` tokens, ``--completions`` completions per step (``--num-generations`` per
prompt, so a new generation batch every step) of up to ``--response-len`` tokens at temperature
1, beta 0.04, learning rate 1e-6, LoRA r ``--lora-r``, alpha ``--lora-alpha``, dropout 0.05 on
every linear layer but the head (peft's "all-linear"). Reward: the fraction of even token ids in
a completion (costs nothing, and varies between completions, so advantages are not zero and the
adapters move: each row records the norm of the LoRA B matrices, zero at initialisation).
posttrain's rows also record their phases and the rollout engine's KV cache bytes (the issue's
memory target: at most TRL's peak plus that cache).

    python benchmarks/races/grpo_lora_race.py --out DIR                     # one GPU (8B)
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_lora_race.py --shape tiny --steps 1 --warmup 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import GiB, Stamps  # noqa: E402

SIDES = ("posttrain-lora", "posttrain-lora-grouped", "trl-lora", "posttrain-full")
BASELINES = {"posttrain-lora": "trl-lora", "posttrain-lora-grouped": "posttrain-lora", "posttrain-full": "trl-lora"}
BETA, LR, LORA_DROPOUT = 0.04, 1e-6, 0.05


def parity_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The fraction of even token ids: free next to the models, and different between completions."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def lora_config(spec: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=spec["lora_r"], lora_alpha=spec["lora_alpha"], lora_dropout=LORA_DROPOUT,
                      target_modules="all-linear", task_type="CAUSAL_LM")


def lora_b_norm(model: Any) -> float | None:
    """The norm of every LoRA B matrix (zero when the adapters are new): > 0 means they trained."""
    import torch

    module = getattr(model, "module", model)
    norms = [p.detach().float().norm() for n, p in module.named_parameters() if "lora_B" in n]
    return float(torch.stack(norms).norm()) if norms else None


def _settings(spec: dict[str, Any]) -> dict[str, Any]:
    return dict(per_device_train_batch_size=spec["completions"], num_generations=spec["num_generations"],
                max_completion_length=spec["response_len"], beta=BETA, temperature=1.0, learning_rate=LR,
                max_steps=spec["warmup"] + spec["steps"], gradient_accumulation_steps=1, bf16=True, seed=0,
                logging_steps=1, disable_tqdm=True, gradient_checkpointing=True)


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.demo import tiny

    args = GRPOConfig(output_dir=str(out / "trl-lora"), report_to=[], save_strategy="no",
                      use_cpu=not torch.cuda.is_available(), **_settings(spec))
    trainer = GRPOTrainer(model=str(path), reward_funcs=[parity_reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tiny.load_tokenizer(path), peft_config=lora_config(spec),
                          callbacks=[stamps.callback()])
    stamps.mark()
    trainer.train()
    return {"lora": True, "losses": [r["loss"] for r in stamps.logs][spec["warmup"]:],
            "lora_b_norm": lora_b_norm(trainer.model)}


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
                  lora: bool, lora_mode: str = "merged") -> dict[str, Any]:
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    row: dict[str, Any] = {}
    name = f"posttrain-lora-{lora_mode}" if lora else "posttrain-full"
    cfg = GRPOConfig(output_dir=str(out / name), overwrite_output_dir=True, save_strategy="no",
                     max_prompt_length=spec["prompt_len"], generation_lora_mode=lora_mode, **_settings(spec))
    trainer = GRPOTrainer(str(path), reward_funcs=[parity_reward], args=cfg, train_dataset=rows,
                          peft_config=lora_config(spec) if lora else None)
    s = trainer.session
    history = stamps.train(trainer)
    st = trainer.rollout.stats
    row.update(lora=lora, placements={n: s.zero_stage(n) for n in s.roles}, engine=s.engine_kind("policy"),
               master_weights=s.master_weights("policy"), losses=[h["loss"] for h in history][spec["warmup"]:],
               phase_s=race.phase_medians(history[spec["warmup"]:]), lora_b_norm=lora_b_norm(s.engines["policy"]),
               kv_cache_gib=st.get("kv_cache_bytes", 0) / GiB, degraded=trainer.rollout.degraded,
               rollout={k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None})
    return row


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import model_dir, prompt_rows

    path = model_dir(spec["shape"], torch.bfloat16)
    prompts = (spec["warmup"] + spec["steps"]) * spec["completions"] // spec["num_generations"]
    rows = prompt_rows(max(prompts, 1), spec["prompt_len"])
    if side == "trl-lora":
        return run_trl(spec, path, rows, out, stamps)
    return run_posttrain(spec, path, rows, out, stamps, lora=side.startswith("posttrain-lora"),
                         lora_mode="grouped" if side == "posttrain-lora-grouped" else "merged")


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 21's targets, as measured."""
    lines = []
    ours, trl = summary.get("posttrain-lora", {}), summary.get("trl-lora", {})
    if ours.get("step_s") and trl.get("step_s"):
        x = trl["step_s"] / ours["step_s"]
        lines.append(f"LoRA: posttrain {ours['step_s']:.2f} s/step against TRL's {trl['step_s']:.2f}: {x:.2f}x "
                     f"(target >= 5x: {'met' if x >= 5 else 'missed'})")
    kv = max((r.get("kv_cache_gib") or 0.0 for r in rows if r["side"] == "posttrain-lora"), default=0.0)
    if ours.get("peak_allocated_gib") and trl.get("peak_allocated_gib"):
        bound = trl["peak_allocated_gib"] + kv
        lines.append(f"LoRA: posttrain peak {ours['peak_allocated_gib']:.2f} GiB against TRL's "
                     f"{trl['peak_allocated_gib']:.2f} + KV cache {kv:.2f} = {bound:.2f} (target: at most that: "
                     f"{'met' if ours['peak_allocated_gib'] <= bound else 'missed'})")
    trained = [r for r in rows if r["side"] == "posttrain-lora" and r["status"] == "ok"]
    for r in trained:
        finite = all(loss == loss and abs(loss) != float("inf") for loss in r.get("losses", []))
        rollout = r.get("rollout", {})
        how = "its rollout engine" if rollout.get("backend") == "posttrain" else \
            f"transformers' generate (the engine fell back: {rollout.get('fallback')})"
        lines.append(f"posttrain-lora round {r['round']}: losses finite {finite}, LoRA B norm {r.get('lora_b_norm')} "
                     f"(0 at initialisation); generated with {how}, compiled {rollout.get('compiled')}, "
                     f"{rollout.get('graphs')} graphs, degraded {r.get('degraded')}")
    grouped = summary.get("posttrain-lora-grouped", {})
    if grouped.get("step_s") and ours.get("step_s") and grouped.get("peak_allocated_gib"):
        x = grouped["step_s"] / ours["step_s"]
        ok = grouped["peak_allocated_gib"] <= 24 and x <= 1.05
        lines.append(f"LoRA grouped (no merged copy): peak {grouped['peak_allocated_gib']:.2f} GiB against merged's "
                     f"{ours.get('peak_allocated_gib', 0):.2f}, step {grouped['step_s']:.2f} s = {x:.3f}x merged's "
                     f"(target: at most 24 GiB at <= 1.05x: {'met' if ok else 'missed'})")
    full = summary.get("posttrain-full")
    if full:
        lines.append(f"full fine-tune: {full['status']} (target: out of memory shown)")
    return lines


RACE = race.Race(name="grpo_lora_race", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side,
                 baselines=BASELINES, targets=targets, shape="8b", steps=3, warmup=2, rounds=1,
                 knobs={"completions": (16, 4, "completions per step"),
                        "num_generations": (8, 2, "completions per prompt"),
                        "prompt_len": (128, 16, "prompt tokens"),
                        "response_len": (256, 8, "completion tokens at most"),
                        "lora_r": (16, 16, "LoRA rank"), "lora_alpha": (32, 32, "LoRA alpha")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
