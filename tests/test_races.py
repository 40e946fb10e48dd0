"""The one-GPU races against TRL's trainers (benchmarks/races/race.py and the races on it): the runner's
rows, OOM rows, summaries and results.md in-process, then each race's tiny shape on CPU, every side
a fresh process as on the GPU (one warm-up and one timed step; the times say nothing)."""

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from benchmarks.races import race


def _race(**kw) -> race.Race:
    return race.Race(name="fake_race", doc="A fake race.", script=__file__, sides=("trl", "ours"),
                     run_side=kw.pop("run_side", lambda *a: {}), **kw)


def test_child_times_steps_and_makes_oom_a_row(tmp_path):
    spec = {"shape": "tiny", "steps": 2, "warmup": 1}

    def three_steps(side, spec, work, stamps):
        stamps.mark()
        for _ in range(3):
            stamps.mark()
        return {"tokens_per_step": [10.0, 20.0, 30.0]}

    row = race.child(_race(run_side=three_steps), "ours", spec, tmp_path)
    assert row["status"] == "ok" and row["steps_done"] == 3 and len(row["step_times"]) == 3
    assert row["step_s"] == pytest.approx(sorted(row["step_times"][1:])[0] / 2 + sorted(row["step_times"][1:])[1] / 2)
    assert row["tokens_per_s"] == pytest.approx(50.0 / sum(row["step_times"][1:]))

    def oom_after_one(side, spec, work, stamps):
        stamps.mark()
        stamps.mark()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.48 GiB")

    row = race.child(_race(run_side=oom_after_one), "ours", spec, tmp_path)
    assert row["status"] == "oom" and "7.48 GiB" in row["error"] and row["steps_done"] == 1 and "step_s" not in row

    def too_few(side, spec, work, stamps):
        stamps.mark()
        stamps.mark()
        return {}

    with pytest.raises(RuntimeError, match="timed 1 optimizer steps, expected 3"):
        race.child(_race(run_side=too_few), "ours", spec, tmp_path)
    with pytest.raises(ValueError, match="not memory"):
        race.child(_race(run_side=lambda *a: (_ for _ in ()).throw(ValueError("not memory"))), "ours", spec, tmp_path)


