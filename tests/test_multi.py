"""Disjoint multi-model training on two CPU processes: a ZeRO-2 LM and a ZeRO-3 classifier, each
with its own optimizer, scheduler and engine."""

import json
import math

import pytest
from conftest import run_json

from posttrain.errors import ConfigError
from posttrain.trainers.multi import MultiConfig, MultiTrainer, Task


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi")
    return run_json("multi_checks.py", tmp, tmp_path=tmp)


def test_each_model_under_its_own_plugin(run):
    assert run["world"] == 2 and run["stages"] == [2, 3]
    assert run["lm_whole"] and run["accelerators_distinct"]
    assert abs(run["clf_local"] / run["clf_full"] - 0.5) < 0.01


def test_a_step_moves_only_its_own_model(run):
    assert run["lm_step"]["lm"] > 1e-4 and run["lm_step"]["classifier"] == 0.0
    assert run["clf_step"]["classifier"] > 1e-4 and run["clf_step"]["lm"] == 0.0


def test_own_clipping(run):
    assert run["clipping"] == {"lm": 0.5, "classifier": 1.0}


def test_own_optimizer_and_scheduler(run):
    # The first step of a linear schedule over 4 steps used each model's own full rate; the whole
    # run logs the rate each step used (HF Trainer's learning_rate), down to 1/4 at the last.
    assert run["lrs"] == pytest.approx({"lm": 3e-3, "classifier": 1e-3})
    assert run["full"]["lm/learning_rate"] == pytest.approx([3e-3 * k / 4 for k in (4, 3, 2, 1)])
    assert run["full"]["classifier/learning_rate"] == pytest.approx([1e-3 * k / 4 for k in (4, 3, 2, 1)])


def test_both_learn_and_report_their_own_norms(run):
    full = run["full"]
    assert full["lm/loss"][-1] < full["lm/loss"][0] - 0.2
    assert all(math.isfinite(v) and v > 0 for v in full["lm/grad_norm"] + full["classifier/grad_norm"])
    assert full["lm/grad_norm"] != full["classifier/grad_norm"]


def test_save_then_resume_restores_both(run):
    assert run["steps"] == {"full": [1, 2, 3, 4], "resumed": [3, 4]}
    for key, values in run["resumed"].items():
        assert values == pytest.approx(run["full"][key][2:], abs=1e-6), key
    assert {"lm/model.safetensors", "classifier/model.safetensors"} <= set(run["checkpoint"])
    assert run["state"] == ["classifier", "lm", "saved_by.json", "trainer_state.json"]


def test_config_errors():
    with pytest.raises(ConfigError, match="at least one task"):
        MultiTrainer({}, args=MultiConfig())
    with pytest.raises(ConfigError, match=r"learning_rates names unknown model\(s\) \['critic'\]"):
        MultiTrainer({"lm": Task("x", [], lambda items: {})}, args=MultiConfig(learning_rates={"critic": 1e-3}))


def test_example_both_losses_fall(tmp_path):
    from conftest import ROOT, torchrun

    out = tmp_path / "run"
    torchrun(ROOT / "examples" / "multi_model.py", "--config", ROOT / "configs" / "multi_model.yaml",
             "--output_dir", out, "--max_steps", "30", "--save_steps", "30", "--sentiment_pairs", "256",
             "--disable_tqdm", "true")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement"] == {"lm": 2, "classifier": 3}
    for name in ("lm", "classifier"):
        r = summary[name]
        assert r["heldout_loss_after"] < r["heldout_loss_before"], name
        assert r["train_loss_last_tenth"] < r["train_loss_first_tenth"], name
    assert (out / "checkpoint-30" / "classifier" / "model.safetensors").exists()
    # Disjoint models: each in its own folder, none at the top.
    assert (out / "lm" / "model.safetensors").exists() and (out / "classifier" / "model.safetensors").exists()
    assert not (out / "config.json").exists()
