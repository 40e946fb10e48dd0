"""One process without a DeepSpeed engine (posttrain.placement.plain, single_process_engine): the same
numbers as the DeepSpeed ZeRO-2 path in fp32 (DPO and GRPO, gradient accumulation, clipping),
resume equal to an uninterrupted run, the record, which roles auto puts on it (the Session's rule
and the planner's), and the setting's refusals."""

import pytest
from conftest import run_json

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.placement import plain
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return run_json("plain_run.py", str(tmp), tmp_path=tmp, nproc=1)


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_torch_path_equals_deepspeed_zero2_in_fp32(runs, trainer):
    res = runs[trainer]
    assert res["kinds"] == ["torch", "deepspeed"]  # DPO's torch and GRPO's DeepSpeed run are auto's choice
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
    one = dict(world_size=1, trains=True, from_mix=True, decoded=False, mixed_precision="bf16")
    assert plain.uses_torch("auto", master_weights="bf16", **one)
    assert plain.uses_torch("auto", master_weights="fp32", **one)  # no rollouts: 1.34x DeepSpeed's step on one H200
    assert not plain.uses_torch("auto", master_weights="fp32", **{**one, "decoded": True})  # rollouts: bf16 weights
    assert plain.uses_torch("auto", master_weights="bf16", **{**one, "decoded": True})
    assert not plain.uses_torch("auto", master_weights="fp32", **{**one, "mixed_precision": "fp16"})  # loss scaling
    assert plain.uses_torch("auto", master_weights="fp32", **{**one, "mixed_precision": "no"})
    assert plain.uses_torch("torch", master_weights="fp32", **{**one, "decoded": True})
    assert not plain.uses_torch("deepspeed", master_weights="bf16", **one)
    assert not plain.uses_torch("auto", master_weights="bf16", **{**one, "world_size": 2})
    assert not plain.uses_torch("torch", master_weights="bf16", **{**one, "trains": False})
    assert not plain.uses_torch("auto", master_weights="bf16", **{**one, "from_mix": False})


@pytest.mark.parametrize("master_weights", ["fp32", "bf16"])
def test_auto_follows_each_trainers_declared_roles_and_the_planner_agrees(master_weights):
    """What the Session runs (plain.torch_roles on roles_for of the trainer's ``roles``, as
    make_session builds them) and what ``posttrain plan`` counts, at one process under auto: the
    torch path for DPO, SFT, reward and distillation at either precision; DeepSpeed for GRPO, RLOO
    and PPO with fp32 master weights (their rollouts decode the policy), torch with bf16 ones."""
    from posttrain.placement.roles import roles_for
    from posttrain.planner import memory
    from posttrain.trainers.distill import DistillationTrainer
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.reward import RewardTrainer
    from posttrain.trainers.rloo import RLOOTrainer
    from posttrain.trainers.sft import SFTTrainer

    decodes = {GRPOTrainer, RLOOTrainer, PPOTrainer}
    for trainer in (DPOTrainer, SFTTrainer, RewardTrainer, DistillationTrainer, GRPOTrainer, RLOOTrainer, PPOTrainer):
        spec = trainer.roles
        roles = roles_for(spec["trained"], spec["frozen"], master_weights=master_weights,
                          decoded=spec.get("decoded", ()))
        ran = plain.torch_roles(roles, "auto", world_size=1, mixed_precision="bf16")
        expected = set() if trainer in decodes and master_weights == "fp32" else set(spec["trained"])
        assert ran == expected, trainer.name
        planned = memory.plan(trainer.name, "1b", "zero2-zero3", world_size=1, micro_batch=1, seq_len=64,
                              master_weights=master_weights)
        assert {r.name for r in planned.roles if r.place.engine == "torch"} == expected, trainer.name
        two = roles_for(spec["trained"], spec["frozen"], master_weights=master_weights)
        assert not plain.torch_roles(two, "auto", world_size=2, mixed_precision="bf16")
    # Distillation decodes its student only on-policy (lmbda > 0): then it keeps DeepSpeed for fp32.
    on_policy = roles_for(["student"], ["teacher"], master_weights=master_weights, decoded=["student"])
    assert plain.torch_roles(on_policy, "auto", world_size=1, mixed_precision="bf16") == (
        set() if master_weights == "fp32" else {"student"})


def test_decoded_names_a_trained_role():
    from posttrain.placement.roles import roles_for

    with pytest.raises(ConfigError, match=r"decoded role\(s\) \['teacher'\] are not trained roles"):
        roles_for(["student"], ["teacher"], decoded=["teacher"])


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
    cfg = DPOConfig(output_dir=str(tmp_path / "out"), single_process_engine="torch", role_configs={"policy": "zero2_train"})
    with pytest.raises(ConfigError, match="has a config of its own"):
        DPOTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=[{"prompt": "a", "chosen": " b", "rejected": " c"}] * 8)
    assert not (tmp_path / "out").exists()  # refused before the output dir was made


@pytest.mark.parametrize("mixed_precision, frozen", [("bf16", "torch.bfloat16"), ("no", "torch.float32")])
def test_parameters_outside_the_optimizer_keep_no_master_weights(mixed_precision, frozen):
    """fp32 master weights on the torch path: the parameters the optimizer updates in fp32, the others
    (a LoRA base) in bf16 under bf16 mixed precision, as DeepSpeed's engine holds them; buffers stay fp32."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    model.register_buffer("scale", torch.ones(2))
    opt = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    engine = plain.PlainEngine(model, opt, device=torch.device("cpu"), gradient_accumulation_steps=1,
                               gradient_clipping=1.0, mixed_precision=mixed_precision, master_weights="fp32")
    assert {str(p.dtype) for p in model[1].parameters()} == {"torch.float32"}
    assert {str(p.dtype) for p in model[0].parameters()} == {frozen}
    assert model.scale.dtype == torch.float32
    loss = engine(torch.randn(3, 4)).float().sum()
    engine.backward(loss)
    engine.step()
    assert engine.get_global_grad_norm() > 0 and all(p.grad is None for p in model[0].parameters())


def test_distillation_keeps_deepspeed_for_fp32_only_when_it_decodes_its_student(tmp_path):
    """DistillationTrainer passes its student as decoded when it generates on-policy (lmbda > 0)."""
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    kinds = {}
    for lmbda in (0.0, 0.5):
        trainer = DistillationTrainer(str(tiny.model_path()), str(tiny.model_path(seed=1)),
                                      args=DistillationConfig(output_dir=str(tmp_path / str(lmbda)), lmbda=lmbda,
                                                              disable_tqdm=True),
                                      train_dataset=[{"prompt": "the cat", "completion": " is calm ."}] * 4)
        kinds[lmbda] = trainer.session.engine_kind("student")
    assert kinds == {0.0: "torch", 0.5: "deepspeed"}
