"""PPO's math against small cases computed by hand."""

import math

import pytest
import torch

from posttrain.trainers.ppo import (
    first_true_indices,
    gae,
    kl_penalty,
    masked_whiten,
    policy_loss,
    truncate_response,
    value_loss,
)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    gamma, lam = 0.9, 0.8
    # deltas: t2 = 1 - 0.4 = 0.6; t1 = 0 + 0.9*0.4 - 0.2 = 0.16; t0 = 0 + 0.9*0.2 - 0.5 = -0.32
    a2 = 0.6
    a1 = 0.16 + 0.72 * a2
    a0 = -0.32 + 0.72 * a1
    adv, ret = gae(rewards, values, gamma, lam)
    assert adv.tolist()[0] == pytest.approx([a0, a1, a2], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4], abs=1e-6)


def test_gae_gamma_one_lam_one_is_return_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    adv, ret = gae(rewards, values, 1.0, 1.0)
    assert ret.tolist()[0] == pytest.approx([6.0, 5.0, 3.0])


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    # mean 2, unbiased variance 1 over the three valid entries
    w = masked_whiten(x, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-4)
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert w2[0, :3].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-4)


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # k1 = log p - log q = log 2; k3 = (q/p - 1) - log(q/p) = -0.5 + log 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))


def test_policy_clipping_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(new, old, adv, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped); token 2: -2.2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)


def test_value_clipping_by_hand():
    vpred = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    ret = torch.tensor([[0.0, 1.0]])
    mask = torch.tensor([[True, True]])
    loss, clipfrac = value_loss(vpred, old, ret, mask, cliprange_value=0.2)
    # token 0: vclip = 0.7 -> max(1.0, 0.49) = 1.0; token 1: vclip = 0 -> max(1, 1) = 1
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    assert clipfrac.item() == 0.0
    vpred = torch.tensor([[0.0, 0.0]])  # clipped up to 0.3 on token 0: (0.3)^2 > 0
    loss, clipfrac = value_loss(vpred, old, ret, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


def test_truncation_and_lengths():
    pad, eos = 0, 1
    responses = torch.tensor([[5, 6, 1, 7, 8], [5, 6, 7, 8, 9]])
    post = truncate_response(eos, pad, responses)
    assert post.tolist() == [[5, 6, 1, 0, 0], [5, 6, 7, 8, 9]]
    assert (first_true_indices(post == pad) - 1).tolist() == [2, 4]


def test_entropy_metric_counts_only_response_tokens():
    from posttrain.trainers.ppo import INVALID_LOGPROB, rollout_metrics

    # Row 0: 2 response tokens then 2 padded positions; row 1: 4 tokens.
    logprobs = torch.tensor([[-1.0, -2.0, INVALID_LOGPROB, INVALID_LOGPROB], [-0.5, -0.5, -0.5, -0.5]])
    padding = torch.tensor([[False, False, True, True], [False, False, False, False]])
    zeros = torch.zeros(2, 4)
    batch = dict(logprobs=logprobs, padding_mask=padding, kl=zeros, non_score_reward=zeros, scores=torch.zeros(2),
                 responses=torch.zeros(2, 4, dtype=torch.long))
    # (3 + 2) / 2; unmasked it would be (3 - 2 + 2) / 2, lower by the mean padded positions per row.
    assert rollout_metrics(batch, eos_token_id=1)["objective/entropy"] == pytest.approx(2.5)
