"""RLOO against TRL 1.16's own RLOOTrainer, in this process (fp32, CPU, no DeepSpeed): the
leave-one-out advantages with the KL folded into the reward, normalize_advantages and
reward_clip_range; the loss, its logged metrics and its gradient on identical inputs."""

import pytest
import torch
from test_grpo_parity import (
    TEMPERATURE,
    TOL,
    G,
    N,
    assert_gradients_close,
    fixed_rollout,
    sparse_reward,
    token_reward,
)

from posttrain.demo import tiny
from posttrain.models.setup import enable_gradient_checkpointing
from posttrain.rewards import functions as reward_funcs
from posttrain.trainers.grpo import completion_logps, reduce_loss_stats
from posttrain.trainers.rloo import RLOOConfig, rloo_advantages, rloo_loss


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    policy = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32).train()
    enable_gradient_checkpointing(policy)  # RLOOConfig's default, as TRL's (the trl fixture enables it too)
    add_fused_lm_head(policy, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))  # as RLOOTrainer's policy
    reference = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1), dtype=torch.float32).eval()
    return policy, reference


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    """TRL's RLOOTrainer on the tiny default, built once at beta 0 (no reference built from the
    policy's path); the cases set beta and give it the reference TRL would have loaded."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig as TRLConfig
    from trl import RLOOTrainer as TRLTrainer
    from trl.trainer.utils import add_fused_lm_head

    tok = tiny.load_tokenizer()
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl_rloo")), use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     temperature=TEMPERATURE, save_strategy="no", reward_weights=[1.0, 0.5], beta=0.0)
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    trainer = TRLTrainer(model=model, reward_funcs=[token_reward, sparse_reward], args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
    reference = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1), dtype=torch.float32).eval()
    add_fused_lm_head(reference, temperature=TEMPERATURE)  # what TRL's __init__ does to its reference
    trainer.ref_model = reference
    # TRL's default (gradient_checkpointing=True), enabled as its train() would; the policy fixture matches it.
    assert trainer.args.activation_checkpointing
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=trainer.args.activation_checkpointing_kwargs)
    trainer.model.train()
    rows, prompt_ids, completion_ids = fixed_rollout(tok)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, texts)
    return trainer, rows, completion_ids


@pytest.mark.parametrize("beta,normalize,clip", [(0.05, False, None), (0.05, True, [-1.0, 2.0]), (0.0, False, None)])
def test_advantages_equal_trl(trl, models, beta, normalize, clip):
    trainer, rows, completion_ids = trl
    trainer.beta, trainer.normalize_advantages, trainer.reward_clip_range = beta, normalize, clip
    trainer._metrics["train"].clear()
    out = trainer._generate_and_score_completions([dict(r) for r in rows])

    policy, reference = models
    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], mask], 1)
    with torch.no_grad():
        old, _ = completion_logps(policy, ids, attention, mask.shape[1], TEMPERATURE)
        ref, _ = completion_logps(reference, ids, attention, mask.shape[1], TEMPERATURE)
    assert torch.allclose((old * mask).sum(1), out["old_logps"], atol=TOL)
    per_func = reward_funcs.call_reward_funcs([token_reward, sparse_reward], [r["prompt"] for r in rows],
                                         [""] * len(rows), completion_ids)
    kl = ((old - ref) * mask).sum(-1)
    ours = rloo_advantages(per_func, torch.tensor([1.0, 0.5]), G, kl, beta, normalize, clip)
    assert torch.allclose(ours["advantages"], out["advantages"], atol=TOL), (ours["advantages"], out["advantages"])
    if beta:
        assert kl.sum().item() / mask.sum().item() == pytest.approx(trainer._metrics["train"]["kl"][-1], abs=TOL)


def test_loss_metrics_and_gradient_equal_trl(trl, models):
    trainer, rows, _ = trl
    trainer.beta, trainer.normalize_advantages, trainer.reward_clip_range = 0.0, False, None
    out = trainer._generate_and_score_completions([dict(r) for r in rows])
    g = torch.Generator().manual_seed(5)
    # Old sequence log-probs near the current ones, so that some ratios clip.
    old_logps = out["old_logps"] + 0.15 * torch.randn(out["old_logps"].shape, generator=g)
    advantages = torch.tensor([1.3, -0.4, 0.2, -1.1, 0.9, -0.7, 0.05, -0.3])
    inputs = {**out, "old_logps": old_logps, "advantages": advantages}
    trainer._metrics["train"].clear()
    trainer.model.zero_grad()
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    policy, _ = models
    policy.zero_grad()
    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], mask], 1)
    cfg = RLOOConfig(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     temperature=TEMPERATURE)
    logps, entropies = completion_logps(policy, ids, attention, mask.shape[1], TEMPERATURE, compute_entropy=True,
                                        fused=True)
    loss, stats = rloo_loss(cfg, logps, old_logps, advantages, mask)
    stats["means"]["entropy"] = ((entropies.detach() * mask).sum(), mask.sum().float())
    loss.backward()
    ours = reduce_loss_stats([stats])

    assert loss.item() == pytest.approx(theirs.item(), abs=TOL, rel=TOL)
    for k in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "clip_ratio/low_min", "clip_ratio/high_max"):
        assert ours[k] == pytest.approx(their_metrics[k], abs=TOL), k
    assert ours["clip_ratio/region_mean"] > 0, "no clipping exercised"
    assert_gradients_close(policy, trainer.model)
