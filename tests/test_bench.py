"""The benchmark harness on two CPU processes (correctness, not speed), and its failure rows."""

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import harness  # noqa: E402
from benchmarks.races.race import is_oom  # noqa: E402

# Each workload under one of posttrain's mixes and one TRL baseline: TRL's own DPOTrainer,
# GKDTrainer, SFTTrainer and RewardTrainer, and (TRL has no PPOTrainer) posttrain's PPO in TRL's
# ZeRO-3 placement.
RUNS = {
    "dpo": ["--micro-batch", "2", "--seq-len", "32", "--mixes", "zero2-zero3,trl-zero2"],
    "ppo": ["--micro-batch", "2", "--seq-len", "40", "--response-len", "8", "--mixes", "zero2-zero3,trl-zero3",
            "--profile-steps", "1"],
    "distill": ["--micro-batch", "2", "--seq-len", "32", "--mixes", "zero2-zero3,trl-zero3"],
    "sft": ["--micro-batch", "2", "--seq-len", "32", "--mixes", "zero2-zero3,trl-zero3"],
    "reward": ["--micro-batch", "2", "--seq-len", "32", "--mixes", "zero3,trl-zero2"],
}
TRAINERS = {("dpo", "zero2-zero3"): "posttrain.DPOTrainer", ("dpo", "trl-zero2"): "trl.DPOTrainer",
            ("ppo", "zero2-zero3"): "posttrain.PPOTrainer", ("ppo", "trl-zero3"): "posttrain.PPOTrainer (TRL's placement)",
            ("distill", "zero2-zero3"): "posttrain.DistillationTrainer", ("distill", "trl-zero3"): "trl.GKDTrainer",
            ("sft", "zero2-zero3"): "posttrain.SFTTrainer", ("sft", "trl-zero3"): "trl.SFTTrainer",
            ("reward", "zero3"): "posttrain.RewardTrainer", ("reward", "trl-zero2"): "trl.RewardTrainer"}
PHASES = {"dpo": {"reference", "policy_forward", "backward"}, "ppo": {"generate", "policy_forward", "score", "train"},
          "distill": {"forward", "backward"}, "sft": {"forward", "backward"}, "reward": {"forward", "backward"}}
