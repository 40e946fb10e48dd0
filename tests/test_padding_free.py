"""Padding-free training forwards (``padding_free``) equal the padded ones: the packing itself, each trainer's
forward (values and gradients, fp32 CPU, within 1e-5) and one training step of every trainer (its logged loss,
metrics and gradient norm). PPO's ``policy/entropy_avg`` is the exception, shown: TRL's averages padding too."""

import math

import pytest
import torch

from posttrain.demo import synthetic, tiny
from posttrain.models.packing import Packing, last_non_pad
from posttrain.scripts.data import bundled_prompts

TOL = 1e-5
ONE_PROCESS = dict(single_process_engine="torch", mixed_precision="no", disable_tqdm=True, report_to=[],
                   save_strategy="no", gradient_checkpointing=True, max_steps=1, logging_steps=1, seed=3)


def ragged(seed: int = 0, rows: int = 4, width: int = 12, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and a mask of rows of different lengths (one row full), right- or left-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = [width, 3, min(7, width - 1), 1][:rows]
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[r, cols] = torch.randint(5, 400, (n,), generator=g)
        mask[r, cols] = 1
    return ids, mask


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=TOL * max(1.0, b[name].abs().max().item()), rtol=1e-4,
                                   msg=name)


def causal_lm(fused: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    return model


# -- the packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("left", [False, True])
def test_packing_positions_boundaries_and_round_trip(left):
    ids, mask = ragged(left=left)
    p = Packing.of(mask)
    inputs = p.model_inputs(ids)
    lengths = mask.sum(1).tolist()
    assert inputs["input_ids"].shape == (1, sum(lengths))
    assert inputs["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    assert inputs["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert inputs["max_length_q"] == max(lengths)
    assert torch.equal(p.unpack(inputs["input_ids"][0]), ids * mask)
    nxt = p.same_sequence_next()
    assert nxt.sum() == sum(lengths) - len(lengths)  # every token but each sequence's last predicts within it
    ids[0, -1] = 0
    assert last_non_pad(ids, 0).tolist()[1:] == ([11, 11, 11] if left else [2, 6, 0])


# -- each trainer's forward -------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
def test_completion_logps_and_gradients(fused):
    """GRPO/RLOO/PPO's forward: prompts left-padded, completions right-padded (one ending at once)."""
    from posttrain.trainers.online import completion_logps

    model = causal_lm(fused)
    prompt_ids, prompt_mask = ragged(1, left=True)
    completion_ids, completion_mask = ragged(2, width=6)
    completion_mask[3] = 0  # a completion masked out whole (mask_truncated_completions)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    out = {}
    for padding_free in (False, True):
        lp, ent = completion_logps(model, ids, mask, 6, 0.9, compute_entropy=True, fused=fused, batch_size=3,
                                   padding_free=padding_free)
        (lp * completion_mask * torch.linspace(0.5, 1.5, 6)).sum().backward()
        out[padding_free] = lp.detach(), ent, grads(model)
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1, lp0 * completion_mask, atol=TOL, rtol=TOL)
    torch.testing.assert_close(ent1, ent0 * completion_mask, atol=TOL, rtol=TOL)
    assert (lp1 * completion_mask).abs().sum() > 1.0
    assert_grads_close(g1, g0)


def test_completion_logps_absolute_positions_gpt2():
    """A model with learned positions reads the packed row's restarting positions as the padded ones."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from posttrain.trainers.online import completion_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=400, n_embd=32, n_layer=2, n_head=2,
                                                        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                        attn_pdrop=0.0))
    ids, mask = ragged(4, left=True)
    completion_ids, completion_mask = ragged(5, width=5)
    ids, mask = torch.cat([ids, completion_ids], 1), torch.cat([mask, completion_mask], 1)
    padded, _ = completion_logps(model, ids, mask, 5, 1.0)
    packed, _ = completion_logps(model, ids, mask, 5, 1.0, padding_free=True)
    torch.testing.assert_close(packed, padded, atol=TOL, rtol=TOL)


def test_a_model_without_position_ids_runs_padded(caplog):
    """BLOOM (ALiBi from the attention mask, no position ids) would attend across a packed row's sequences:
    its padding-free forward runs padded, says so and counts it."""
    from transformers import AutoModelForCausalLM, BloomConfig

    from posttrain.trainers.online import completion_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=400, hidden_size=32, n_layer=2, n_head=2))
    ids, mask = ragged(12, left=True)
    from posttrain.models import packing

    padded, _ = completion_logps(model, ids, mask, 5, 1.0)
    before = packing.fallbacks()
    with caplog.at_level("WARNING"):
        packed, _ = completion_logps(model, ids, mask, 5, 1.0, padding_free=True)
    assert torch.equal(packed, padded)
    assert "BloomForCausalLM takes no position ids" in caplog.text
    assert packing.fallbacks() == before + 1  # counted: trainers log train/padding_free_fallbacks


def test_dpo_sequence_logps_stats_and_gradients():
    from posttrain.trainers.dpo import sequence_logps

    model = causal_lm()
    ids, mask = ragged(6)
    completion = mask.clone()
    completion[:, :2] = 0  # a two-token prompt
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}
    out = {}
    for padding_free in (False, True):
        res = sequence_logps(model, batch, ld_alpha=0.5, stats=True, padding_free=padding_free)
        res["logps"].sum().backward()
        out[padding_free] = res, grads(model)
    (a, ga), (b, gb) = out[False], out[True]
    m = completion[:, 1:].bool()
    torch.testing.assert_close(b["logps"], a["logps"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(b["per_token_logps"], a["per_token_logps"], atol=TOL, rtol=TOL)
    for key in ("entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(b[key][m], a[key][m], atol=TOL, rtol=TOL)
    assert torch.equal(b["is_top1"][m], a["is_top1"][m])
    assert_grads_close(gb, ga)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_reward_scores_and_gradients(pad_is_eos):
    """The score at each row's last non-pad token, as transformers' classifier reads it (with pad = EOS, a
    trailing EOS is not that token)."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.trainers.reward import sequence_rewards

    model = AutoModelForSequenceClassification.from_pretrained(tiny.model_path("reward", seed=0), dtype=torch.float32)
    ids, mask = ragged(7)
    model.config.pad_token_id = 9 if pad_is_eos else 0
    if pad_is_eos:
        ids[0, -1] = ids[2, 5] = 9  # rows ending with EOS, which is also the pad id
        ids[mask == 0] = 9
    out = {}
    for padding_free in (False, True):
        r = sequence_rewards(model, ids, mask, padding_free)
        (r * torch.tensor([1.0, -2.0, 0.5, 3.0])).sum().backward()
        out[padding_free] = r.detach(), grads(model)
    torch.testing.assert_close(out[True][0], out[False][0], atol=TOL, rtol=TOL)
    assert_grads_close(out[True][1], out[False][1])


def test_ppo_value_scores_and_gradients():
    from transformers import AutoModelForSequenceClassification

    from posttrain.rewards.models import head_scores

    model = AutoModelForSequenceClassification.from_pretrained(tiny.model_path("reward", seed=0), dtype=torch.float32)
    queries, _ = ragged(8, left=True)
    responses, _ = ragged(9, width=6)
    sequences = torch.cat([queries, responses], 1)  # pad id 0 left of the queries, right of the responses
    valid = (sequences != 0).unsqueeze(-1)
    out = {}
    for padding_free in (False, True):
        v = head_scores(model, sequences, 0, padding_free)
        (v * valid).sum().backward()
        out[padding_free] = v.detach(), grads(model)
    torch.testing.assert_close(out[True][0] * valid, out[False][0] * valid, atol=TOL, rtol=TOL)
    assert_grads_close(out[True][1], out[False][1])


# -- one training step of each trainer ----------------------------------------------------------------
def logged(make, drop: tuple[str, ...] = ()) -> dict[bool, dict[str, float]]:
    """The first logged row of ``make(padding_free)``'s one-step run, padded and padding-free."""
    rows = {}
    for padding_free in (False, True):
        trainer = make(padding_free)
        trainer.train()
        trainer.end()
        row = trainer.state.log_history[0]
        rows[padding_free] = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith(
            ("time/", "timing/", "train/", "rollout/", "generate/")) and "time" not in k and k not in drop}
    return rows


