"""One process without a DeepSpeed engine (posttrain.plain, single_process_engine): the same
numbers as the DeepSpeed ZeRO-2 path in fp32 (DPO and GRPO, gradient accumulation, clipping),
resume equal to an uninterrupted run, the record, and the setting's refusals."""

import pytest
from conftest import run_json

from posttrain import plain
from posttrain.dsconfig import ConfigError
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return run_json("plain_run.py", str(tmp), tmp_path=tmp, nproc=1)


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_torch_path_equals_deepspeed_zero2_in_fp32(runs, trainer):
    res = runs[trainer]
    assert res["kinds"] == ["torch", "deepspeed"]
    (ours, theirs), (our_norms, their_norms) = res["losses"], res["grad_norms"]
    assert len(ours) == len(theirs) >= 2 and len(our_norms) == len(ours)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < TOL
    assert max(abs(a - b) for a, b in zip(our_norms, their_norms)) < TOL
    assert min(our_norms) > 0.05 * 2  # max_grad_norm 0.05: clipping acted on every step
    assert res["weights_max_diff"] < TOL and res["weights_moved"] > 100 * TOL  # trained, and identically


def test_torch_path_resumes_exactly_and_is_recorded(runs):
    assert len(runs["resume"]["full"]) == 2 and runs["resume"]["resumed"] == runs["resume"]["full"]
    assert runs["card_says_torch"]


def test_resuming_across_engines_is_refused(runs):
    assert "resume on one process with single_process_engine torch" in runs["cross"]["deepspeed"]
    assert "resume with single_process_engine deepspeed" in runs["cross"]["torch"]


def test_which_roles_take_the_torch_path():
    one = dict(world_size=1, trains=True, from_mix=True)
    assert plain.uses_torch("auto", master_weights="bf16", **one)
    assert not plain.uses_torch("auto", master_weights="fp32", **one)  # DeepSpeed's bf16-weight forward kept
    assert plain.uses_torch("torch", master_weights="fp32", **one)
    assert not plain.uses_torch("deepspeed", master_weights="bf16", **one)
    assert not plain.uses_torch("auto", master_weights="bf16", **{**one, "world_size": 2})
    assert not plain.uses_torch("torch", master_weights="bf16", **{**one, "trains": False})
    assert not plain.uses_torch("auto", master_weights="bf16", **{**one, "from_mix": False})


@pytest.mark.parametrize("kwargs, match", [
    (dict(setting="fast"), "single_process_engine must be one of auto, deepspeed, torch"),
    (dict(world_size=2), "torch runs one process only, and this run has 2: set single_process_engine auto or deepspeed"),
    (dict(mixed_precision="fp16"), "no fp16 loss scaling: use --bf16 true"),
    (dict(own_configs=["policy"]), r"'policy' has a config of its own \(role_configs, or the zero2-zero3-stock mix"),
])
def test_setting_refusals(kwargs, match):
    args = {"setting": "torch", "world_size": 1, "mixed_precision": "bf16", "own_configs": [], **kwargs}
    with pytest.raises(ConfigError, match=match):
        plain.check_setting(args.pop("setting"), **args)


def test_trainer_refuses_before_loading(tmp_path):
    cfg = DPOConfig(output_dir=str(tmp_path / "out"), single_process_engine="torch",
                    role_configs={"policy": "zero2_train"})
    with pytest.raises(ConfigError, match="has a config of its own"):
        DPOTrainer(cfg, train_dataset=[{"prompt": "a", "chosen": " b", "rejected": " c"}] * 8)
    assert not (tmp_path / "out").exists()  # refused before the output dir was made