# The frozen roles the canary checks; SFT and reward have none.
FROZEN = {"dpo": {"reference"}, "ppo": {"reference", "reward"}, "distill": {"teacher"}, "sft": set(), "reward": set()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One results dir holding every workload's rows. Distillation's models are local folders (used
    as they are, weights included): the tiny default and a wider teacher of its vocabulary."""
    from posttrain.demo import tiny

    out = tmp_path_factory.mktemp("bench")
    teacher = tiny.model_path(hidden_size=96, intermediate_size=256)
    codes = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # two processes on a 2-core machine: no oversubscribed threads
        for workload, extra in RUNS.items():
            shape = ["tiny"] if workload != "distill" else [str(tiny.model_path()), "--role-shape", f"teacher={teacher}"]
            codes[workload] = harness.main(["--workload", workload, "--shape", *shape, *extra, "--warmup", "1",
                                            "--steps", "2", "--out", str(out), "--timeout", "300"])
    return codes, out, json.loads((out / "results.json").read_text())["rows"], teacher


def test_every_workload_runs_its_trainer_under_each_mix(runs):
    codes, _, rows, teacher = runs
    assert codes == dict.fromkeys(RUNS, 0)
    assert [(r["workload"], r["mix"]) for r in rows] == list(TRAINERS)
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["trainer"] == TRAINERS[r["workload"], r["mix"]]
        assert r["world_size"] == 2 and r["steps"] == 2 and len(r["step_times"]) == 2
        # posttrain's trainers report their phases, TRL's none; the phases happen inside the step,
        # so in every step they cannot take longer than it (medians need not add up).
        assert set(r["phase_s"]) == (PHASES[r["workload"]] if r["trainer"].startswith("posttrain") else set())
        for t in r["step_times"]:
            assert 0 < sum(v for k, v in t.items() if k != "step") <= t["step"] + 1e-4 or not r["phase_s"]
        per_step = {"dpo": 2 * 2 * 32, "ppo": 2 * 40, "distill": 2 * 32, "sft": 2 * 32, "reward": 2 * 2 * 32}[r["workload"]]
        assert r["tokens_per_s"] == pytest.approx(per_step * 2 / r["step_s"], rel=0.01)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        # Checkpointing: TRL's default for DPO, SFT and reward on both sides; GKD and PPO have none.
        assert r["setup_s"] > 0 and r["gradient_checkpointing"] is (r["workload"] in ("dpo", "sft", "reward"))
        assert "peak_allocated_gib" not in r  # no CUDA here: no memory numbers rather than zeros
        if r["trainer"].startswith("posttrain"):  # two processes: DeepSpeed runs every trained role
            assert set(r["engines"].values()) == {"deepspeed"}, r["engines"]
        # The canary checked every frozen role (posttrain's fast ZeRO-3, TRL's prepare_deepspeed
        # engines) against its unsharded weights: equal to fp32 rounding.
        assert set(r["canary"]) == FROZEN[r["workload"]]
        if not FROZEN[r["workload"]]:  # nothing to check: no difference or tolerance claimed
            assert "canary_max_abs_diff" not in r and "canary_tolerance" not in r
            continue
        assert r["canary_tolerance"] == 1e-3 and r["canary_max_abs_diff"] < 1e-5
    by = {(r["workload"], r["mix"]): r for r in rows}
    # The rollout engine's counters: PPO's policy generated with the engine, nothing fell back.
    for mix in ("zero2-zero3", "trl-zero3"):
        st = by["ppo", mix]["rollout"]["policy"]
        assert st["backend"] == "posttrain" and st["fallback"] is None and st["compile_fallbacks"] == 0
    assert by["distill", "zero2-zero3"]["shapes"]["teacher"] == str(teacher)
    # PPO in TRL's placement is the same computation as under posttrain's mix: same losses.
    assert by["ppo", "trl-zero3"]["losses"] == pytest.approx(by["ppo", "zero2-zero3"]["losses"], abs=1e-5)
    # SFT and reward: posttrain's and TRL's trainers saw the same rows in the same batches (TRL's
    # data order, the same model and step): the same losses, under different ZeRO stages.
    for workload, mixes in (("sft", ("zero2-zero3", "trl-zero3")), ("reward", ("zero3", "trl-zero2"))):
        ours, trl = (by[workload, m]["losses"] for m in mixes)
        assert ours == pytest.approx(trl, abs=1e-4)
    assert by["reward", "zero3"]["shapes"] == {"reward": "tiny"}


def test_outputs_and_command(runs):
    _, out, rows, _ = runs
    table = (out / "results.md").read_text()
    assert table.count("| ppo-tiny-mb2-s40-r8 |") == 2
    assert "| dpo-tiny-mb2-s32 | trl-zero2 | trl.DPOTrainer | ok |" in table
    assert "| sft-tiny-mb2-s32 | trl-zero3 | trl.SFTTrainer | ok |" in table
    # The planner's figure for SFT and reward rows too (no measured peak here: no CUDA); no canary.
    for r in rows[-4:]:
        planned = harness.planned_peak(r)
        line = next(x for x in table.splitlines() if x.startswith(f"| {r['case']} | {r['mix']} |"))
        assert planned > 0 and line.split(" | ")[9] == f"{planned:.2f}" and line.endswith("| no frozen role |")
    commands = (out / "commands.txt").read_text().splitlines()
    assert len(commands) == len(RUNS) and commands[1].endswith("--steps 2 --out " + f"{out} --timeout 300")
    # --profile-steps: rank 0's trace of one more (unmeasured) step, beside each run's log.
    for mix in ("zero2-zero3", "trl-zero3"):
        run_dir = out / "runs" / f"ppo-tiny-mb2-s40-r8-{mix}"
        assert (run_dir / "trace-rank0.json.gz").stat().st_size > 1000
        assert "step_0" in (run_dir / "kernels-rank0.txt").read_text()
    assert rows[0]["command"].startswith("python benchmarks/harness/harness.py --workload dpo")
    pytest.importorskip("matplotlib")
    assert (out / "results.png").stat().st_size > 1000


def test_harness_report_renders(runs):
    _, out, _, _ = runs
    (out / "results.md").unlink()
    assert harness.main(["--report", str(out)]) == 0
    assert "+teacher=" in (out / "results.md").read_text()
    assert "| trl-zero3 | trl.GKDTrainer | ok |" in (out / "results.md").read_text()


FAKE_WORKER = """
import json, os, sys, time
spec, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
mode = json.load(open(spec))["mix"]
if mode == "zero3":  # stands for a mix that hangs
    open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(120)
res = {"rank": rank, "status": "oom" if rank == 0 else "ok", "peak_allocated_gib": 130.5,
       "peak_reserved_gib": 131.0, "device_total_gib": 139.8, "error": "OutOfMemoryError: CUDA out of memory"}
json.dump(res, open(os.path.join(out, f"rank{rank}.json"), "w"))
time.sleep(1)
os._exit(3 if rank == 0 else 0)
"""


def spec(mix):
    return dict(workload="dpo", shapes={"policy": "tiny", "reference": "tiny"}, micro_batch=1, seq_len=8,
                response_len=0, warmup=1, steps=5, precision=None, mix=mix)


def test_oom_is_a_row_not_a_crash(tmp_path):
    worker = tmp_path / "fake.py"
    worker.write_text(textwrap.dedent(FAKE_WORKER))
    row = harness.run_one(spec("zero2-replicated"), tmp_path / "run", 2, timeout=120, worker=worker)
    assert row["status"] == "oom"
    assert "out of memory" in row["error"]
    assert row["peak_allocated_gib"] == [130.5, 130.5]


def test_hung_mix_times_out(tmp_path):
    worker = tmp_path / "fake.py"
    worker.write_text(textwrap.dedent(FAKE_WORKER))
    row = harness.run_one(spec("zero3"), tmp_path / "run", 1, timeout=5, worker=worker)
    assert row["status"] == "timeout"
    assert row["wall_s"] < 25
    # The hung worker (its own session under torch elastic) is gone, not left beside the next mix.
    pid = int((tmp_path / "run" / "pid0").read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the hung worker still runs"


def test_canary_catches_changed_weights_and_the_row_says_wrong(tmp_path):
    """Weights that change after the canary's unsharded copy is taken (what a wrong gather does to
    the forward) show as a difference far beyond the tolerance; such a row is `wrong` in the table."""
    from transformers import AutoModelForCausalLM

    from benchmarks.harness import canary
    from posttrain.demo import tiny

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.model_config()).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    assert canary.check(model, ids) == 0.0

    def perturb():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)

    assert canary.check(model, ids, perturb=perturb) > 10 * canary.TOLERANCE[torch.float32]
    row = {"case": "perturbed", "mix": "zero2-zero3", "trainer": "posttrain.DPOTrainer", "workload": "dpo",
           "step_s": 0.1, **harness.canary_verdict([{"canary": {"reference": 0.5}, "canary_tolerance": 1e-3}])}
    assert row["status"] == "wrong" and "differ from the unsharded weights" in row["error"]
    harness.save(tmp_path, [row], "")
    assert "| perturbed | zero2-zero3 | posttrain.DPOTrainer | **wrong** | 0.100 |" in (tmp_path / "results.md").read_text()


def test_rollout_fallbacks_mark_a_row_degraded():
    """The rollout engine's counters on any rank: a lost compile or graph, or the engine giving
    way to generate, makes the row degraded with the reasons; none leaves it as it is."""
    clean = {"policy": {"backend": "posttrain", "fallback": None, "compile_fallbacks": 0, "capture_fallbacks": 0}}
    assert harness.rollout_verdict([{"rank": 0, "rollout": clean}, {"rank": 1}]) == {}
    lost = {"policy": {**clean["policy"], "capture_fallbacks": 1, "fallback_reasons": ["capture failed: OOM"]}}
    verdict = harness.rollout_verdict([{"rank": 0, "rollout": clean}, {"rank": 1, "rollout": lost}])
    assert verdict == {"status": "degraded", "error": "rank 1 policy: capture failed: OOM"}
    hf = {"policy": {**clean["policy"], "backend": "hf", "fallback": "model type 'gpt2' has no posttrain decode path"}}
    assert "gpt2" in harness.rollout_verdict([{"rank": 0, "rollout": hf}])["error"]
    # The step's default variants lost, the attention a run asked for, or generate run for the adapters.
    for counter in ("sdpa_fallbacks", "fused_fallbacks", "flex_fallbacks", "triton_fallbacks", "adapter_fallbacks"):
        slow = {"policy": {**clean["policy"], counter: 1, "fallback_reasons": [counter]}}
        assert harness.rollout_verdict([{"rank": 0, "rollout": slow}])["status"] == "degraded"


def test_memory_at_rest_groups_live_allocations_by_origin():
    """--memory-at-rest's summary: live blocks only, by the innermost frame of a library that made
    them, largest first."""
    from benchmarks.harness.workloads import allocations_by_origin

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    kv = [frame("/x/torch/_tensor.py", 1, "zeros"), frame("/x/posttrain/rollout/engine.py", 180, "__init__"),
          frame("/x/posttrain/rollout/api.py", 220, "generate")]
    adam = [frame("/x/deepspeed/runtime/zero/stage_1_and_2.py", 700, "initialize_optimizer_states")]
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 2**29, "frames": kv},
                    {"state": "inactive", "size": 2**32, "frames": kv},
                    {"state": "active_allocated", "size": 2**30, "frames": adam}]},
        {"blocks": [{"state": "active_allocated", "size": 2**29, "frames": kv},
                    {"state": "active_allocated", "size": 2**20, "frames": []}]}]}
    assert allocations_by_origin(snapshot) == [["rollout/engine.py:180 __init__", 1.0, 2],
                                               ["zero/stage_1_and_2.py:700 initialize_optimizer_states", 1.0, 1],
                                               ["(no frame recorded)", round(2**20 / 2**30, 4), 1]]


def test_memory_at_peak_replays_the_allocation_trace():
    """--memory-at-rest's peak: the trace replayed (frees matched by address, frees of blocks from
    before the recording ignored), what was live at its highest point by origin."""
    from benchmarks.harness.workloads import allocations_at_peak

    def frames(name):
        return [{"filename": f"/x/posttrain/trainers/{name}.py", "line": 1, "name": name}]

    def alloc(addr, size, name):
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames(name)}

    def free(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size}

    g = 2**30
    trace = [free(99, g), alloc(1, g, "weights"), alloc(2, 2 * g, "grads"), alloc(3, g, "flat"), free(3, g),
             free(2, 2 * g), alloc(4, g, "logits"), free(4, g)]
    out = allocations_at_peak({"device_traces": [trace]})
    assert out["peak_over_trace_start_gib"] == 4.0 and out["peak_event"] == 3 and out["events"] == 8
    assert out["by_origin"] == [["trainers/grads.py:1 grads", 2.0, 1], ["trainers/weights.py:1 weights", 1.0, 1],
                                ["trainers/flat.py:1 flat", 1.0, 1]]
    assert allocations_at_peak({"device_traces": []})["peak_over_trace_start_gib"] == 0.0


def test_canary_verdict_takes_every_rank():
    def rank(ref, **extra):
        return {"canary": {"reference": ref, "reward": 0.0}, "canary_tolerance": 0.1, **extra}

    ok = harness.canary_verdict([rank(0.0), rank(0.05)])
    assert "status" not in ok and ok["canary"] == {"reference": 0.05, "reward": 0.0}
    # One rank off is enough.
    wrong = harness.canary_verdict([rank(0.0), rank(2.2)])
    assert wrong["status"] == "wrong" and wrong["canary_max_abs_diff"] == 2.2 and "reference 2.2" in wrong["error"]
    unchecked = harness.canary_verdict([rank(0.0), {"canary_error": "RuntimeError: no unit holds x"}])
    assert unchecked["status"] == "unchecked" and "no unit holds" in unchecked["error"]
    # No frozen role (SFT, reward): nothing checked, so no difference, tolerance or status claimed.
    assert harness.canary_verdict([{"canary": {}}, {"canary": {}}]) == {"canary": {}}
    assert harness.canary_cell({"canary": {}}) == "no frozen role" and harness.canary_cell({}) == ""


@pytest.mark.parametrize("tied", [False, True])
def test_host_copy_runs_unit_by_unit_and_equals_the_model(tied):
    """The canary's unsharded copy of a replicated model (no process group needed): same outputs,
    tied weights copied once, and between forwards its parameters are in host memory."""
    from transformers import AutoModelForCausalLM

    from benchmarks.harness.canary import HostCopy, outputs
    from posttrain.demo import tiny

    torch.manual_seed(0)
    cfg = tiny.model_config()
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    copy = HostCopy(model, torch.device("cpu"))
    seen = []
    handle = copy.units[1][0].register_forward_pre_hook(lambda m, a: seen.append(m.self_attn.q_proj.weight))
    with torch.no_grad():
        want = outputs(model(input_ids=ids), ids)
    got = outputs(copy(input_ids=ids), ids)
    handle.remove()
    assert torch.equal(got, want)
    # During its unit's forward the weight is a device copy, not the host parameter it restores after.
    host = copy.units[1][1][0][2]
    assert seen and seen[0] is not host and copy.units[1][0].self_attn.q_proj.weight is host
    names = {n for n, _ in copy.model.named_parameters()}
    assert ("lm_head.weight" in names) is not tied  # tied: one parameter, as in the model


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom(ValueError("shapes do not match"))


def test_rows_replace_same_case_and_mix(tmp_path):
    row = {"case": "c", "mix": "zero3", "status": "skipped", "workload": "dpo"}
    harness.save(tmp_path, [row], "cmd one")
    harness.save(tmp_path, [{**row, "status": "timeout"}, {**row, "mix": "zero2-zero3"}], "cmd two")
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["mix"], r["status"]) for r in rows] == [("zero3", "timeout"), ("zero2-zero3", "skipped")]
    assert (tmp_path / "commands.txt").read_text().splitlines() == ["cmd one", "cmd two"]


def test_unknown_mix_fails_before_running(tmp_path):
    with pytest.raises(ValueError, match="unknown mix 'zero9'"):
        harness.main(["--mixes", "zero9", "--out", str(tmp_path)])


def test_rounds_pool_every_measured_step():
    def row(steps, peak):
        times = [{"step": s, "reference_forward": s / 4} for s in steps]
        return {"case": "c", "mix": "m", "status": "ok", "step_s": sorted(steps)[len(steps) // 2], "steps": len(steps),
                "step_times": times, "phase_s": {"reference_forward": 0.0}, "tokens_per_s": 1000 / sorted(steps)[len(steps) // 2],
                "setup_s": 2.0, "wall_s": 10.0, "peak_allocated_gib": [peak, 1.0], "peak_reserved_gib": [peak, 1.0]}

    pooled = harness.pool_rounds([row([1.0, 2.0, 3.0], 5.0), row([4.0, 5.0, 6.0], 7.0)])
    assert pooled["rounds"] == 2 and pooled["steps"] == 6 and pooled["round_step_s"] == [2.0, 5.0]
    assert pooled["step_s"] == 3.5 and pooled["phase_s"]["reference_forward"] == 3.5 / 4
    assert pooled["peak_allocated_gib"] == [7.0, 1.0] and pooled["wall_s"] == 20.0
    assert pooled["tokens_per_s"] == pytest.approx(1000 / 3.5, rel=1e-3)
    failed = harness.pool_rounds([row([1.0], 1.0), {"case": "c", "mix": "m", "status": "oom", "error": "x"}])
    assert failed["status"] == "oom" and failed["rounds"] == 2
    # A round the time budget skipped or cut short is left out; the completed ones stand.
    skipped = {"case": "c", "mix": "m", "status": "skipped", "error": "time budget spent while it ran"}
    assert harness.pool_rounds([row([1.0, 2.0, 3.0], 5.0), skipped]) == row([1.0, 2.0, 3.0], 5.0)
    assert harness.pool_rounds([skipped, skipped])["status"] == "skipped"
    # The canary: the largest difference of any round.
    a, b = (dict(row([1.0], 1.0), canary={"reference": d}, canary_max_abs_diff=d) for d in (0.0, 0.02))
    pooled = harness.pool_rounds([a, b])
    assert pooled["canary"] == {"reference": 0.02} and pooled["canary_max_abs_diff"] == 0.02
    # No frozen role (SFT, reward): pooled rounds still claim no difference.
    pooled = harness.pool_rounds([dict(row([1.0], 1.0), canary={}), dict(row([2.0], 1.0), canary={})])
    assert pooled["canary"] == {} and "canary_max_abs_diff" not in pooled

