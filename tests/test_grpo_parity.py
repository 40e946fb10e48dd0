"""GRPO against TRL 1.16's own GRPOTrainer, in this process (fp32, CPU, no DeepSpeed): advantages
for every scale_rewards/aggregation, and for every loss_type at both importance-sampling levels the
loss, its logged metrics and its gradient, on identical prompts, completions, masks, advantages,
old and reference log-probs."""

import pytest
import torch

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.models.setup import enable_gradient_checkpointing
from posttrain.rewards import functions as reward_funcs
from posttrain.trainers.entropy_bonus import EntropyBonus
from posttrain.trainers.grpo import (
    GRPOConfig,
    completion_logps,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    micro_batches_per_epoch,
    reduce_loss_stats,
    truncated_rows,
)
from posttrain.trainers.grpo_loss import LOSS_TYPES

G, N, TEMPERATURE = 4, 6, 0.9
TOL = 1e-5
SENTIMENT = "posttrain.demo.synthetic.sentiment_reward"  # the bundled reward, as TRL's scripts name a function


def assert_gradients_close(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Each parameter's gradient equal within TOL of its largest entry (float32 sums round
    relative to their terms: an embedding row's gradient sums terms of ~5 that cancel, and the CPU's
    order of that sum differs between machines) and rtol 1e-4."""
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        atol = TOL * max(1.0, b.grad.abs().max().item())
        assert torch.allclose(a.grad, b.grad, atol=atol, rtol=1e-4), (name, (a.grad - b.grad).abs().max())


def token_reward(completion_ids, **_):
    return [float(sum(ids) % 7) - 3.0 for ids in completion_ids]


def sparse_reward(completion_ids, **_):
    # None (not scored) for some rows: TRL leaves them out of the group statistics.
    return [None if len(ids) % 3 == 0 else float(len(ids)) for ids in completion_ids]


def fixed_rollout(tok):
    """Two prompts of different lengths, four completions each: some end with EOS, some are cut
    at max_completion_length."""
    eos = tok.eos_token_id
    g = torch.Generator().manual_seed(3)
    prompts = ["the cat is", "my old friend felt"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    lengths = [3, 6, 2, 6, 4, 5, 6, 1]
    completion_ids = []
    for i, n in enumerate(lengths):
        ids = torch.randint(10, 400, (n,), generator=g).tolist()
        if not (n == N and i % 2):  # rows 1 and 3 stay truncated (no EOS at the end)
            ids[-1] = eos
        completion_ids.append(ids)
    rows = [{"prompt": prompts[i // G]} for i in range(2 * G)]
    return rows, [prompt_ids[i // G] for i in range(2 * G)], completion_ids


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    """TRL's trainer on the tiny default, built once (beta 0: TRL then builds no reference model;
    the loss reads the reference log-probs from its inputs and beta from the trainer, set per case)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    tok = tiny.load_tokenizer()
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl_grpo")), use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     temperature=TEMPERATURE, save_strategy="no", reward_weights=[1.0, 0.5])
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    trainer = TRLTrainer(model=model, reward_funcs=[token_reward, sparse_reward], args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
    # TRL's default (gradient_checkpointing=True), enabled as its train() would; ours_model matches it.
    assert trainer.args.activation_checkpointing
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=trainer.args.activation_checkpointing_kwargs)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows, prompt_ids, completion_ids = fixed_rollout(tok)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, [])
    return trainer, rows, completion_ids


