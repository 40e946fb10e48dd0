"""GRPO's entropy bonus in a training run (TRL's parity is in tests/test_grpo_parity.py): the adaptive coefficient
moves once per optimizer step from the entropy of all its micro-batches, is logged with the policy loss, and a run
resumed from a checkpoint continues with the coefficient it had."""

import pytest
import torch

from posttrain.demo import tiny
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

G = 4


def reward(completion_ids, **_):
    return [float(sum(c) % 7) for c in completion_ids]


def run(tmp, **extra):
    cfg = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=G, gradient_accumulation_steps=2,
                     num_generations=G, max_completion_length=8, max_steps=4, logging_steps=1, save_strategy="steps",
                     save_steps=2, seed=5, entropy_coef=0.02, use_adaptive_entropy=True, entropy_target=50.0,
                     entropy_coef_delta=0.01, **extra)
    t = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=reward, args=cfg, train_dataset=bundled_prompts(32))
    t.train()
    t.end()
    return [r for r in t.state.log_history if "loss" in r], [p.detach().clone() for p in
                                                              t.session.unwrap("policy").parameters()]


def test_adaptive_bonus_steps_logs_and_resumes(tmp_path):
    """entropy_target 50 nats is above any entropy here, so the coefficient rises by entropy_coef_delta at each of the
    4 steps (two micro-batches each: one update per step, not per micro-batch); each row logs it and TRL's
    policy_loss; resumed from checkpoint-2, steps 3-4 log the uninterrupted run's loss and coefficient and end at its
    weights."""
    rows, weights = run(tmp_path / "a")
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.03, 0.04, 0.05, 0.06])
    assert all("policy_loss" in r for r in rows)
    assert all(r["loss"] != pytest.approx(r["policy_loss"], abs=1e-9) for r in rows[1:])  # the bonus applies
    resumed, again = run(tmp_path / "a", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    keys = ("loss", "policy_loss", "entropy_coef", "entropy")
    assert [r[k] for r in resumed[2:] for k in keys] == pytest.approx([r[k] for r in rows[2:] for k in keys],
                                                                      rel=1e-6, abs=1e-9)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(weights, again))
