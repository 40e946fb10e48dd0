"""LoRA for GRPO and RLOO (fp32, CPU).

In this process, against TRL 1.16's own GRPOTrainer/RLOOTrainer given the same ``peft_config``
and the same completions: the loss, the logged metrics and every adapter's gradient, with the
reference taken from the base with adapters disabled (beta > 0) on both sides. Then the saved
adapter (PeftModel.from_pretrained) and the merged save (AutoModelForCausalLM) give the trained
model's logits, and the one-process torch path trains as the DeepSpeed engine does.

On two processes (folded into tests/dist/grpo_checks.py, one launch): placement invariance over
the mixes that take a LoRA policy (policy ZeRO-2 or ZeRO-3, reward model replicated or ZeRO-3),
resume equal to the uninterrupted run, and the ZeRO-3 run's merged save against the ZeRO-2
run's adapter.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grpo_parity import TEMPERATURE, G, N, fixed_rollout, sparse_reward, token_reward

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.run.save import save_trained_model
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer, reduce_loss_stats
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

TOL = 1e-5
BETA = {"grpo": 0.04, "rloo": 0.05}
SENTIMENT = "posttrain.demo.synthetic.sentiment_reward"  # the bundled reward, as TRL's scripts name a function


def peft_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def adapters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def trl_trainer(kind: str, tmp: Path):
    """TRL's trainer with the peft_config (so no reference model: its base with adapters disabled
    is the reference at beta > 0), its adapters moved off their zero start so that the policy and
    the reference differ, generating the fixed completions."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLGRPOConfig
    from trl import GRPOTrainer as TRLGRPOTrainer
    from trl import RLOOConfig as TRLRLOOConfig
    from trl import RLOOTrainer as TRLRLOOTrainer

    config_cls, trainer_cls = {"grpo": (TRLGRPOConfig, TRLGRPOTrainer), "rloo": (TRLRLOOConfig, TRLRLOOTrainer)}[kind]
    tok = tiny.load_tokenizer()
    args = config_cls(output_dir=str(tmp / f"trl-{kind}"), use_cpu=True, bf16=False, report_to=[],
                      per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                      temperature=TEMPERATURE, save_strategy="no", reward_weights=[1.0, 0.5], beta=BETA[kind])
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    trainer = trainer_cls(model=model, reward_funcs=[token_reward, sparse_reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok,
                          peft_config=peft_config())
    assert trainer.ref_model is None  # TRL's LoRA reference: the base, adapters disabled
    # TRL's default (gradient checkpointing), enabled as its train() would.
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.activation_checkpointing_kwargs)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.initial_adapters = {n: p.detach().clone() for n, p in adapters(trainer.model).items()}
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, p in adapters(trainer.model).items():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    rows, prompt_ids, completion_ids = fixed_rollout(tok)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    if kind == "grpo":
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, [])
    else:
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, texts)
    return trainer, rows, completion_ids