@pytest.fixture(scope="module")
def ours_model():
    """The policy as GRPOTrainer prepares it: with TRL's fused LM head (``fused=True`` below); the
    plain path (the reference's) is exercised where old/reference log-probs are computed."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32).train()
    enable_gradient_checkpointing(model)  # GRPOConfig's default, as TRL's (the trl fixture enables it too)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def set_trl(trainer, **fields):
    """Give TRL's trainer a case's settings where its __init__ would have put them."""
    for k, v in fields.items():
        setattr(trainer.args, k, v)
    a = trainer.args
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = a.loss_type, a.importance_sampling_level, a.beta
    trainer.scale_rewards, trainer.multi_objective_aggregation = a.scale_rewards, a.multi_objective_aggregation
    trainer.mask_truncated_completions, trainer.top_entropy_quantile = a.mask_truncated_completions, a.top_entropy_quantile
    trainer.epsilon_low = a.epsilon
    trainer.epsilon_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    # The entropy bonus's state, as TRL's __init__ sets it.
    trainer.entropy_coef, trainer.use_adaptive_entropy = a.entropy_coef, a.use_adaptive_entropy
    trainer._entropy_bonus_enabled = a.entropy_coef != 0.0 or a.use_adaptive_entropy
    trainer._last_world_entropy, trainer._entropy_window_stats = float("inf"), None
    trainer._metrics["train"].clear()


def our_cfg(**fields) -> GRPOConfig:
    # TRL without vLLM applies no sampler correction (tests/test_grpo_off_policy.py compares it)
    return GRPOConfig(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                      temperature=TEMPERATURE, vllm_importance_sampling_correction=False, **fields)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(trl, scale, aggregation):
    trainer, rows, completion_ids = trl
    set_trl(trainer, scale_rewards=scale, multi_objective_aggregation=aggregation, mask_truncated_completions=True)
    out = trainer._generate_and_score_completions([dict(r) for r in rows])
    per_func = reward_funcs.call_reward_funcs([token_reward, sparse_reward], [r["prompt"] for r in rows],
                                         [""] * len(rows), completion_ids)
    ours = group_advantages(per_func, torch.tensor([1.0, 0.5]), G, scale, aggregation)
    assert torch.allclose(ours["advantages"], out["advantages"], atol=TOL), (ours["advantages"], out["advantages"])
    metrics = trainer._metrics["train"]
    assert ours["is_std_zero"].float().mean().item() == pytest.approx(metrics["frac_reward_zero_std"][-1])
    # mask_truncated_completions: the same rows are dropped from the loss.
    tok = trainer.processing_class
    mask = out["completion_mask"]
    ids = out["completion_ids"]
    plain = torch.zeros_like(mask)
    for i, c in enumerate(completion_ids):
        plain[i, : len(c)] = 1
    truncated = truncated_rows(ids, plain, [tok.eos_token_id, tok.pad_token_id])
    assert truncated.tolist() == [len(c) == N and c[-1] != tok.eos_token_id for c in completion_ids]
    assert torch.equal(mask, plain * (~truncated).unsqueeze(1).long())


CASES = [(lt, level, {}) for lt in LOSS_TYPES for level in ("token", "sequence")] + [
    ("grpo", "token", {"delta": 1.05, "epsilon_high": 0.28}),
    ("dapo", "token", {"top_entropy_quantile": 0.5}),
    ("bnpo", "sequence", {"use_bias_correction_kl": False}),
    ("grpo", "token", {"beta": 0.0}),
    ("cispo", "token", {"epsilon_high": 1.02}),
    ("dapo", "token", {"entropy_coef": 0.05}),
    ("grpo", "token", {"entropy_coef": 0.1, "top_entropy_quantile": 0.5}),
    ("bnpo", "sequence", {"entropy_coef": 0.02}),
]


@pytest.mark.parametrize("loss_type,level,extra", CASES,
                         ids=[f"{lt}-{lvl}{'-' + '-'.join(x) if x else ''}" for lt, lvl, x in CASES])
def test_loss_metrics_and_gradient_equal_trl(trl, ours_model, loss_type, level, extra):
    trainer, rows, _ = trl
    fields = {"loss_type": loss_type, "importance_sampling_level": level, "beta": 0.04, "epsilon": 0.05, **extra}
    set_trl(trainer, scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
            mask_truncated_completions=False, top_entropy_quantile=1.0, delta=None, epsilon_high=None,
            use_bias_correction_kl=True, beta=0.0, entropy_coef=0.0, use_adaptive_entropy=False)
    batch = trainer._generate_and_score_completions([dict(r) for r in rows])  # at beta 0: no reference needed
    set_trl(trainer, **fields)
    mask = batch["completion_mask"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], mask], 1)
    ours_model.zero_grad()
    with torch.no_grad():  # old and reference log-probs near the current ones, so some ratios clip
        current, _ = completion_logps(ours_model, ids, attention, mask.shape[1], TEMPERATURE)
        g = torch.Generator().manual_seed(11)
        old = (current + 0.08 * torch.randn(current.shape, generator=g)) * mask
        ref = (current + 0.3 * torch.randn(current.shape, generator=g)) * mask
    advantages = torch.tensor([1.3, -0.4, 0.2, -1.1, 0.9, -0.7, 0.05, -0.3])
    inputs = {**batch, "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref}

    trainer.model.zero_grad()
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    cfg = our_cfg(**fields)
    logged = {k for k in their_metrics if k not in ("num_tokens",) and not k.startswith(("rewards/", "completions/"))
              and k not in ("reward", "reward_std", "frac_reward_zero_std")}
    for padding_free in (False, True):  # TRL's run once, ours padded and on packed rows
        ours_model.zero_grad()
        bonus = EntropyBonus(cfg)
        logps, entropies = completion_logps(ours_model, ids, attention, mask.shape[1], TEMPERATURE,
                                            compute_entropy=True, fused=True, padding_free=padding_free,
                                            entropy_grad=bonus.enabled)
        plain, _ = completion_logps(ours_model, ids, attention, mask.shape[1], TEMPERATURE, padding_free=padding_free)
        assert torch.allclose(plain, logps, atol=TOL)  # the two paths agree
        entropy_mask = None
        if cfg.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(entropies.detach(), mask, 1 - cfg.top_entropy_quantile)
        loss, stats = grpo_loss(cfg, logps, old, ref if cfg.beta else None, advantages, mask, entropy_mask,
                                batch["num_items_in_batch"], 1, entropies=entropies, bonus=bonus)
        stats["means"]["entropy"] = ((entropies.detach() * mask).sum(), mask.sum().float())
        loss.backward()
        ours = reduce_loss_stats([stats])
        if bonus.enabled:  # logged at the optimizer step's end (TRL's sync_gradients is true here)
            ours["entropy_coef"] = bonus.coef

        assert loss.item() == pytest.approx(theirs.item(), abs=TOL, rel=TOL), padding_free
        assert logged == set(ours), (logged, set(ours))
        for k in logged:
            assert ours[k] == pytest.approx(their_metrics[k], abs=TOL), (k, padding_free)
        if cfg.loss_type in ("grpo", "dapo") and level == "token" and not extra:
            assert any(ours[k] > 0 for k in ("clip_ratio/low_mean", "clip_ratio/high_mean")), "no clipping exercised"
        assert_gradients_close(ours_model, trainer.model)


@pytest.mark.parametrize("target", [100.0, 0.5])
def test_adaptive_entropy_control_equals_trl(trl, ours_model, target):
    """use_adaptive_entropy over three optimizer steps of one micro-batch each: the first applies no bonus (no
    entropy measured yet), then the coefficient moves by entropy_coef_delta toward keeping the entropy above
    entropy_target (100: always below it, so the bonus grows and applies; 0.5: above it, so it shrinks to
    entropy_coef_min and is not applied); loss, policy_loss, entropy_coef and gradients equal TRL's each step."""
    trainer, rows, _ = trl
    fields = {"loss_type": "dapo", "beta": 0.0, "entropy_coef": 0.02, "use_adaptive_entropy": True,
              "entropy_target": target, "entropy_coef_delta": 0.03, "entropy_coef_min": 0.01, "entropy_coef_max": 0.1}
    set_trl(trainer, scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
            mask_truncated_completions=False, top_entropy_quantile=1.0, delta=None, epsilon_high=None,
            use_bias_correction_kl=True, beta=0.0, entropy_coef=0.0, use_adaptive_entropy=False)
    batch = trainer._generate_and_score_completions([dict(r) for r in rows])
    set_trl(trainer, importance_sampling_level="token", epsilon=0.2, **fields)
    mask = batch["completion_mask"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], mask], 1)
    advantages = torch.tensor([1.3, -0.4, 0.2, -1.1, 0.9, -0.7, 0.05, -0.3])
    inputs = {**batch, "advantages": advantages, "old_per_token_logps": None, "ref_per_token_logps": None}
    bonus, coefs = EntropyBonus(our_cfg(**fields)), []
    for _ in range(3):
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        theirs = trainer._compute_loss(trainer.model, inputs)
        theirs.backward()
        ours_model.zero_grad()
        logps, entropies = completion_logps(ours_model, ids, attention, mask.shape[1], TEMPERATURE,
                                            compute_entropy=True, fused=True, entropy_grad=True)
        loss, stats = grpo_loss(our_cfg(**fields), logps, None, None, advantages, mask, None,
                                batch["num_items_in_batch"], 1, entropies=entropies, bonus=bonus)
        loss.backward()
        bonus.step_ended(lambda t: t)
        coefs.append(bonus.coef)
        assert loss.item() == pytest.approx(theirs.item(), abs=TOL, rel=TOL)
        assert reduce_loss_stats([stats])["policy_loss"] == pytest.approx(trainer._metrics["train"]["policy_loss"][-1],
                                                                          abs=TOL)
        assert bonus.coef == pytest.approx(trainer.entropy_coef) == trainer._metrics["train"]["entropy_coef"][-1]
        assert bonus.last_entropy == pytest.approx(trainer._last_world_entropy, rel=TOL)
        assert_gradients_close(ours_model, trainer.model)
    assert coefs == pytest.approx([0.05, 0.08, 0.1] if target > 1 else [0.01, 0.01, 0.01])


