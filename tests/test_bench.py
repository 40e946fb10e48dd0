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

from benchmarks import harness  # noqa: E402
from benchmarks.workloads import is_oom  # noqa: E402


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--workload", "ppo", "--shape", "tiny", "--micro-batch", "2", "--seq-len", "40", "--response-len", "8",
            "--mixes", "zero2-zero3,trl-zero3", "--steps", "5", "--out", str(out), "--timeout", "240",
            "--profile-steps", "1"]
    rc = harness.main(argv)
    return rc, out, json.loads((out / "results.json").read_text())["rows"]


def test_every_mix_runs_in_its_own_group(ppo_run):
    rc, _, rows = ppo_run
    assert rc == 0
    assert [r["mix"] for r in rows] == ["zero2-zero3", "trl-zero3"]
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["world_size"] == 2 and r["steps"] == 5
        assert set(r["phase_s"]) == {"generate", "score", "train"}
        # The phases happen inside the step, so in every step they cannot take longer than it
        # (medians need not add up, so compare step by step).
        assert len(r["step_times"]) == 5
        for t in r["step_times"]:
            assert 0 < sum(v for k, v in t.items() if k != "step") <= t["step"] + 1e-4  # rows round to 1e-5
        assert r["tokens_per_s"] == pytest.approx(2 * 40 * 2 / r["step_s"], rel=0.01)
        assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"])
        assert r["setup_s"] > 0
        assert "peak_allocated_gib" not in r  # no CUDA here: no memory numbers rather than zeros
        # The canary checked both frozen roles (fast ZeRO-3 and TRL's ZeRO-3) against their
        # unsharded weights: equal to fp32 rounding.
        assert set(r["canary"]) == {"reference", "reward"} and r["canary_tolerance"] == 1e-3
        assert r["canary_max_abs_diff"] < 1e-5


def test_outputs_and_command(ppo_run):
    _, out, rows = ppo_run
    table = (out / "results.md").read_text()
    assert table.count("| ppo-tiny-mb2-s40-r8 |") == 2
    assert (out / "commands.txt").read_text().strip().endswith(f"--out {out} --timeout 240 --profile-steps 1")
    # --profile-steps: rank 0's trace of one more (unmeasured) step, beside each run's log.
    for mix in ("zero2-zero3", "trl-zero3"):
        run_dir = out / "runs" / f"ppo-tiny-mb2-s40-r8-{mix}"
        assert (run_dir / "trace-rank0.json.gz").stat().st_size > 1000
        assert "step_0" in (run_dir / "kernels-rank0.txt").read_text()
    assert rows[0]["command"].startswith("python benchmarks/harness.py --workload ppo")
    pytest.importorskip("matplotlib")
    assert (out / "results.png").stat().st_size > 1000


def test_posttrain_bench_command_renders(ppo_run):
    from posttrain import cli

    _, out, _ = ppo_run
    (out / "results.md").unlink()
    assert cli.main(["bench", "--report", str(out)]) == 0
    assert "| ppo-tiny-mb2-s40-r8 | trl-zero3 | ok |" in (out / "results.md").read_text()


FAKE_WORKER = """
import json, os, sys, time
spec, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
mode = json.load(open(spec))["mix"]
if mode == "zero3":  # stands for a mix that hangs
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
    row = harness.run_one(spec("zero3"), tmp_path / "run", 1, timeout=10, worker=worker)
    assert row["status"] == "timeout"
    assert row["wall_s"] < 30


def test_distill_with_a_local_model_shape(tmp_path):
    """A role's shape can come from a local path (its config; random weights), and distill runs."""
    from posttrain.demo import tiny

    teacher = tiny.model_path(hidden_size=96, intermediate_size=256)
    argv = ["--workload", "distill", "--shape", "tiny", "--role-shape", f"teacher={teacher}", "--micro-batch", "2",
            "--seq-len", "32", "--mixes", "zero2-zero3", "--out", str(tmp_path)]
    assert harness.main(argv) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["status"] == "ok" and row["shapes"]["teacher"] == str(teacher)
    assert set(row["phase_s"]) == {"teacher_forward", "student_forward_backward", "optimizer_step"}
    assert all(math.isfinite(x) and x > 0 for x in row["losses"])


def test_canary_marks_a_perturbed_frozen_model_wrong(tmp_path):
    """The frozen reference's weights change after the canary's unsharded copy is taken (what a
    wrong gather does to the forward): the row is `wrong`, and the table says so."""
    spec = dict(workload="dpo", shapes={"policy": "tiny", "reference": "tiny"}, micro_batch=2, seq_len=24,
                response_len=0, warmup=0, steps=1, precision=None, profile_steps=0, mix="zero2-zero3",
                canary_perturb=0.01)
    row = harness.run_one(spec, tmp_path / "run", 2, timeout=300)
    assert row["status"] == "wrong", row.get("error")
    assert row["canary"]["reference"] > 10 * row["canary_tolerance"]
    assert "differ from the unsharded weights" in row["error"] and "step_s" in row  # measurements kept
    harness.save(tmp_path, [{**row, "case": "perturbed", "mix": "zero2-zero3"}], "")
    assert "| perturbed | zero2-zero3 | **wrong** |" in (tmp_path / "results.md").read_text()


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


@pytest.mark.parametrize("tied", [False, True])
def test_host_copy_runs_unit_by_unit_and_equals_the_model(tied):
    """The canary's unsharded copy of a replicated model (no process group needed): same outputs,
    tied weights copied once, and between forwards its parameters are in host memory."""
    from transformers import AutoModelForCausalLM

    from benchmarks.canary import HostCopy, outputs
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
