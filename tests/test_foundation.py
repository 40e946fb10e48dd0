"""The role layer on two CPU processes: placement, activation, numerics, accumulation, resume."""

import json

import pytest
from conftest import ROOT, torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("foundation")
    ckpt = tmp / "ckpt"
    torchrun(ROOT / "tests" / "dist" / "foundation.py", tmp, "full-then-resume", ckpt)  # one launch
    return json.loads((tmp / "full.json").read_text()), json.loads((tmp / "resume.json").read_text())


def test_two_processes(runs):
    assert runs[0]["world"] == 2


def test_frozen_zero3_is_partitioned_and_policy_whole(runs):
    r = runs[0]
    assert r["ref_data_empty"]
    # Each rank holds half of every parameter (up to padding).
    assert abs(r["ref_local"] / r["ref_full"] - 0.5) < 0.01
    assert r["policy_whole"] and r["policy_numel"] == r["ref_full"]


def test_zero3_flag_follows_active_role(runs):
    r = runs[0]
    assert r["zero3_outside"] is False and r["zero3_inside"] is True and r["zero3_after"] is False
    assert r["active_inside"] == "reference"
    assert r["active_after_raise"] == "policy"


def test_frozen_outputs_equal_unsharded(runs):
    assert runs[0]["ref_vs_plain"] < 1e-5


def test_accumulation_survives_frozen_prepare(runs):
    r = runs[0]
    assert r["ga_after_frozen"] == [2, 2]
    # With 2 accumulation steps the weights move every second micro-step.
    losses = r["losses"]
    assert all(losses[i] == losses[i + 1] for i in range(0, 20, 2))
    assert losses[2] != losses[0]


def test_policy_trains(runs):
    losses = runs[0]["losses"]
    assert losses[-1] < losses[0] - 0.5
    # The frozen reference did not move.
    assert abs(runs[0]["ref_loss"] - losses[0]) < 1e-5


def test_scheduler_steps_once_per_optimizer_step(runs):
    # learning_rate is the rate the last optimizer step used (HF Trainer's logged value): 1/(1+k)
    # for the k-th step (k from 0) of a LambdaLR, 10 steps of 2 micro-batches.
    lrs = runs[0]["lrs"]
    assert lrs[:2] == pytest.approx([3e-3, 3e-3])
    assert lrs[2] == pytest.approx(3e-3 / 2) or lrs[3] == pytest.approx(3e-3 / 2)
    assert lrs[-1] == pytest.approx(3e-3 / 10)


def test_resume_gives_same_losses(runs):
    full, resumed = runs
    assert resumed["losses"] == pytest.approx(full["losses"][10:], abs=1e-6)


def test_session_errors(runs):
    e = runs[0]["errors"]
    assert "unknown role 'critic'" in e["unknown_role"] and "Role(name, config)" in e["unknown_role"]
    assert "frozen and cannot take an optimizer" in e["frozen_optimizer"]
    assert "frozen: it has no backward" in e["frozen_backward"]
