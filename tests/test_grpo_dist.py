"""GRPO and RLOO on two CPU processes (one launch, tests/dist/grpo_checks.py): placement
invariance, resume, beta 0 without a reference, learning, TRL's metric names."""

import pytest
from conftest import run_json

COMPARED = ["loss", "reward", "reward_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "clip_ratio/high_max", "grad_norm", "rewards/sentiment_reward/mean",
            "rewards/reward-trained-s0-n200/mean", "completions/mean_length", "num_tokens"]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    return run_json("grpo_checks.py", str(tmp / "runs"), tmp_path=tmp)


def close(a: dict, b: dict, keys: list[str], tol: float) -> None:
    assert a["step"] == b["step"]
    for k in keys:
        if k in a or k in b:
            assert b[k] == pytest.approx(a[k], abs=tol, rel=tol), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("mix", ["zero2-replicated", "zero3", "hf"])
def test_placement_invariance(checks, mix):
    """The same samples, rewards (function and reward-model role), KL to a reference synced every
    step, clipped ratios and losses whatever the placement: policy ZeRO-2 or ZeRO-3, frozen roles
    ZeRO-3 or replicated; "hf": the default mix generating with transformers' generate."""
    base, other = checks["placements"]["zero2-zero3"], checks["placements"][mix]
    assert len(base) == len(other) == 4
    for a, b in zip(base, other):
        close(a, b, COMPARED, 1e-4)
    assert checks["roles"][mix] == ["policy", "reference", "reward"]


def test_the_runs_exercise_kl_clipping_and_reuse(checks):
    """So that invariance means something: the reference drifts (synced), ratios clip on the
    reused generation batch (steps 2 and 4 train on the batch sampled at steps 1 and 3)."""
    rows = checks["placements"]["zero2-zero3"]
    assert rows[1]["kl"] > 0 and rows[3]["kl"] > 0
    assert rows[1]["clip_ratio/region_mean"] > 0
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["reward"] != rows[1]["reward"]
    assert all(r["time/ref_sync"] > 0 for r in rows)
    assert checks["rollout"]["zero3"]["backend"] == "posttrain"  # the ZeRO-3 policy gathered for the engine
    assert checks["rollout"]["hf"]["backend"] == "hf"


def test_resume_equals_uninterrupted(checks):
    full, resumed = checks["placements"]["zero2-zero3"], checks["resumed"]
    # The history is the whole run's: the rows kept in metrics.jsonl up to checkpoint-2, then the resumed ones.
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        close(a, b, [*COMPARED, "learning_rate", "epoch"], 1e-5)


def test_beta_zero_loads_no_reference(checks):
    assert checks["roles"]["beta0"] == ["policy"]
    assert "kl" not in checks["learn"][0]


def test_learns_the_bundled_reward(checks):
    """40 steps on the bundled reward (positive minus negative adjectives, in [-2, 2])."""
    hist = checks["learn"]
    tenth = len(hist) // 10
    first = sum(h["reward"] for h in hist[:tenth]) / tenth
    last = sum(h["reward"] for h in hist[-tenth:]) / tenth
    assert last - first > 0.7, (first, last)


def test_trl_metric_names_and_phases(checks):
    row = checks["placements"]["zero2-zero3"][0]  # a step that generated
    for key in ["reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean",
                "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "completions/mean_terminated_length", "num_tokens",
                "rewards/sentiment_reward/mean", "rewards/sentiment_reward/std", "loss", "grad_norm",
                "learning_rate", "epoch", "time/generate", "time/score", "time/policy_forward", "time/train"]:
        assert key in row, key


def test_rloo_placement_invariance(checks):
    base, other = checks["rloo"]["zero2-zero3"], checks["rloo"]["zero2-replicated"]
    assert len(base) == len(other) == 4
    for a, b in zip(base, other):
        close(a, b, ["loss", "reward", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"], 1e-4)
    # One generation batch (steps_per_generation 2 x num_iterations 2) serves all four steps; the
    # policy moves away from the sampler's old log-probs over them.
    assert len({r["reward"] for r in base}) == 1
    assert any(r["clip_ratio/region_mean"] > 0 for r in base[1:])