def test_prompt_ids_equal_trl_standard_and_conversational(trl):
    """TRL's standard (text) and conversational (messages, chat template with the generation
    prompt) prompt formats give the ids TRL's trainer generates from."""
    from posttrain.trainers.grpo import tokenize_prompt

    trainer, _, _ = trl
    cfg = our_cfg(max_prompt_length=None)
    text = ["the cat is", "a"]
    chat = [[{"role": "system", "content": "be kind"}, {"role": "user", "content": "the dog felt"}],
            [{"role": "user", "content": "hello"}]]
    for prompts in (text, chat):
        theirs, _, _ = trainer._tokenize_prompts(prompts)
        assert [tokenize_prompt(p, trainer.processing_class, cfg) for p in prompts] == [list(t) for t in theirs]
    assert tokenize_prompt("the cat is very", trainer.processing_class, our_cfg(max_prompt_length=2)) == \
        tokenize_prompt("the cat is very", trainer.processing_class, cfg)[-2:]


@pytest.mark.parametrize("fields,message", [
    ({"loss_type": "ppo"}, "loss_type must be one of"),
    ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
    ({"num_generations": 3}, "multiple of num_generations"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations >= 2"),
    ({"sync_ref_model": True, "beta": 0.0}, "beta: 0 loads none"),
    ({"generation_backend": "vllm"}, "generation_backend"),
    ({"generation_batch_size": 12}, "multiple of per_device_train_batch_size"),
    ({"generation_kwargs": {"num_beams": 2}}, "'num_beams' has no equivalent"),
    ({"generation_kwargs": {"max_new_tokens": 8}}, "set that instead"),
    ({"generation_kwargs": {"temperature": 0.5}}, "set temperature instead"),
    ({"generation_kwargs": {"eos_token_id": [3, -1]}}, "token ids"),
    ({"generation_kwargs": {"top_p": 1.5}}, "top_p must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"generation_kwargs": {"repetition_penalty": -1.0}}, "repetition_penalty must be > 0"),
])
def test_bad_settings_name_the_fix(fields, message):
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**{"per_device_train_batch_size": 8, "num_generations": 4, **fields})


def test_every_eos_id_the_model_declares_ends_a_completion_as_trl(tmp_path):
    """A model whose generation config declares end-of-completion ids beyond the tokenizer's EOS (an instruct
    model's end of turn and end of text): GRPO and RLOO stop sampling at each of them, and count a completion
    ending on one as terminated, with TRL's list of ids (TRL's trainer built on the same folder)."""
    import shutil

    from datasets import Dataset
    from transformers import GenerationConfig
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    tok = tiny.load_tokenizer()
    path = tmp_path / "model"
    shutil.copytree(tiny.sft_model_path(), path)
    GenerationConfig(eos_token_id=[7, 9], pad_token_id=tok.pad_token_id).save_pretrained(path)
    trl_trainer = TRLTrainer(model=str(path), reward_funcs=token_reward, train_dataset=Dataset.from_dict(
        {"prompt": ["x"] * 8}), args=TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[],
                                             per_device_train_batch_size=8, num_generations=4))
    assert trl_trainer.eos_token_ids == [tok.eos_token_id, 7, 9]
    for cls, cfg_cls in ((GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)):
        ours = cls(str(path), reward_funcs=token_reward, train_dataset=[{"prompt": "x"}] * 8,
                   args=cfg_cls(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=8,
                                num_generations=4, save_strategy="no"))
        assert ours.eos_ids == trl_trainer.eos_token_ids == ours.rollout.sampling.stop_token_ids
        ended = torch.tensor([[5, 9, 0], [5, 6, 8]])
        assert truncated_rows(ended, torch.tensor([[1, 1, 0], [1, 1, 1]]), ours.eos_ids + [0]).tolist() == [False, True]
        ours.end()