def test_summary_ratios_and_results_md(tmp_path):
    r = _race(targets=lambda summary, rows: [f"ours {summary['ours']['speedup']:.1f}x"])
    rows = [{"side": "trl", "round": 0, "status": "ok", "step_s": 2.0, "step_q1_s": 1.9, "peak_allocated_gib": 20.0},
            {"side": "ours", "round": 0, "status": "ok", "step_s": 0.5, "step_q1_s": 0.4, "peak_allocated_gib": 10.0},
            {"side": "trl", "round": 1, "status": "ok", "step_s": 4.0, "step_q1_s": 3.0, "peak_allocated_gib": 21.0},
            {"side": "ours", "round": 1, "status": "oom", "error": "OutOfMemoryError: CUDA out of memory",
             "peak_allocated_gib": 30.0}]
    s = race.summarize(r, rows, ["trl", "ours"])
    assert s["trl"]["step_s"] == 3.0 and s["trl"]["peak_allocated_gib"] == 21.0 and "speedup" not in s["trl"]
    assert s["ours"]["status"] == "ok/oom" and s["ours"]["step_s"] == 0.5 and s["ours"]["speedup"] == 6.0
    assert s["ours"]["memory_ratio"] == pytest.approx(30.0 / 21.0)
    tps = race.summarize(r, [{**rows[0], "tokens_per_s": 100.0}, {**rows[1], "tokens_per_s": 150.0}], ["trl", "ours"])
    assert tps["ours"]["speedup"] == 1.5  # tokens/s when both sides have it
    with (tmp_path / "fake_race.jsonl").open("w") as f:
        for obj in [{"race": "fake_race", "spec": {"shape": "tiny"}, "command": "python x.py"}, *rows,
                    {"summary": s, "targets": r.targets(s, rows)}]:
            f.write(json.dumps(obj) + "\n")
    race.render(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "## fake_race" in md and "| ours | 1 | oom (OutOfMemoryError: CUDA out of memory)" in md
    assert "| ours | 0 | ok | 0.500 | 0.400 |  | trl | 6.00x | 10.00 |" in md and "- ours 6.0x" in md


DPO_SIDES = "trl,posttrain-auto-fp32,posttrain-ds-bf16"
# Each race test's race: (script, sides, extra arguments), longest first.
RACES = {"test_sft_race_tiny": ("sft_race.py", "trl-packed,posttrain-packed,posttrain-padded,posttrain-padding-free",
                                ("--attn-posttrain", "varlen")),
         "test_dpo_race_tiny": ("dpo_race.py", DPO_SIDES, ()),
         "test_distill_race_tiny": ("distill_race.py", DPO_SIDES, ()),
         "test_grpo_lora_race_tiny": ("grpo_lora_race.py", "posttrain-lora,trl-lora", ()),
         "test_reward_race_tiny": ("reward_race.py", "trl,posttrain", ()),
         "test_kto_race_tiny": ("kto_race.py", "trl,posttrain-auto-fp32", ()),
         "test_grpo_tools_race_tiny": ("grpo_tools_race.py", "posttrain,trl", ()),
         "test_grpo_streaming_race_tiny": ("grpo_streaming_race.py", "posttrain-streaming,trl", ())}


@pytest.fixture(scope="module")
def races(request, tmp_path_factory):
    """The selected race tests' races, ``--shape tiny`` on CPU, started two at a time: a race runs one
    side at a time, each a one-thread process, so two races keep CI's two cores busy."""
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    jobs, outs = {}, {}
    for test, (script, sides, args) in RACES.items():
        if test not in selected:
            continue
        tmp = tmp_path_factory.mktemp(script.removesuffix(".py"))
        outs[test] = tmp / "out"
        jobs[test] = [sys.executable, f"benchmarks/races/{script}", "--shape", "tiny", "--steps", "1", "--warmup", "1",
                      "--rounds", "1", "--sides", sides, "--out", str(outs[test]), "--workdir", str(tmp / "work"), *args]
    with ThreadPoolExecutor(2) as pool:
        yield {test: (outs[test], pool.submit(subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                              timeout=900)) for test, cmd in jobs.items()}


def run_race(races: dict, request: pytest.FixtureRequest) -> tuple[dict, dict[str, dict], dict, str]:
    """The calling test's race (``RACES``): (its header, its rows by side, its summary line, results.md)."""
    script, sides, _ = RACES[request.node.name]
    out, future = races[request.node.name]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.removesuffix(".py")
    lines = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    rows = {r["side"]: r for r in lines[1:-1]}
    assert ",".join(rows) == sides and set(lines[-1]["summary"]) == set(rows)
    for side, row in rows.items():
        assert row["status"] == "ok" and len(row["step_times"]) == 2 and row["step_s"] > 0, side
        assert Path(row["log"]).is_file(), side
    assert f"benchmarks/races/{script} --shape tiny" in (out / "commands.txt").read_text()
    md = (out / "results.md").read_text()
    assert f"## {name}" in md and all(f"| {side} | 0 | ok |" in md for side in rows)
    return lines[0], rows, lines[-1], md


RAN = {"auto": "torch", "ds": "deepspeed", "torch": "torch"}  # what auto runs for DPO and distillation (lmbda 0)


def test_dpo_race_tiny(races, request):
    """TRL, posttrain's default (auto: the torch path, here with fp32 states) and DeepSpeed's engine
    (bf16 states): both engines and both precisions (the other combinations run the same code)."""
    head, rows, summary, _ = run_race(races, request)
    assert head["spec"] == {"shape": "tiny", "pairs": 2, "seq_len": 64, "steps": 1, "warmup": 1}
    for side, row in rows.items():
        if side != "trl":
            _, engine, master = side.split("-")
            assert row["master_weights"] == master and row["engine"] == RAN[engine], side
            assert {"reference", "policy_forward", "backward"} <= set(row["phase_s"]), side
    assert rows["posttrain-ds-bf16"]["placements"] == {"policy": 2, "reference": 0}
    assert rows["posttrain-auto-fp32"]["placements"] == {"policy": 0, "reference": 0}
    assert summary["planned_ds_fp32_extra_gib"] > 0 and summary["planned_auto_fp32_extra_gib"] > 0
    assert summary["summary"]["posttrain-auto-fp32"]["baseline"] == "trl"


def test_distill_race_tiny(races, request):
    """TRL's GKDTrainer, posttrain's default (auto) and DeepSpeed's engine."""
    _, rows, _, _ = run_race(races, request)
    assert rows["posttrain-auto-fp32"]["engine"] == "torch" and rows["posttrain-ds-bf16"]["engine"] == "deepspeed"
    assert rows["posttrain-auto-fp32"]["placements"] == {"student": 0, "teacher": 0}
    assert {"forward", "backward"} <= set(rows["posttrain-ds-bf16"]["phase_s"])


def test_sft_race_tiny(races, request):
    """Packed on both sides; posttrain padded and padding-free on the same mixed-length rows in the
    same order: the same tokens each step and (bf16) nearly the same loss; --attn-posttrain varlen runs
    posttrain's padding-free and packed rows on posttrain's varlen attention, the others on sdpa."""
    _, rows, summary, md = run_race(races, request)
    for side, row in rows.items():
        assert row["tokens_per_s"] > 0 and all(t > 0 for t in row["tokens_per_step"])
        assert row["attn_implementation"] == ("varlen" if side in ("posttrain-packed", "posttrain-padding-free")
                                              else "sdpa"), side
    assert rows["posttrain-packed"]["engine"] == "torch" and rows["posttrain-packed"]["master_weights"] == "bf16"
    padded, free = rows["posttrain-padded"], rows["posttrain-padding-free"]
    assert padded["tokens_per_step"] == free["tokens_per_step"]
    assert free["losses"] == pytest.approx(padded["losses"], abs=2e-2)
    assert summary["summary"]["posttrain-packed"]["baseline"] == "trl-packed"
    assert "packed: posttrain tokens/s" in md and "mixed lengths: posttrain padding-free tokens/s" in md
    assert "attention: trl-packed sdpa, posttrain-packed varlen, posttrain-padded sdpa, posttrain-padding-free varlen" in md


def test_reward_race_tiny(races, request):
    """Both sides keep every pair (none passes max_length) and see the same tokens over the run."""
    _, rows, _, _ = run_race(races, request)
    assert rows["trl"]["pairs_kept"] == rows["posttrain"]["pairs_kept"] == 4
    assert sum(rows["trl"]["tokens_per_step"]) == sum(rows["posttrain"]["tokens_per_step"]) > 0
    assert rows["posttrain"]["engine"] == "torch"


def test_grpo_lora_race_tiny(races, request):
    """TRL and posttrain, each given the same peft_config (TRL's GRPOTrainer constructor), train their adapters."""
    _, rows, summary, md = run_race(races, request)
    trl, ours = rows["trl-lora"], rows["posttrain-lora"]
    assert trl["lora"] and trl["lora_b_norm"] > 0 and all(math.isfinite(x) for x in trl["losses"])
    assert all(math.isfinite(x) for x in ours["losses"]) and "generate" in ours["phase_s"]
    assert ours["lora"] and ours["lora_b_norm"] > 0
    assert "LoRA: posttrain" in md and summary["summary"]["posttrain-lora"]["baseline"] == "trl-lora"


def test_kto_race_tiny(races, request):
    """TRL's KTOTrainer and posttrain's default (auto: the torch path, fp32 states), rows of both labels."""
    head, rows, summary, _ = run_race(races, request)
    assert head["spec"] == {"shape": "tiny", "rows": 4, "seq_len": 64, "steps": 1, "warmup": 1}
    row = rows["posttrain-auto-fp32"]
    assert row["engine"] == "torch" and row["placements"] == {"policy": 0, "reference": 0}
    assert {"reference", "policy_forward", "backward"} <= set(row["phase_s"])
    assert summary["summary"]["posttrain-auto-fp32"]["baseline"] == "trl"


def test_grpo_tools_race_tiny(races, request):
    """Multi-turn GRPO, posttrain's engine against TRL's tool loop, the same scripted turns: each side's row is
    ok only if it made the expected tool calls (3 a completion) on every step without a failure."""
    head, rows, summary, md = run_race(races, request)
    for side, row in rows.items():
        assert row["call_frequency"] and all(f == 3.0 for f in row["call_frequency"]), side
    assert summary["summary"]["posttrain"]["baseline"] == "trl" and "tools/call_frequency" in md


def test_grpo_streaming_race_tiny(races, request):
    """Long-tailed GRPO, posttrain streaming against TRL given the same stop set: useful tokens counted per step,
    the streaming row's staleness within its bound."""
    head, rows, summary, md = run_race(races, request)
    for side, row in rows.items():
        assert len(row["tokens_per_step"]) == 2 and all(t > 0 for t in row["tokens_per_step"]), side
    assert all(s <= 1 for s in rows["posttrain-streaming"]["sample/staleness_max"])
    assert "useful tokens/s" in md


def test_grpo_long_context_tiny(tmp_path):
    """The long-context race (its own phases, not the runner's sides): posttrain at its length, TRL's search and its
    training phase's (here one length each, timed so that the comparison reuses it), every completion exactly its
    length on all sides, and the planner's prediction recorded (run on a GPU only)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/races/grpo_long_context.py", "--shape", "tiny", "--out", str(out),
                           "--workdir", str(tmp_path / "work"), "--search-warmup", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "grpo_long_context.jsonl").read_text().splitlines()]
    head, rows, summary = lines[0], {r["side"]: r for r in lines[1:-1]}, lines[-1]
    assert head["planner"]["next"] == head["planner"]["longest"] + 8 and head["planner_whole_gpu"]["gib"] == 139.0
    assert sorted(rows) == ["posttrain@16", "trl-train@16", "trl@16"]
    for side, row in rows.items():
        assert row["status"] == "ok" and row["exact_length"] and row["timed"], side
        assert row["lora_b_norm"] > 0 or side.startswith("trl-train"), side  # fixed completions may tie in reward
    assert any(t.startswith("TRL's training phase alone") and "16 tokens" in t for t in summary["targets"])
    assert any(t.startswith("at 16 tokens: posttrain") for t in summary["targets"]) and "## grpo_long_context" in (out / "results.md").read_text()