def assert_rows_equal(rows: dict[bool, dict[str, float]], nontrivial: str) -> None:
    a, b = rows[False], rows[True]
    assert a.keys() == b.keys() and nontrivial in a
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=TOL, rel=TOL), (k, a[k], b[k])
    assert a["grad_norm"] > 1e-4 and math.isfinite(a[nontrivial])


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_grpo_and_rloo_step(tmp_path, algorithm):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    def token_reward(completion_ids, **_):
        return [float(sum(ids) % 7) - 3.0 for ids in completion_ids]

    cls, cfg_cls, extra = {"grpo": (GRPOTrainer, GRPOConfig, {"beta": 0.04}), "rloo": (RLOOTrainer, RLOOConfig, {})}[
        algorithm]

    def make(padding_free):
        cfg = cfg_cls(output_dir=str(tmp_path / str(padding_free)), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, padding_free=padding_free, **extra, **ONE_PROCESS)
        return cls(str(tiny.sft_model_path()), reward_funcs=token_reward, args=cfg, train_dataset=bundled_prompts(2))

    assert_rows_equal(logged(make), "loss")


def test_dpo_step(tmp_path):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    def make(padding_free):
        cfg = DPOConfig(output_dir=str(tmp_path / f"dpo{padding_free}"), per_device_train_batch_size=4,
                        padding_free=padding_free, **ONE_PROCESS)
        return DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)), args=cfg,
                          train_dataset=synthetic.preference_pairs(4, seed=3))

    assert_rows_equal(logged(make), "rewards/margins")