def test_generation_kwargs_sample_as_trl_and_end_completions_on_their_stops(tmp_path):
    """TRL's ``generation_kwargs`` (transformers' names, vLLM's where they differ) override the sampling fields
    as in TRL: ``eos_token_id`` replaces the stop ids, ``stop_token_ids`` adds to them, top_k -1 is off.
    Deliberate difference: a completion ends on the stop that ended its sampling. TRL's mask ends only at the
    model's EOS ids, so with a stop id of one's own a completion that stops before the batch's longest runs on
    over the padding (checked on TRL's own generation below)."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.trainers.distill import DistillationConfig
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    tok = tiny.load_tokenizer()
    stops = list(range(2, len(tok), 8))  # an eighth of the vocabulary; neither padding (0) nor EOS (1)
    kwargs = {"eos_token_id": stops, "top_k": 5, "min_new_tokens": 0}
    trl_trainer = TRLTrainer(model=str(tiny.sft_model_path()), reward_funcs=token_reward, train_dataset=Dataset.from_dict(
        {"prompt": ["x"] * 8}), args=TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[],
                                             per_device_train_batch_size=8, num_generations=4,
                                             max_completion_length=N, generation_kwargs=kwargs))
    assert trl_trainer.generation_config.eos_token_id == stops and trl_trainer.generation_config.top_k == 5
    prompt = tok("the cat is")["input_ids"]
    torch.manual_seed(0)
    trl_completions, _ = trl_trainer._generate_single_turn([prompt] * 8, None, {}, 8)
    # TRL's completion ends at the model's EOS only: after a stop of one's own, padding up to the longest.
    run_on = [c for c in trl_completions if c[0] in stops and len(c) > 1]
    assert run_on and all(set(c[1:]) == {tok.pad_token_id} for c in run_on)

    ids = torch.tensor([prompt] * 8)
    for cls, cfg_cls in ((GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)):
        ours = cls(str(tiny.sft_model_path()), reward_funcs=token_reward, train_dataset=[{"prompt": "the cat is"}] * 8,
                   args=cfg_cls(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=8,
                                num_generations=4, max_completion_length=N, save_strategy="no",
                                generation_kwargs=kwargs))
        sampling = ours.rollout.sampling
        assert sampling.stop_token_ids == ours.eos_ids == stops and sampling.top_k == 5
        out = ours.rollout.generate(ids, torch.ones_like(ids))
        for row, n in zip(out.completion_ids.tolist(), out.completion_mask.sum(1).tolist()):
            ended = [i for i, t in enumerate(row[:n]) if t in stops]
            assert ended in ([n - 1], []) and (ended or n == N)  # ends on its first stop, or runs to the end
        assert any(n < N for n in out.completion_mask.sum(1).tolist())
        ours.end()
    added = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=token_reward, train_dataset=[{"prompt": "x"}] * 8,
                        args=GRPOConfig(output_dir=str(tmp_path / "added"), per_device_train_batch_size=8,
                                        num_generations=4, save_strategy="no", repetition_penalty=1.3,
                                        generation_kwargs={"stop_token_ids": [5, 1], "top_k": -1, "min_tokens": 2}))
    assert added.sampling.stop_token_ids == [tok.eos_token_id, 5] and added.sampling.top_k == 0
    assert added.sampling.min_new_tokens == 2 and added.sampling.repetition_penalty == 1.3
    assert added.rollout.sampling.repetition_penalty == 1.3  # what the engine samples with
    added.end()
    with pytest.raises(ConfigError, match="'suppress_tokens' has no equivalent"):
        DistillationConfig(generation_kwargs={"suppress_tokens": [3]})
    assert DistillationConfig(generation_kwargs={"top_p": 0.9}).generation_kwargs == {"top_p": 0.9}


def test_rloo_settings():
    from posttrain.errors import ConfigError
    from posttrain.trainers.rloo import RLOOConfig

    assert RLOOConfig(per_device_train_batch_size=8, num_generations=4).beta == 0.05  # TRL's RLOO default
    with pytest.raises(TypeError, match="importance_sampling_level"):  # TRL's RLOOConfig has no GRPO options
        RLOOConfig(per_device_train_batch_size=8, num_generations=4, importance_sampling_level="sequence")
    with pytest.raises(ConfigError, match="reward_clip_range"):
        RLOOConfig(per_device_train_batch_size=8, num_generations=4, reward_clip_range=[2.0, -1.0])


def test_checkpoints_only_on_generation_boundaries(tmp_path):
    """A checkpoint holds no generation batch, so it must fall where a new one is sampled."""
    from posttrain.errors import ConfigError
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOTrainer

    cfg = GRPOConfig(per_device_train_batch_size=8, num_generations=4, steps_per_generation=2, save_steps=1,
                     output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="generation boundary"):
        GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=[SENTIMENT], args=cfg, train_dataset=bundled_prompts(16))


@pytest.mark.parametrize("prompts,steps_per_generation,num_iterations", [(8, 1, 1), (10, 2, 2), (9, 3, 1)])
def test_epoch_is_trls(tmp_path, prompts, steps_per_generation, num_iterations):
    """The logged epoch's unit: TRL's dataloader length (transformers' Trainer logs epoch as the
    micro-batches done over it), for generation batches that outlive a step and reused ones."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    fields = dict(per_device_train_batch_size=2 * G, num_generations=G, steps_per_generation=steps_per_generation,
                  num_iterations=num_iterations)
    args = TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_completion_length=N,
                     save_strategy="no", **fields)
    trainer = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tiny.sft_model_path()), reward_funcs=[token_reward],
                         args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * prompts}),
                         processing_class=tiny.load_tokenizer())
    ours = micro_batches_per_epoch(prompts, GRPOConfig(max_completion_length=N, **fields))
    assert ours == len(trainer.get_train_dataloader())


