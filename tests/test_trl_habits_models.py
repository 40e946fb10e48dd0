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

