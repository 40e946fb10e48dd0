"""Habits a TRL script relies on (issue 42), on one CPU process: a closed session leaves no ZeRO-3
mode behind, a tied model saves as ``save_pretrained`` does, and LoRA adapters start where TRL's do."""

import os

import pytest
import torch

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.errors import ConfigError


def one_step(s: Session, path) -> tuple[float, torch.Tensor]:
    """Load and prepare ``policy`` (trained) and ``reference`` (frozen), one optimizer step, the reference's logits."""
    policy = s.load("policy", path)
    policy = s.prepare("policy", policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
    reference = s.prepare("reference", s.load("reference", path))
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])
    loss = policy(input_ids=ids, labels=ids).loss
    s.backward("policy", loss)
    s.step("policy")
    with torch.no_grad(), s.activate("reference"):
        logits = reference(input_ids=ids).logits
    return loss.item(), logits


def test_close_leaves_no_zero3_mode_and_a_later_session_runs():
    """After close, from_pretrained builds whole weights (not ZeRO-3's empty (0,) shards), the environment and
    accelerate's state are as before, and a second session in the process trains."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    path = tiny.model_path()
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    shapes = {n: p.shape for n, p in plain.named_parameters()}
    env = dict(os.environ)

    s = Session([Role("policy", "zero3_train", trains=True), Role("reference", "zero3_inference")], micro_batch_size=1)
    assert s.zero_stage("policy") == 3 and s.zero_stage("reference") == 3
    loss, _ = one_step(s, path)
    assert torch.isfinite(torch.tensor(loss))
    assert not s.load_rng  # a causal LM loads without drawing, under zero.Init too: adapters start alike everywhere
    assert is_deepspeed_zero3_enabled()  # the ZeRO-3 policy's plugin is active while the session runs
    s.close()
    s.close()  # a second call does nothing
    assert not is_deepspeed_zero3_enabled()
    assert not dist.is_initialized()
    assert dict(os.environ) == env
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert {n: p.shape for n, p in loaded.named_parameters()} == shapes
    assert all(p.ndim == 2 for n, p in loaded.named_parameters() if n.endswith("proj.weight"))
    with pytest.raises(ConfigError, match="this session is closed"):
        s.load("policy", path)

    s2 = Session([Role("policy", "zero2_train", trains=True), Role("reference", "zero3_inference")],
                 micro_batch_size=1)
    loss2, ref_logits = one_step(s2, path)
    assert not is_deepspeed_zero3_enabled()  # loading the ZeRO-3 reference left the ZeRO-2 policy's plugin active
    assert loss2 == pytest.approx(loss, abs=1e-5)  # the same first step as the ZeRO-3 session's
    with torch.no_grad():
        assert torch.allclose(ref_logits, plain(input_ids=torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])).logits,
                              atol=1e-5)
    s2.close()
    assert not is_deepspeed_zero3_enabled() and dict(os.environ) == env


def safetensors_keys(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_tied_model_saves_as_save_pretrained(tmp_path):
    """A tied model (tie_word_embeddings) saved from a ZeRO-2 policy, a ZeRO-3 trained role and a ZeRO-3 frozen
    role writes the keys transformers' save_pretrained writes (no lm_head.weight) and loads back the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny.model_path()
    tied_path = tmp_path / "tied"
    torch.manual_seed(1)
    tied = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, tie_word_embeddings=True))
    tied.save_pretrained(tied_path)
    expected = safetensors_keys(tied_path)
    assert "lm_head.weight" not in expected and "model.embed_tokens.weight" in expected

    s = Session([Role("zero2", "zero2_train", trains=True), Role("zero3", "zero3_train", trains=True),
                 Role("frozen", "zero3_inference")], micro_batch_size=1)
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])
    for name in ("zero2", "zero3"):
        model = s.load(name, tied_path)
        s.prepare(name, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        s.backward(name, s.engines[name](input_ids=ids, labels=ids).loss)
        s.step(name)  # the saved weights are trained ones, not the file's
    s.prepare("frozen", s.load("frozen", tied_path))
    assert s.zero_stage("zero2") == 2 and s.zero_stage("zero3") == s.zero_stage("frozen") == 3
    for name in ("zero2", "zero3", "frozen"):
        state = {k: v.clone() for k, v in s.state_dict(name).items()}
        s.save_pretrained(name, tmp_path / name)
        assert safetensors_keys(tmp_path / name) == expected, name
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, state[key].to(value.dtype)), (name, key)
    assert not torch.equal(s.state_dict("zero2")["lm_head.weight"], tied.lm_head.weight.detach())
    s.close()