def our_trainer(kind: str, tmp: Path, trl_adapters: dict, completion_ids, trl_initial: dict | None = None,
                **fields):
    """posttrain's trainer with the same peft_config on the one-process torch path, TRL's adapter
    values copied in (``trl_initial``: TRL's adapters as it initialised them, which ours equal at the
    same seed), its rollout replaced by the fixed completions (prompt 0 for the first group, prompt 1
    for the second)."""
    config_cls, trainer_cls = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[kind]
    tok = tiny.load_tokenizer()
    prompts = ["the cat is", "my old friend felt"]
    cfg = config_cls(output_dir=str(tmp / f"ours-{kind}"), per_device_train_batch_size=2 * G, num_generations=G,
                     max_completion_length=N, temperature=TEMPERATURE, beta=BETA[kind], reward_weights=[1.0, 0.5],
                     generation_backend="hf", max_steps=1, disable_tqdm=True, **fields)
    trainer = trainer_cls(str(tiny.sft_model_path()), reward_funcs=[token_reward, sparse_reward], args=cfg,
                          train_dataset=[{"prompt": p} for p in prompts], peft_config=peft_config())
    assert sorted(trainer.session.roles) == ["policy"]  # no reference role
    policy = trainer.session.unwrap("policy")
    ours = adapters(policy)
    assert set(ours) == set(trl_adapters)
    if trl_initial is not None:  # TRL's set_seed(seed) before its adapters: the same initialisation
        for name, p in ours.items():
            assert torch.equal(p, trl_initial[name]), name
    with torch.no_grad():
        for name, p in ours.items():
            p.copy_(trl_adapters[name])
    ids = torch.full((2 * G, N), tok.pad_token_id)
    mask = torch.zeros((2 * G, N), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    trainer._generation_rows = lambda cycle: [0] * G + [1] * G
    trainer.rollout.generate = lambda p, m: SimpleNamespace(completion_ids=ids, completion_mask=mask)
    return trainer


def trl_results(kind: str, tmp: Path) -> dict:
    """TRL's loss, logged metrics and adapter gradients on the fixed completions (computed before
    posttrain's session exists: both use accelerate's process-wide state)."""
    theirs, rows, completion_ids = trl_trainer(kind, tmp)
    theirs._metrics["train"].clear()
    batch = theirs._generate_and_score_completions([dict(r) for r in rows])
    theirs.model.zero_grad()
    loss = theirs._compute_loss(theirs.model, batch)
    loss.backward()
    params = adapters(theirs.model)
    return {"loss": loss.item(), "metrics": {k: v[-1] for k, v in theirs._metrics["train"].items()},
            "adapters": {n: p.detach().clone() for n, p in params.items()}, "initial": theirs.initial_adapters,
            "grads": {n: p.grad.clone() for n, p in params.items()}, "completion_ids": completion_ids}


@pytest.fixture(scope="module", params=["grpo", "rloo"])
def pair(request, tmp_path_factory):
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"lora-{kind}")
    theirs = trl_results(kind, tmp)
    from accelerate.state import AcceleratorState

    # TRL's trainer made accelerate's process-wide state without a process group; the session's
    # one-process DeepSpeed state needs one, so it starts from scratch.
    AcceleratorState._reset_state(reset_partial_state=True)
    ours = our_trainer(kind, tmp, theirs["adapters"], theirs["completion_ids"], theirs["initial"],
                       single_process_engine="torch")
    return kind, theirs, ours, tmp


