"""One GPU, GRPO on long-tailed completions: posttrain's synchronous step against streaming generation
(``async_generation``, ``max_staleness`` 1), and TRL 1.16's GRPOTrainer on its default generation (issue 39's
targets: useful tokens trained per second at least 2x posttrain's synchronous step, and at least 10x TRL's).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl``: ``trl.GRPOTrainer``, no vLLM, no DeepSpeed, bf16, gradient checkpointing, ``generate``;
- ``posttrain-sync``: posttrain's GRPOTrainer as it ships (one generation batch per step, every row to its end);
- ``posttrain-streaming``: the same with ``async_generation: true``, ``max_staleness: 1`` (``stale_groups`` wait,
  the default);
- ``posttrain-streaming-drop``: the same with ``stale_groups: drop`` (TRL AsyncGRPO's way: late groups dropped).

The workload: the random-weight 1.1B Llama shape, ``--prompts`` prompts of ``--prompt-len`` tokens x
``--num-generations`` completions per optimizer step (``--micro`` completions per micro-batch, gradient
accumulation over the rest), up to ``--max-completion`` new tokens, temperature 1, beta 0. A completion ends on
any of a stop set of ``--stop-frac`` of the vocabulary (ids spread evenly over it): on a random model a
geometric length of mean about 1 / stop-frac, cut at the maximum (mean 99 of 512 at 1%), the long tail of a
reasoning run's lengths. Both sides take the stop set as TRL's ``generation_kwargs={"eos_token_id": [...]}``.

Each row records, per timed step, the useful tokens trained (``completions/mean_length`` x completions: the
tokens each side's loss reads) and reports them per second of step time; streaming also reports its staleness,
dropped groups and held rounds. A posttrain row whose rollout fell back to a slower path fails.

    python benchmarks/races/grpo_streaming_race.py --out DIR                     # one H200 (1.1B)
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_streaming_race.py --shape tiny --steps 2 --warmup 1 --rounds 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import Stamps  # noqa: E402

SIDES = ("posttrain-streaming", "posttrain-streaming-drop", "posttrain-sync", "trl")
BASELINES = {"posttrain-streaming": "posttrain-sync", "posttrain-streaming-drop": "posttrain-sync",
             "posttrain-sync": "trl"}
LR = 1e-6


def stop_ids(vocab: int, frac: float) -> list[int]:
    """``frac`` of the vocabulary, spread evenly over it (the tokenizer's special ids 0-2 left out)."""
    n = max(1, round(vocab * frac))
    step = (vocab - 3) / n
    return sorted({3 + int(i * step) for i in range(n)})


def length_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Shorter is better: distinct within a group, so every group trains."""
    return [-len(ids) / 512 for ids in completion_ids]


def _settings(spec: dict[str, Any]) -> dict[str, Any]:
    rows = spec["prompts"] * spec["num_generations"]
    return dict(per_device_train_batch_size=spec["micro"], gradient_accumulation_steps=rows // spec["micro"],
                num_generations=spec["num_generations"], max_completion_length=spec["max_completion"], beta=0.0,
                temperature=1.0, learning_rate=LR, max_steps=spec["warmup"] + spec["steps"], bf16=True, seed=0,
                logging_steps=1, disable_tqdm=True, gradient_checkpointing=True)


def _tokens(history: list[dict[str, Any]], spec: dict[str, Any]) -> list[float]:
    rows = spec["prompts"] * spec["num_generations"]
    return [float(h["completions/mean_length"]) * rows for h in history]


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], stops: list[int], out: Path, stamps: Stamps
            ) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.demo import tiny

    args = GRPOConfig(output_dir=str(out / "trl"), report_to=[], save_strategy="no",
                      use_cpu=not torch.cuda.is_available(), generation_kwargs={"eos_token_id": stops},
                      **_settings(spec))
    trainer = GRPOTrainer(model=str(path), reward_funcs=[length_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tiny.load_tokenizer(path),
                          callbacks=[stamps.callback()])
    stamps.mark()
    trainer.train()
    logs = [r for r in stamps.logs if "loss" in r]
    return {"losses": [r["loss"] for r in logs][spec["warmup"]:], "tokens_per_step": _tokens(logs, spec),
            "mean_length": [r["completions/mean_length"] for r in logs]}


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], stops: list[int], out: Path, stamps: Stamps,
                  stale_groups: str | None) -> dict[str, Any]:
    """posttrain synchronous (``stale_groups`` None) or streaming at ``max_staleness`` 1 with that policy."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    streaming = stale_groups is not None
    extra = dict(async_generation=True, max_staleness=1, stale_groups=stale_groups) if streaming else {}
    cfg = GRPOConfig(output_dir=str(out / (f"streaming-{stale_groups}" if streaming else "sync")),
                     overwrite_output_dir=True,
                     save_strategy="no", generation_kwargs={"eos_token_id": stops}, **_settings(spec), **extra)
    trainer = GRPOTrainer(str(path), reward_funcs=[length_reward], args=cfg, train_dataset=rows)
    s = trainer.session
    history = stamps.train(trainer)
    st = trainer.rollout.stats
    if trainer.rollout.degraded:
        raise RuntimeError(f"the rollout fell back to a slower path: {st.get('fallback_reasons')}")
    row = {"losses": [h["loss"] for h in history][spec["warmup"]:], "tokens_per_step": _tokens(history, spec),
           "mean_length": [h["completions/mean_length"] for h in history],
           "phase_s": race.phase_medians(history[spec["warmup"]:]), "engine": s.engine_kind("policy"),
           "rollout": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None}}
    if streaming:
        row.update({k: [h.get(k) for h in history] for k in ("sample/staleness_mean", "sample/staleness_max",
                                                              "streaming/dropped_groups", "streaming/held_rounds",
                                                              "streaming/in_flight")})
    return row


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from benchmarks.harness.bench_models import model_dir, prompt_rows

    path = model_dir(spec["shape"], torch.bfloat16)
    stops = stop_ids(AutoConfig.from_pretrained(path).vocab_size, spec["stop_frac"])
    # Streaming may start the next steps' prompts early: enough prompts for every step and two more.
    rows = prompt_rows((spec["warmup"] + spec["steps"] + 2) * spec["prompts"], spec["prompt_len"])
    if side == "trl":
        return run_trl(spec, path, rows, stops, out, stamps)
    policy = {"posttrain-streaming": "wait", "posttrain-streaming-drop": "drop"}.get(side)
    return run_posttrain(spec, path, rows, stops, out, stamps, stale_groups=policy)


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 39's targets, as measured: useful tokens trained per second."""
    lines = []
    rate = {side: summary.get(side, {}).get("tokens_per_s") for side in SIDES}
    for side, base, goal in (("posttrain-streaming", "posttrain-sync", 2.0), ("posttrain-streaming", "trl", 10.0),
                             ("posttrain-streaming-drop", "posttrain-sync", None),
                             ("posttrain-streaming", "posttrain-streaming-drop", None),
                             ("posttrain-sync", "trl", None)):
        if rate[side] and rate[base]:
            x = rate[side] / rate[base]
            aim = f" (target >= {goal:g}x: {'met' if x >= goal else 'missed'})" if goal else ""
            lines.append(f"{side} {rate[side]:.0f} useful tokens/s against {base}'s {rate[base]:.0f}: {x:.2f}x{aim}")
    for r in rows:
        if r["status"] == "ok" and r["side"].startswith("posttrain-streaming"):
            lines.append(f"{r['side']} round {r['round']}: staleness max {r.get('sample/staleness_max')}, dropped "
                         f"groups {r.get('streaming/dropped_groups')}, held rounds {r.get('streaming/held_rounds')}, "
                         f"mean length {r.get('mean_length')}")
    return lines


RACE = race.Race(name="grpo_streaming_race", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side,
                 targets=targets, shape="1b", steps=4, warmup=2, rounds=1, baselines=BASELINES,
                 knobs={"prompts": (64, 2, "prompts per optimizer step"),
                        "num_generations": (8, 2, "completions per prompt"),
                        "micro": (64, 4, "completions per micro-batch"),
                        "prompt_len": (128, 8, "prompt tokens"),
                        "max_completion": (512, 16, "new tokens at most"),
                        "stop_frac": (0.01, 0.05, "share of the vocabulary that ends a completion")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