def lora(task: str = "CAUSAL_LM"):
    from peft import LoraConfig

    return LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters (and a classifier's trained copy of its head) by name, off the model or its engine."""
    model = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n or "modules_to_save" in n}


def assert_same_adapters(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    assert any("lora_A" in n for n in theirs) and any("lora_B" in n for n in theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def reward_fn(completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_lora_adapters_start_as_trl_at_the_same_seed(kind, tmp_path):
    """TRL's trainer and posttrain's, both given the model's path and the same peft_config at TRL's default seed:
    every lora_A, lora_B equal. TRL's trainer runs first, so posttrain's session also starts after TRL's state."""
    import trl
    from datasets import Dataset

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    path, tok = str(tiny.model_path()), tiny.load_tokenizer()
    if kind == "sft":
        rows = Dataset.from_dict({"text": ["the cat is on the mat", "my old friend felt fine"] * 4})
        theirs = trl.SFTTrainer(model=path, args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False,
                                                               report_to=[], max_steps=1),
                                train_dataset=rows, processing_class=tok, peft_config=lora())
        ours = SFTTrainer(path, args=SFTConfig(output_dir=str(tmp_path / "ours"), max_steps=1, disable_tqdm=True),
                          train_dataset=rows, processing_class=tok, peft_config=lora())
    else:
        rows = Dataset.from_dict({"prompt": ["the cat is", "my old friend felt"] * 4})
        shape = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1)
        theirs = trl.GRPOTrainer(model=path, reward_funcs=reward_fn, train_dataset=rows, processing_class=tok,
                                 args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False,
                                                     report_to=[], **shape), peft_config=lora())
        ours = GRPOTrainer(path, reward_funcs=reward_fn, train_dataset=rows, processing_class=tok, peft_config=lora(),
                           args=GRPOConfig(output_dir=str(tmp_path / "ours"), disable_tqdm=True, **shape))
    assert theirs.args.seed == ours.cfg.seed == 42
    assert_same_adapters(adapters(ours.session.unwrap("policy")), adapters(theirs.model))
    ours.session.close()


def test_lora_adapters_follow_what_loading_drew(tmp_path):
    """TRL's RewardTrainer: set_seed, the classifier loads (its new head drawn from the generator), the adapters
    after it. prepare_trained continues after the head's draws, whatever was drawn since; and leaves torch's
    generator as it found it."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.setup import prepare_trained

    path, tok = str(tiny.model_path()), tiny.load_tokenizer()
    rows = Dataset.from_dict({"chosen": ["a good day"] * 8, "rejected": ["a bad day"] * 8})
    cfg = trl.RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_steps=1)
    theirs = trl.RewardTrainer(model=path, args=cfg, train_dataset=rows, processing_class=tok, peft_config=lora("SEQ_CLS"))

    s = Session([Role("reward", "zero2_train", trains=True)], micro_batch_size=1)
    torch.manual_seed(cfg.seed)  # a trainer's seed before it loads, as TRL's
    model = s.load("reward", path, model_cls=AutoModelForSequenceClassification, num_labels=1, dtype=torch.float32)
    assert "reward" in s.load_rng  # the new head drew from the generator
    torch.rand(7)  # the run's own draws between loading and the adapters change nothing
    state = torch.get_rng_state()
    prepare_trained(s, "reward", model, cfg, lora("SEQ_CLS"), total_steps=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert_same_adapters(adapters(s.unwrap("reward")), adapters(theirs.model))
    s.close()