@pytest.mark.parametrize("config", ["grpo", "rloo"])
def test_every_trl_field_works_or_is_refused(config):
    """Each field of TRL's GRPOConfig / RLOOConfig takes effect or is refused with its reason; a refused
    one set to another value than TRL's default is one sentence naming it."""
    from posttrain.errors import ConfigError
    from posttrain.trainers.rloo import RLOOConfig
    from posttrain.trainers.trl_fields import field_status

    cls = {"grpo": GRPOConfig, "rloo": RLOOConfig}[config]
    status = field_status(cls)
    assert [k for k, v in status.items() if v == "?"] == []
    assert status["num_generations"] == status["temperature"] == status["min_p"] == status["ds3_gather_for_generation"] == ""
    assert status["repetition_penalty"] == status["generation_kwargs"] == ""
    assert status["use_vllm"] and status["pad_to_multiple_of"]
    for name, value in (("use_vllm", True), ("cache_implementation", "static"), ("pad_to_multiple_of", 8)):
        with pytest.raises(ConfigError, match=f"^{name} is {value!r}, which posttrain does not support"):
            cls(per_device_train_batch_size=8, num_generations=4, **{name: value})
    cls(per_device_train_batch_size=8, num_generations=4, pad_to_multiple_of=None)  # TRL's "auto" off Neuron
    # No script-level field (TrlParser takes the config beside ModelConfig and TRL's script arguments).
    from trl import ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    TrlParser((GRPOScriptArguments, cls, ModelConfig))


