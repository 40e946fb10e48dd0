"""Bad configuration gets a clear error that names the fix (no processes needed)."""

import json

import pytest

from posttrain import ConfigError, Role, Session, roles_for, roles_from_yaml
from posttrain.demo import tiny
from posttrain.placement import dsconfig

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


# -- a script's bad input: one sentence naming the fix -------------------------------------------
def _dpo_cli(tmp_path, *argv):
    """`posttrain dpo` in-process: every error below is raised before any process group exists."""
    from posttrain import cli

    return cli.main(["dpo", "--output_dir", str(tmp_path / "run"), *map(str, argv)])


def _error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1, err
    return err[0]


def test_malformed_jsonl_line_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n\n{"prompt": "a", "chosen": oops}\n')
    assert _dpo_cli(tmp_path, "--model_name_or_path", tiny.sft_model_path(), "--dataset_name", data) == 2
    assert _error(capsys) == (f"error: {data}, line 3: not valid JSON (Expecting value at column 27); "
                              "fix or remove that line")
    doc = tmp_path / "pairs.json"
    doc.write_text('[{"prompt": "a",\n  "chosen": }]')
    with pytest.raises(ConfigError, match=r"pairs.json, line 2, column 13: not valid JSON"):
        from posttrain.data.preference import load_dataset_source

        load_dataset_source(str(doc))


def test_empty_dataset_file(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n  \n")
    assert _dpo_cli(tmp_path, "--model_name_or_path", tiny.sft_model_path(), "--dataset_name", data) == 2
    assert _error(capsys) == f"error: {data} is empty: give a data file with at least one row"


def test_row_missing_a_column(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": "a", "chosen": " b"}\n')
    assert _dpo_cli(tmp_path, "--model_name_or_path", tiny.sft_model_path(), "--dataset_name", data) == 2
    assert _error(capsys) == (f"error: {data} (split 'train'): row 1 has a missing or empty 'rejected'; "
                              "fill it in or drop the row")
    data.write_text('{"prompt": "a", "chosen": " b"}\n')
    assert _dpo_cli(tmp_path, "--model_name_or_path", tiny.sft_model_path(), "--dataset_name", data) == 2
    assert _error(capsys) == (f"error: {data} (split 'train'): no column 'rejected'; a preference dataset needs "
                              "prompt, chosen, rejected (or an implicit prompt in chosen/rejected), got columns "
                              "['prompt', 'chosen']: rename its columns")


def test_model_path_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "sft-model"
    assert _dpo_cli(tmp_path, "--model_name_or_path", missing) == 2
    assert _error(capsys) == (f"error: --model_name_or_path '{missing}' does not exist: {tmp_path} has no folder "
                              "'sft-model'; check the path")
    from posttrain.placement.session import check_model_path

    with pytest.raises(ConfigError, match=r"'\./nowhere/model' does not exist: it is neither a local directory "
                                          r"nor a hub id \(owner/name\); check the path"):
        check_model_path("./nowhere/model")
    check_model_path("Qwen/Qwen2.5-0.5B")  # a well-formed hub id is left to the hub


@pytest.mark.parametrize("flag,value,message", [
    ("per_device_train_batch_size", 0, "per_device_train_batch_size must be a whole number >= 1, got 0: "
                                       "set --per_device_train_batch_size 1 or more"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be a whole number >= 1"),
    ("learning_rate", -1e-5, "learning_rate must be >= 0, got -1e-05: set --learning_rate to 0 or more"),
    ("save_steps", 0, "save_steps must be >= 1 or unset"),
    ("eval_strategy", "sometimes", "eval_strategy must be 'no', 'steps' or 'epoch'"),
    ("lr_scheduler_type", "cosine_annealing", "unknown lr_scheduler_type 'cosine_annealing': choose from linear"),
    ("lr_scheduler_type", "cosine_with_min_lr", "lr_scheduler_type 'cosine_with_min_lr' with lr_scheduler_kwargs None: "
     "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`; set the kwargs that schedule "
     "takes (transformers' get_scheduler)"),
])
def test_train_config_values(tmp_path, capsys, flag, value, message):
    from posttrain.trainers.dpo import DPOConfig

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DPOConfig(**{flag: value})
    assert _dpo_cli(tmp_path, f"--{flag}={value}") == 2
    assert message in _error(capsys)
