"""DAPO's dynamic sampling (``dynamic_sampling``): on without zero-spread groups, the run equals the run without it;
with them, the trained batch holds only groups with spread and its loss equals TRL's GRPOTrainer given that
batch (its vLLM path emulated with the same sampling log-probs); the bound and the metrics; in this process."""

import pytest
import torch

from posttrain.demo import tiny
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.dynamic_sampling import choose_groups, fill_generation_batch, group_spread
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

G, N, TOL = 4, 6, 1e-5
PROMPTS = bundled_prompts(8)
SATURATED = {r["prompt"] for r in PROMPTS[::2]}  # half the prompts: every completion scores 1


def always_spread(completion_ids, **_):
    return [float(i) for i in range(len(completion_ids))]  # distinct within every group


def saturating(prompts, completion_ids, **_):
    return [1.0 if p in SATURATED else float(sum(c) % 5) for p, c in zip(prompts, completion_ids)]


def fields(tmp, **extra):
    return dict(output_dir=str(tmp), per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                max_steps=2, logging_steps=1, save_strategy="no", seed=3, **extra)


def test_choose_groups_keeps_order_and_tops_up():
    spread = [torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    assert choose_groups(spread, 2) == ([1, 3], False)
    assert choose_groups(spread, 4) == ([0, 1, 3, 4], True)
    rewards = torch.tensor([[1.0], [1.0], [0.0], [2.0], [float("nan")], [3.0]])
    assert group_spread(rewards, torch.tensor([1.0]), 2).tolist() == [False, True, False]


def test_without_zero_spread_groups_the_run_is_the_run_without_it(tmp_path):
    runs = {}
    for on in (False, True):
        cfg = GRPOConfig(**fields(tmp_path / str(on), dynamic_sampling=on))
        t = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=always_spread, args=cfg, train_dataset=PROMPTS)
        t.train()
        t.end()
        runs[on] = ([r["loss"] for r in t.state.log_history if "loss" in r],
                    [p.detach().clone() for p in t.session.unwrap("policy").parameters()],
                    [r for r in t.state.log_history if "loss" in r])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    assert all(r["dynamic_sampling/extra_rounds"] == r["dynamic_sampling/dropped_groups"] == 0 for r in runs[True][2])


def test_zero_spread_groups_are_replaced_and_the_loss_is_trls(tmp_path):
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    cfg = GRPOConfig(**fields(tmp_path / "ours", dynamic_sampling=True, single_process_engine="torch"))
    ours = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=saturating, args=cfg, train_dataset=PROMPTS)
    ours.session.engines["policy"].train()
    idx = ours._generation_rows(0)
    with torch.no_grad():
        first, metrics = ours._sample_and_score([ours.rows[i] for i in idx], [ours.prompt_ids[i] for i in idx], G,
                                                train=True)
        round0 = {k: v.clone() for k, v in first.items()}
        batch, metrics = fill_generation_batch(ours, 0, first, metrics)
    assert metrics["dynamic_sampling/extra_rounds"] >= 1 and metrics["dynamic_sampling/dropped_groups"] >= 1
    assert ours.dynamic_rounds == metrics["dynamic_sampling/extra_rounds"]
    # The trained batch: whole groups, none without spread, none from a saturated prompt.
    by_ids = {tuple(p): r["prompt"] for p, r in zip(ours.prompt_ids, ours.rows)}
    prompts = [by_ids[tuple(p[m.bool()].tolist())] for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"])]
    assert not SATURATED & set(prompts)
    assert group_spread(torch.tensor(saturating(prompts, completions)).unsqueeze(1), torch.ones(1), G).all()
    assert batch["advantages"].abs().sum() > 0 and batch["completion_ids"].shape == round0["completion_ids"].shape
    loss, _ = ours.compute_loss(batch)

    # TRL's trainer given that batch (its vLLM path: the same sampling log-probs), with TRL's own advantages.
    AcceleratorState._reset_state(reset_partial_state=True)
    tok = tiny.load_tokenizer()
    args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     save_strategy="no")
    trl = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32),
                     reward_funcs=saturating, args=args, train_dataset=Dataset.from_list(PROMPTS),
                     processing_class=tok)
    trl.model.train()
    trl.use_vllm, trl.current_gradient_accumulation_steps = True, 1
    sampling = [lp[m.bool()].tolist() for lp, m in zip(batch["sampling_per_token_logps"], batch["completion_mask"])]
    prompt_ids = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    trl._generate = lambda _: (prompt_ids, completions, None, texts, sampling, {}, None, [])
    theirs_batch = trl._generate_and_score_completions([{"prompt": p} for p in prompts])
    theirs = trl._compute_loss(trl.model, theirs_batch)
    assert torch.allclose(batch["advantages"], theirs_batch["advantages"], atol=TOL)
    assert loss.item() == pytest.approx(theirs.item(), abs=TOL, rel=TOL)

    # At the bound (no extra round allowed), the first round is trained as sampled, and that is counted.
    ours.cfg.dynamic_sampling_max_rounds = 0
    with torch.no_grad():
        again, capped = fill_generation_batch(ours, 0, {k: v.clone() for k, v in round0.items()}, {})
    assert capped == {"dynamic_sampling/dropped_groups": 0.0, "dynamic_sampling/extra_rounds": 0.0,
                      "dynamic_sampling/underfilled": 1.0}
    assert all(torch.equal(again[k], round0[k]) for k in again)


def test_rloo_trains_only_groups_with_spread(tmp_path):
    """RLOO's path: the kept batch's advantages are RLOO's over it (its KL in the reward recomputed from the
    kept rows' log-probs), and no trained group is without spread."""
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer, rloo_advantages

    cfg = RLOOConfig(**fields(tmp_path, dynamic_sampling=True))
    ours = RLOOTrainer(str(tiny.sft_model_path()), reward_funcs=saturating, args=cfg, train_dataset=PROMPTS)
    micro, metrics = ours.generate_and_score(0)
    batch = micro[0]
    assert metrics["dynamic_sampling/extra_rounds"] >= 1 and metrics["dynamic_sampling/underfilled"] == 0.0
    by_ids = {tuple(p): r["prompt"] for p, r in zip(ours.prompt_ids, ours.rows)}
    prompts = [by_ids[tuple(p[m.bool()].tolist())] for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"])]
    from posttrain.data.order import mix_seed

    # The micro-batch is the generation batch shuffled as TRL shuffles it: undo that to see the groups.
    perm = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, "shuffle", 0, 0)))
    order = torch.argsort(perm).tolist()
    rewards = torch.tensor([saturating([prompts[i]], [completions[i]])[0] for i in order]).unsqueeze(1)
    assert not SATURATED & set(prompts) and group_spread(rewards, torch.ones(1), G).all()
    mask = batch["completion_mask"].float()
    kl = ((batch["old_per_token_logps"] - batch["ref_per_token_logps"]) * mask).sum(-1)[order]
    want = rloo_advantages(rewards, torch.ones(1), G, kl, cfg.beta)["advantages"]
    assert torch.allclose(batch["advantages"][order], want, atol=TOL)