def test_reward_step(tmp_path):
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    def make(padding_free):
        cfg = RewardConfig(output_dir=str(tmp_path / f"rm{padding_free}"), per_device_train_batch_size=4,
                           padding_free=padding_free, **ONE_PROCESS)
        return RewardTrainer(str(tiny.model_path("reward", seed=0)), args=cfg,
                             train_dataset=synthetic.preference_pairs(4, seed=4))

    assert_rows_equal(logged(make), "margin")


def test_distillation_step(tmp_path):
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    rows = [{"prompt": " ".join(w[:2]), "completion": " " + " ".join(w[2:])}
            for w in (x.split() for x in tiny.corpus()[:4])]

    def make(padding_free):
        cfg = DistillationConfig(output_dir=str(tmp_path / f"kd{padding_free}"), per_device_train_batch_size=4,
                                 lmbda=0.5, max_completion_length=8, padding_free=padding_free, **ONE_PROCESS)
        return DistillationTrainer(str(tiny.model_path()), str(tiny.model_path(seed=1)), args=cfg, train_dataset=rows)

    assert_rows_equal(logged(make), "loss")


def test_ppo_step(tmp_path):
    """The tiny tokenizer's pad is not its EOS: the responses hold no padding and every metric is equal."""
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer

    def make(padding_free):
        cfg = PPOConfig(output_dir=str(tmp_path / f"ppo{padding_free}"), per_device_train_batch_size=2,
                        num_ppo_epochs=1, response_length=6, num_sample_generations=0, stop_token="eos", padding_free=padding_free,
                        **ONE_PROCESS)
        return PPOTrainer(args=cfg, model=str(tiny.sft_model_path()), reward_model=str(tiny.reward_model_path()),
                          train_dataset=bundled_prompts(2))

    rows = logged(make)
    rows[False]["grad_norm"] = rows[True]["grad_norm"] = 1.0  # PPO logs no grad_norm of its two models
    assert_rows_equal(rows, "policy/entropy_avg")


def test_ppo_entropy_metric_reads_padding():
    """Where a response holds the pad id (a tokenizer whose pad is its EOS), TRL's ``policy/entropy_avg``
    averages the entropies at those masked positions too, which a packed row does not compute: the reason
    PPO's ``padding_free`` is off by default. The log-probs PPO trains on are equal."""
    from posttrain.trainers.ppo import lm_logprobs

    model = causal_lm()
    queries, _ = ragged(10, left=True)
    responses, _ = ragged(11, width=6)  # pad id 0 after each response's end
    qr = torch.cat([queries, responses], 1)
    valid = responses != 0
    out = {pf: lm_logprobs(model, qr, queries.shape[1], 0, 0.7, compute_entropy=True, padding_free=pf)
           for pf in (False, True)}
    torch.testing.assert_close(out[True][0][valid], out[False][0][valid], atol=TOL, rtol=TOL)
    torch.testing.assert_close(out[True][1][valid], out[False][1][valid], atol=TOL, rtol=TOL)
    assert abs(out[True][1].mean() - out[False][1].mean()) > 0.1
