"""Bad configuration gets a clear error that names the fix (no processes needed)."""

import json

import pytest

from posttrain import ConfigError, Role, Session, dsconfig, roles_for, roles_from_yaml

KW = dict(micro_batch_size=4, gradient_accumulation_steps=2, world_size=2, mixed_precision="no")

GUIDE_ZERO3 = """{
    "bf16": {
        "enabled": "auto"
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": true,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
    },
    "train_micro_batch_size_per_gpu": 1
}"""


def test_trailing_comma_names_position(tmp_path):
    path = tmp_path / "zero3.json"
    path.write_text(GUIDE_ZERO3)
    with pytest.raises(ConfigError, match=r"zero3.json:12:44: invalid JSON.*trailing comma"):
        dsconfig.read_config(path)


def test_guide_autos_are_resolved(tmp_path):
    cfg = json.loads(GUIDE_ZERO3.replace('"auto",\n    }', '"auto"\n    }'))
    out = dsconfig.resolve(cfg, role="teacher", trains=False, **KW)
    zero = out["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == 10**9 and zero["stage3_max_reuse_distance"] == 10**9
    assert out["bf16"]["enabled"] is False
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert zero["memory_efficient_linear"] is False
    dsconfig.resolve_hidden_size(out, 64, "teacher")
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640


def test_unfillable_auto_is_named():
    cfg = {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}, "train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match=r"zero_optimization.sub_group_size.*replace each with a number"):
        dsconfig.resolve(cfg, role="reference", trains=False, **KW)


def test_hidden_size_auto_without_hidden_size():
    out = dsconfig.resolve(dsconfig.read_config("zero3_inference"), role="reward", trains=False, **KW)
    with pytest.raises(ConfigError, match="reduce_bucket_size"):
        dsconfig.resolve_hidden_size(out, None, "reward")


def test_frozen_role_with_optimizer_block():
    with pytest.raises(ConfigError, match=r"frozen but its DeepSpeed config has an 'optimizer' block.*trains=True"):
        dsconfig.resolve(dsconfig.read_config("zero2_train_offload"), role="teacher", trains=False, **KW)


def test_trained_role_with_inference_config():
    with pytest.raises(ConfigError, match=r"inference-only.*zero2_train.json"):
        dsconfig.resolve(dsconfig.read_config("zero3_inference"), role="policy", trains=True, **KW)


def test_trained_micro_batch_mismatch():
    cfg = dsconfig.read_config("zero2_train")
    cfg["train_micro_batch_size_per_gpu"] = 16
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu is 16.*trainer uses 4"):
        dsconfig.resolve(cfg, role="policy", trains=True, **KW)


def test_trained_config_is_filled():
    out = dsconfig.resolve(dsconfig.read_config("zero2_train_offload"), role="student", trains=True,
                           learning_rate=1e-4, weight_decay=0.0, warmup_steps=10, max_grad_norm=0.5, **KW)
    assert out["train_batch_size"] == 16 and out["gradient_clipping"] == 0.5
    assert out["optimizer"]["params"]["lr"] == 1e-4 and out["scheduler"]["params"]["warmup_num_steps"] == 10


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match=r"not found.*zero3_inference"):
        dsconfig.read_config("zero7")


def test_mixes_and_yaml(tmp_path):
    roles = roles_for(["policy"], ["reference"], mix="zero2-replicated")
    assert [(r.name, r.config, r.trains) for r in roles] == [
        ("policy", "zero2_train", True), ("reference", "replicated_inference", False)]
    (tmp_path / "r.yaml").write_text("mix: zero3\nroles:\n  reference: zero3_inference_offload\n")
    roles = roles_from_yaml(tmp_path / "r.yaml", ["policy"], ["reference"])
    assert [r.config for r in roles] == ["zero3_train", "zero3_inference_offload"]
    with pytest.raises(ConfigError, match="unknown mix 'zero9'"):
        roles_for(["policy"], mix="zero9")
    with pytest.raises(ConfigError, match=r"unknown role\(s\) \['critic'\]"):
        roles_for(["policy"], configs={"critic": "zero3_inference"})


@pytest.mark.parametrize("var", ["ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"])
def test_overriding_env_var(monkeypatch, var):
    monkeypatch.setenv(var, "3")
    with pytest.raises(ConfigError, match=rf"{var}=3 would override posttrain's per-role"):
        Session(roles_for(["policy"], ["reference"]))


def test_roles_need_a_trainer_and_unique_names():
    with pytest.raises(ConfigError, match="at least one role must train"):
        Session([Role("reference", "zero3_inference")])
    with pytest.raises(ConfigError, match="unique"):
        Session([Role("policy", "zero2_train", trains=True), Role("policy", "zero3_inference")])