def test_loss_metrics_and_adapter_gradients_equal_trl(pair):
    kind, theirs, ours, _ = pair
    micro, generation = ours.generate_and_score(0)
    policy = ours.session.unwrap("policy")
    policy.zero_grad()
    loss, stats = ours.compute_loss(micro[0])
    (loss * ours.backward_scale()).backward()
    our_metrics = {**generation, **reduce_loss_stats([stats])}

    their_metrics = theirs["metrics"]
    assert loss.item() == pytest.approx(theirs["loss"], abs=TOL, rel=TOL)
    assert their_metrics["kl"] > 1e-3  # the adapters moved the policy off its base, the reference
    compared = [k for k in their_metrics if k != "num_tokens"]
    assert {"kl", "entropy", "reward", "clip_ratio/region_mean", "rewards/token_reward/mean"} <= set(compared)
    for k in compared:
        assert our_metrics[k] == pytest.approx(their_metrics[k], abs=TOL), k
    our_grads = adapters(policy)
    assert any("lora_A" in n and g.abs().max() > 0 for n, g in theirs["grads"].items())
    # Within 1e-5 of the gradient's scale (RLOO's sequence sums make gradients of order 10: fp32 sums).
    scale = max(1.0, max(g.abs().max().item() for g in theirs["grads"].values()))
    for name, g in theirs["grads"].items():
        assert (our_grads[name].grad - g).abs().max().item() <= TOL * scale, (name, (our_grads[name].grad - g).abs().max())
    # Only the adapters train: the optimizer holds them and nothing else.
    params = [q for group in ours.session.optimizers["policy"].param_groups for q in group["params"]]
    assert {id(q) for q in params} == {id(q) for q in our_grads.values()}


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_saved_adapter_and_merged_model_give_the_trained_logits(pair):
    """The final save in PEFT format at the top of the output dir (PeftModel.from_pretrained loads
    it), and merge_adapters' plain transformers model; the live model is untouched by the merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    kind, _, ours, tmp = pair
    s = ours.session
    policy = s.unwrap("policy").eval()
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    trained = logits(policy, ids)
    out = ours.save_model()
    assert out == Path(ours.cfg.output_dir)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    assert torch.allclose(logits(loaded, ids), trained, atol=TOL)

    merged_dir = tmp / f"merged-{kind}"
    save_trained_model(s, "policy", merged_dir, ours.tokenizer, merge_adapters=True)
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(logits(merged, ids), trained, atol=TOL)
    assert torch.equal(logits(policy, ids), trained)  # the merge wrote new tensors
    policy.train()


def test_the_torch_path_trains_as_the_deepspeed_engine(tmp_path):
    """One process: the same two LoRA steps (loss, KL, gradient norm) on the torch path
    (posttrain.placement.plain) and through a DeepSpeed ZeRO-2 engine."""
    from peft import LoraConfig

    rows = {}
    for engine in ("torch", "deepspeed"):
        cfg = GRPOConfig(output_dir=str(tmp_path / engine), beta=0.04, learning_rate=1e-2, per_device_train_batch_size=8,
                         num_generations=4, max_completion_length=6, steps_per_generation=2, max_steps=2,
                         logging_steps=1, save_strategy="no", generation_backend="hf", disable_tqdm=True,
                         single_process_engine=engine)
        trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=SENTIMENT, args=cfg,
                              train_dataset=bundled_prompts(16),
                              peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))
        assert trainer.session.engine_kind("policy") == engine
        trainer.train()
        trainer.end()
        rows[engine] = trainer.state.log_history
    for a, b in zip(rows["torch"], rows["deepspeed"]):
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], abs=TOL, rel=TOL), k
    assert rows["torch"][1]["kl"] > 0


def test_an_adapter_on_the_lm_head_is_refused_before_anything_loads(tmp_path):
    from peft import LoraConfig

    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(ConfigError, match="drop lm_head from --lora_target_modules"):
        GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=SENTIMENT, args=cfg, train_dataset=bundled_prompts(16),
                    peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "lm_head"]))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="sync_ref_model needs a reference model of its own"):
        GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=SENTIMENT, train_dataset=bundled_prompts(16),
                    args=GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                                    beta=0.1, sync_ref_model=True), peft_config=peft_config())


def test_the_rollout_engine_samples_the_adapted_policy(tmp_path):
    """GRPO with adapters through posttrain's engine (KV slots capped below the generation batch,
    so sequences stream through) logs what transformers' ``generate`` does: the same samples from
    the adapted policy, so the same rewards, KL and loss, with no fallback counted. The adapters
    train fast enough here that the base's samples would differ by step 2."""
    rows = {}
    for backend, slots in (("posttrain", 3), ("hf", None)):
        cfg = GRPOConfig(output_dir=str(tmp_path / backend), beta=0.04, learning_rate=5e-2,
                         per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_steps=2,
                         logging_steps=1, save_strategy="no", generation_backend=backend, generation_kv_slots=slots,
                         disable_tqdm=True)
        trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=SENTIMENT, args=cfg,
                              train_dataset=bundled_prompts(16), peft_config=peft_config())
        trainer.train()
        trainer.end()
        rows[backend] = trainer.state.log_history
    for a, b in zip(rows["posttrain"], rows["hf"]):
        for k in ("reward", "kl", "loss", "completions/mean_length"):
            assert a[k] == pytest.approx(b[k], abs=TOL, rel=TOL), k
    for row in rows["posttrain"]:
        assert row["rollout/backend_fallback"] == 0 and row["rollout/adapter_fallbacks"] == 0, row
    with pytest.raises(ConfigError, match="--generation_kv_slots"):
        GRPOConfig(output_dir=str(tmp_path / "bad"), generation_kv_slots=0)


@pytest.mark.parametrize("kind,fields,sentence", [
    ("rloo", {"sync_ref_model": True},
     "sync_ref_model needs a reference model of its own, and a LoRA run (peft_config) has none (the reference is the "
     "base with adapters disabled): drop sync_ref_model, or train without LoRA"),
    ("grpo", {"beta": 0.04, "role_configs": {"reference": "zero3_inference"}},
     "a LoRA run (peft_config) has no reference role (the reference is the policy's base with adapters disabled), "
     "so role_configs' 'reference' entry places nothing: drop it from role_configs"),
])
def test_what_a_lora_reference_cannot_do_is_one_sentence(tmp_path, monkeypatch, kind, fields, sentence):
    from posttrain.placement import session

    monkeypatch.setattr(session.Session, "__init__", lambda *a, **k: 1 / 0)  # refused before any session
    config_cls, trainer_cls = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[kind]
    cfg = config_cls(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, **fields)
    with pytest.raises(ConfigError) as err:
        trainer_cls(str(tiny.sft_model_path()), SENTIMENT, args=cfg, train_dataset=bundled_prompts(16),
                    peft_config=peft_config())
    assert str(err.value) == sentence
