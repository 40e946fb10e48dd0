"""LoRA for PPO and distillation: the distilled student against TRL's GKDTrainer with the same
peft_config, PPO's reference as the policy's base with adapters disabled against a separate copy
of the base, the refusals, and (two CPU processes, one launch) placement invariance and resume."""

import os

import pytest
import torch
from conftest import together_json
from trl import ModelConfig, get_peft_config

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.scripts.data import bundled_prompts

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# TRL's default LoRA dropout (0.05) stays on: both sides must switch it off (GKD's and PPO's disable_dropout).
PEFT = get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["all-linear"]))
FP32_ONE_PROCESS = dict(single_process_engine="torch", mixed_precision="no", disable_tqdm=True)
TEACHER = tiny.model_path("causal", seed=1, hidden_size=96, intermediate_size=256, initializer_range=0.2)


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def perturb_adapters(model: torch.nn.Module, seed: int) -> None:
    """peft starts lora_B at zero (the adapted model equals its base, lora_A gets no gradient):
    random values make the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def grad_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in adapters(model).items()}


def assert_grads_close(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    assert any(g.abs().max() > 1e-4 for g in ours.values())  # lora_A and lora_B both get gradients
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-5, msg=name)


def distill_rows(n: int = 8) -> list[dict[str, str]]:
    lines = tiny.corpus()[:n]
    return [{"prompt": " ".join(w[:2]), "completion": " " + " ".join(w[2:])} for w in (x.split() for x in lines)]


# -- distillation against TRL's GKDTrainer ---------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_distill_lora_loss_and_adapter_gradients_equal_trl_gkd(tmp_path, beta):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer, completion_batch

    cfg = DistillationConfig(output_dir=str(tmp_path / "ours"), beta=beta, per_device_train_batch_size=4, lmbda=0.0,
                             disable_dropout=True, gradient_checkpointing=False, **FP32_ONE_PROCESS)
    ours = DistillationTrainer(str(tiny.model_path()), str(TEACHER), args=cfg, train_dataset=distill_rows(),
                               peft_config=PEFT)
    student = ours.session.unwrap("student")
    assert student.training and hasattr(student, "peft_config")
    perturb_adapters(student, seed=3)
    prompts, completions = ours._encode(distill_rows()[:4])
    batch = completion_batch(prompts, completions, ours.tokenizer.pad_token_id, ours.session.device)
    student_logits, teacher_logits = ours.logits(batch)
    from posttrain.trainers.distill import generalized_jsd_loss

    loss = generalized_jsd_loss(student_logits, teacher_logits, batch["labels"][:, 1:], beta=beta)
    ours.session.backward("student", loss)
    our_grads = grad_of(student)

    # TRL: the same base, the same peft_config through its own trainer, the same adapter values.
    args = GKDConfig(output_dir=str(tmp_path / "trl"), beta=beta, report_to="none", use_cpu=True, bf16=False,
                     gradient_checkpointing=False, per_device_train_batch_size=4)
    trl = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(ours.student_path, dtype=torch.float32),
                     teacher_model=AutoModelForCausalLM.from_pretrained(str(TEACHER), dtype=torch.float32),
                     args=args, train_dataset=Dataset.from_list([{"messages": []}] * 4),
                     processing_class=ours.tokenizer, peft_config=PEFT)
    trl.model.load_state_dict({n: p.detach() for n, p in adapters(student).items()}, strict=False)
    trl.model.train()
    trl_loss = trl.compute_loss(trl.model, dict(batch))
    trl_loss.backward()
    assert loss.item() > 0.01
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    assert_grads_close(our_grads, grad_of(trl.model))


def test_distill_teacher_keeps_its_role(tmp_path):
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    t = DistillationTrainer(str(tiny.model_path()), str(TEACHER), train_dataset=distill_rows(), peft_config=PEFT,
                            args=DistillationConfig(output_dir=str(tmp_path / "run"), lmbda=0.0, **FP32_ONE_PROCESS))
    assert sorted(t.session.engines) == ["student", "teacher"]
    trainable = [n for n, p in t.session.unwrap("student").named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(p.requires_grad for p in t.session.unwrap("teacher").parameters())


# -- PPO: the reference is the policy's base with its adapters disabled ------------------------------
PPO_ONE_UPDATE = dict(per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1, response_length=8,
                      temperature=0.7, stop_token="eos", local_rollout_forward_batch_size=8, total_episodes=8,
                      max_grad_norm=1e6, learning_rate=1e-3, num_sample_generations=0)


def test_ppo_lora_loss_and_adapter_gradients_equal_a_separate_base_reference(tmp_path):
    """One rollout and one update of posttrain's LoRA PPO, against the same computation with the
    reference a separate copy of the base model (the full fine-tune's reference), and the policy an
    independent peft model with the same adapter values: reference log-probs, advantages, the
    policy loss the update logged and the adapter gradients its optimizer stepped, within 1e-5."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from posttrain.trainers.ppo import (
        INVALID_LOGPROB,
        PPOConfig,
        PPOTrainer,
        first_true_indices,
        lm_logprobs,
        policy_loss,
        truncate_response,
    )

    cfg = PPOConfig(output_dir=str(tmp_path / "run"), **PPO_ONE_UPDATE, **FP32_ONE_PROCESS)
    t = PPOTrainer(args=cfg, model=str(tiny.sft_model_path()), reward_model=str(tiny.reward_model_path()),
                   train_dataset=bundled_prompts(2048), peft_config=PEFT)  # `posttrain ppo`'s prompts
    s, pad = t.session, t.tokenizer.pad_token_id
    assert sorted(s.engines) == ["policy", "reward", "value"]  # no reference role
    policy = s.unwrap("policy")
    perturb_adapters(policy, seed=5)
    queries = t._queries(list(range(8)))
    ctx = queries.shape[1]
    batch = t.rollout(queries)
    qr, valid = batch["query_responses"], ~batch["padding_mask"]
    # The adapters matter: the policy's log-probs are not the reference's.
    assert ((batch["logprobs"] - batch["ref_logprobs"]).abs() * valid).max() > 1e-3

    path = str(tiny.sft_model_path())
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = lm_logprobs(base, qr, ctx, pad, cfg.temperature)[0]
    torch.testing.assert_close(batch["ref_logprobs"], torch.masked_fill(ref, ~valid, INVALID_LOGPROB),
                               rtol=1e-5, atol=1e-5)
    post = truncate_response(t.stop_token_id, pad, batch["responses"])
    separate = t.advantages(batch["responses"], post, batch["logprobs"], ref, batch["values"], batch["scores"],
                            first_true_indices(post == pad) - 1)
    for key in ("kl", "advantages", "returns"):
        torch.testing.assert_close(batch[key], separate[key], rtol=1e-5, atol=1e-5, msg=key)

    # The update: the loss it logs and the adapter gradients its optimizer is given.
    stepped = {}
    s.optimizers["policy"].register_step_pre_hook(lambda *_: stepped.update(grad_of(policy)))
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), PEFT)
    theirs.load_state_dict({n: p.detach().clone() for n, p in adapters(policy).items()}, strict=False)
    logged = t.train_on(batch, update=1)["loss/policy_avg"]
    for m in theirs.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    new = torch.masked_fill(lm_logprobs(theirs.train(), qr, ctx, pad, cfg.temperature)[0], ~valid, INVALID_LOGPROB)
    loss, _ = policy_loss(new, batch["logprobs"], separate["advantages"], valid, cfg.cliprange)
    loss.backward()
    # On fresh rollouts the ratio is 1 and whitened advantages average 0, so the loss is ~0; its
    # gradient is not.
    assert logged == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert_grads_close(stepped, grad_of(theirs))