def test_evaluation_logs_trls_eval_rewards(tmp_path):
    """eval_strategy steps: every eval prompt num_generations_eval times, in global batches of
    per_device_eval_batch_size, scored; the eval row has the reward and completion metrics TRL's
    evaluate() logs (TRL's also has a loss and its terms, which posttrain's evaluation does not compute)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.demo import synthetic
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOTrainer

    prompts, held_out = bundled_prompts(16), bundled_prompts(6, seed=1)
    fields = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=N,
                  per_device_eval_batch_size=4, num_generations_eval=2, eval_strategy="steps", save_strategy="no")
    args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], **fields)
    theirs = TRLTrainer(model=str(tiny.sft_model_path()), reward_funcs=[synthetic.sentiment_reward], args=args,
                        train_dataset=Dataset.from_list(prompts), eval_dataset=Dataset.from_list(held_out),
                        processing_class=tiny.load_tokenizer())
    their_keys = set(theirs.evaluate())
    AcceleratorState._reset_state(reset_partial_state=True)  # TRL's process-wide state, not the session's

    cfg = GRPOConfig(output_dir=str(tmp_path / "ours"), max_steps=2, logging_steps=1, eval_steps=2, **fields)
    ours = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=synthetic.sentiment_reward, args=cfg,
                       train_dataset=prompts, eval_dataset=held_out)
    sizes, generate = [], ours.rollout.generate
    ours.rollout.generate = lambda ids, mask: sizes.append(ids.shape[0]) or generate(ids, mask)
    ours.train()
    ours.end()
    evals = [r for r in ours.state.log_history if "eval/reward" in r]
    assert [r["step"] for r in evals] == [2]
    assert sizes == [8, 8, 4, 4, 4]  # two training generation batches, then 6 prompts x 2 in batches of 4
    ours_keys = {k.replace("eval/", "eval_") for k in evals[0] if k.startswith("eval/")}
    loss_terms = {"eval_loss", "eval_kl", "eval_entropy"} | {k for k in their_keys if k.startswith("eval_clip_ratio")}
    timing = {"epoch", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time"}
    assert ours_keys == their_keys - loss_terms - timing, (ours_keys ^ their_keys)
    assert -2.0 <= evals[0]["eval/reward"] <= 2.0 and evals[0]["eval/completions/mean_length"] > 0
