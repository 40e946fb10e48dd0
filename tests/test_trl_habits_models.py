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