def test_ppo_lora_refuses_a_reference_model():
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer

    with pytest.raises(ConfigError, match="with peft_config the reference is the policy's base model .* drop "
                                          "ref_model="):
        PPOTrainer(PPOConfig(), model="some/model", ref_model="some/model", peft_config=PEFT)


# -- two processes, one launch: placement invariance and resume --------------------------------------
@pytest.fixture(scope="module")
def runs(launched_together):
    return together_json(launched_together, "test_lora_ppo_distill")  # tests/dist/lora_ppo_distill.py


def test_placement_of_the_lora_roles(runs):
    # No reference role: the reference is the policy's base. ZeRO-3 shards the frozen base under the adapters.
    assert runs["ppo_engines"] == {"zero2-zero3": {"policy": 2, "value": 2, "reward": 3},
                                   "zero3": {"policy": 3, "value": 3, "reward": 3}}
    assert runs["distill_engines"] == {"zero2-zero3": {"student": 2, "teacher": 3}, "zero3": {"student": 3, "teacher": 3}}
    for files in (runs["ppo_files"], runs["distill_files"]):  # adapters in PEFT format, not a full model
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files) and "model.safetensors" not in files


def test_lora_placement_invariance(runs):
    ppo, distill = runs["ppo"], runs["distill"]
    assert len(ppo["zero2-zero3"]) == 2 and ppo["zero2-zero3"][1]["objective/kl"] > 1e-3  # the adapters moved
    for a, b in zip(ppo["zero2-zero3"], ppo["zero3"]):
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-4), key
    assert len(distill["zero2-zero3"]) == 4
    assert distill["zero3"] == pytest.approx(distill["zero2-zero3"], abs=1e-4)


def test_lora_resume_equals_the_uninterrupted_run(runs):
    ppo, distill = runs["ppo"], runs["distill"]
    assert len(ppo["resumed"]) == 1
    for key, value in ppo["zero2-zero3"][1].items():
        assert ppo["resumed"][0][key] == pytest.approx(value, abs=1e-5), key
    assert distill["resumed"] == pytest.approx(distill["zero2-zero3"][2:], abs=1e-5)


def test_scripts_take_the_lora_flags(capsys):
    from posttrain import cli
    from posttrain.scripts.args import demo_config, model_arguments, parse_config
    from posttrain.scripts.distill import TeacherArguments
    from posttrain.scripts.ppo import PPOScriptArguments, saved_as
    from posttrain.trainers.distill import DistillationConfig
    from posttrain.trainers.ppo import PPOConfig

    flags = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"]
    for name, classes in (("ppo", (PPOConfig, ModelConfig, PPOScriptArguments)),
                          ("distill", (DistillationConfig, ModelConfig, TeacherArguments))):
        cfg, model_args = parse_config(classes, demo_config(name), flags, prog=f"posttrain {name}")[:2]
        _, peft = model_arguments(model_args, cfg, tiny.model_path)
        assert (peft.r, peft.lora_alpha, peft.target_modules) == (8, 16, "all-linear")
        assert "PeftModel.from_pretrained" in saved_as(peft, cfg.merge_adapters)
    assert cli.main(["ppo", *flags, "--ref_model_name_or_path", "some/model"]) == 2
    assert "drop --ref_model_name_or_path" in capsys.readouterr().err
