"""One GPU, multi-turn GRPO with a tool: TRL 1.16's GRPOTrainer(tools=) against posttrain's (issue 38's target).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl``: ``trl.GRPOTrainer`` with ``tools=[probe]``, no vLLM, no DeepSpeed, bf16, gradient checkpointing,
  its default ``generate``: its ``_tool_call_loop`` re-generates over the whole conversation every turn;
- ``posttrain``: posttrain's GRPOTrainer with the same ``tools=``: its engine keeps each sequence's slot and
  prefills only the tool result.

The workload: the random-weight 1.1B Llama shape, ``--prompts`` conversational prompts of ``--prompt-len``
tokens x ``--num-generations`` completions per step, temperature 1, beta 0.04, learning rate 1e-6,
``max_tool_calling_iterations = --calls``. Every completion is ``--calls`` + 1 model turns of ``--turn-tokens``
sampled tokens (the last one EOS) with ``--calls`` tool results of ``--result-tokens`` tokens between them;
``max_completion_length`` holds exactly that. How the turns are made the same on both sides, with random
weights and without touching either trainer's loop: benchmarks/harness/scripted_turns.py (the turn length
is in the weights, the tool call is added by a wrapper of ``parse_response``, the function both sides parse
each ended turn with). Reward: the fraction of even ids in a completion (the turns' tokens are drawn from
``--width`` choices per position, so rewards differ).

Each row records ``tools/call_frequency`` (calls per completion, TRL's metric, logged by both) per step; a
row whose steps did not all make exactly ``--calls`` calls per completion fails.

    python benchmarks/races/grpo_tools_race.py --out DIR                      # one GPU (1.1B)
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_tools_race.py --shape tiny --steps 1 --warmup 1 --rounds 1
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

SIDES = ("posttrain", "trl")
BETA, LR = 0.04, 1e-6


def even_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The fraction of even token ids: free next to the models, and different between completions."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def completion_len(spec: dict[str, Any]) -> int:
    return (spec["calls"] + 1) * spec["turn_tokens"] + spec["calls"] * spec["result_tokens"]


def _settings(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["prompts"] * spec["num_generations"]
    return dict(per_device_train_batch_size=n, num_generations=spec["num_generations"],
                max_completion_length=completion_len(spec), beta=BETA, temperature=1.0, learning_rate=LR,
                max_steps=spec["warmup"] + spec["steps"], gradient_accumulation_steps=1, bf16=True, seed=0,
                logging_steps=1, disable_tqdm=True, gradient_checkpointing=True,
                max_tool_calling_iterations=spec["calls"])


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.harness import scripted_turns

    args = GRPOConfig(output_dir=str(out / "trl"), report_to=[], save_strategy="no",
                      use_cpu=not torch.cuda.is_available(), **_settings(spec))
    trainer = GRPOTrainer(model=str(path), reward_funcs=[even_reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=scripted_turns.tokenizer(), tools=[scripted_turns.probe],
                          callbacks=[stamps.callback()])
    stamps.mark()
    trainer.train()
    return {"call_frequency": [r.get("tools/call_frequency") for r in stamps.logs],
            "failure_frequency": [r.get("tools/failure_frequency") for r in stamps.logs],
            "mean_length": [r.get("completions/mean_length") for r in stamps.logs],
            "losses": [r["loss"] for r in stamps.logs][spec["warmup"]:]}


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> dict[str, Any]:
    from benchmarks.harness import scripted_turns
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(output_dir=str(out / "posttrain"), overwrite_output_dir=True, save_strategy="no",
                     **_settings(spec))
    trainer = GRPOTrainer(str(path), reward_funcs=[even_reward], args=cfg, train_dataset=rows,
                          processing_class=scripted_turns.tokenizer(), tools=[scripted_turns.probe])
    s = trainer.session
    history = stamps.train(trainer)
    st = trainer.rollout.stats
    return {"call_frequency": [h.get("tools/call_frequency") for h in history],
            "failure_frequency": [h.get("tools/failure_frequency") for h in history],
            "mean_length": [h.get("completions/mean_length") for h in history],
            "losses": [h["loss"] for h in history][spec["warmup"]:],
            "phase_s": race.phase_medians(history[spec["warmup"]:]), "engine": s.engine_kind("policy"),
            "degraded": trainer.rollout.degraded,
            "rollout": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None}}


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness import scripted_turns
    from benchmarks.harness.bench_models import prompt_rows

    path = scripted_turns.model_dir(spec["shape"], torch.bfloat16, spec["turn_tokens"], spec["width"])
    text = scripted_turns.install(spec["result_tokens"])
    n = (spec["warmup"] + spec["steps"]) * spec["prompts"]
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in prompt_rows(n, spec["prompt_len"])]
    row = (run_trl if side == "trl" else run_posttrain)(spec, path, rows, out, stamps)
    tok = scripted_turns.tokenizer()
    row["result_tokens"] = scripted_turns.suffix_len(tok, text)
    steps = spec["warmup"] + spec["steps"]
    freq = row["call_frequency"]
    if len(freq) != steps or any(f is None or abs(f - spec["calls"]) > 1e-9 for f in freq):
        raise RuntimeError(f"{side}: tools/call_frequency per step {freq}, expected {spec['calls']} in each of "
                           f"{steps} steps: the turns did not run as scripted")
    if any(f for f in row["failure_frequency"]):
        raise RuntimeError(f"{side}: tool failures {row['failure_frequency']}")
    # The model's tokens per completion: every turn is turn_tokens long (tool tokens are not counted).
    expected = (spec["calls"] + 1) * spec["turn_tokens"]
    if any(m is not None and abs(m - expected) > 1e-6 for m in row["mean_length"]):
        raise RuntimeError(f"{side}: completions/mean_length {row['mean_length']}, expected {expected} model "
                           "tokens per completion")
    row["tokens_per_step"] = [float(spec["prompts"] * spec["num_generations"] * completion_len(spec))] * steps
    return row


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 38's GRPO target, as measured."""
    lines = []
    ours, trl = summary.get("posttrain", {}), summary.get("trl", {})
    if ours.get("step_s") and trl.get("step_s"):
        x = trl["step_s"] / ours["step_s"]
        lines.append(f"posttrain {ours['step_s']:.2f} s/step against TRL's {trl['step_s']:.2f}: {x:.2f}x "
                     f"(target >= 10x: {'met' if x >= 10 else 'missed'})")
    if ours.get("peak_allocated_gib") and trl.get("peak_allocated_gib"):
        met = ours["peak_allocated_gib"] <= trl["peak_allocated_gib"]
        lines.append(f"peak allocated: posttrain {ours['peak_allocated_gib']:.2f} GiB, TRL {trl['peak_allocated_gib']:.2f} "
                     f"(target: no more: {'met' if met else 'missed'})")
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"{r['side']} round {r['round']}: tools/call_frequency {r.get('call_frequency')}, "
                         f"tool result {r.get('result_tokens')} tokens, model tokens per completion "
                         f"{r.get('mean_length')}" + (f", engine {r.get('engine')}, degraded {r.get('degraded')}"
                                                      if r["side"] == "posttrain" else ""))
    return lines


RACE = race.Race(name="grpo_tools_race", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side,
                 targets=targets, shape="1b", steps=3, warmup=2, rounds=2,
                 knobs={"prompts": (16, 2, "prompts per step"),
                        "num_generations": (8, 2, "completions per prompt"),
                        "prompt_len": (128, 8, "prompt tokens (before the chat template)"),
                        "calls": (3, 3, "tool calls per completion"),
                        "turn_tokens": (64, 4, "sampled tokens per model turn (the last one EOS)"),
                        "result_tokens": (64, 12, "tokens of each rendered tool result"),
                        "width": (4, 2, "choices of token at each position of a turn")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
