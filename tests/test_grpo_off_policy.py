"""The sampler correction (TRL's ``vllm_importance_sampling_*``, ``off_policy_mask_threshold``) against TRL 1.16's
GRPOTrainer with its vLLM path emulated: both trainers take the same completions and the same table of sampling
log-probs (TRL through ``_generate``, posttrain through its rollout), then compute old log-probs, the correction
ratio, the ``sampling/*`` metrics and the loss; fp32, CPU, in this process."""

import pytest
import torch

from posttrain.demo import tiny
from posttrain.rollout import RolloutOutput
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

G, N, TEMPERATURE = 4, 6, 0.9
TOL = 1e-5


def token_reward(completion_ids, **_):
    return [float(sum(ids) % 7) - 3.0 for ids in completion_ids]


def fixed_rollout(tok):
    """Two prompts, four completions each (some end with EOS, some are cut), and a sampling log-prob table
    near the model's (noise large enough that some ratios leave [0.5, 3])."""
    g = torch.Generator().manual_seed(5)
    prompts = ["the cat is", "my old friend felt"]
    lengths = [3, 6, 2, 6, 4, 5, 6, 1]
    completions = []
    for n in lengths:
        ids = torch.randint(10, 400, (n,), generator=g).tolist()
        if n < N:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    noise = [(0.5 * torch.randn(n, generator=g)).tolist() for n in lengths]
    return [{"prompt": prompts[i // G]} for i in range(2 * G)], completions, noise


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.trainers.online import completion_logps

    tok = tiny.load_tokenizer()
    rows, completions, noise = fixed_rollout(tok)
    prompt_ids = [tok(r["prompt"])["input_ids"] for r in rows]
    # The table: the model's own log-probs of the completions plus noise (what a bf16 sampler would report).
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    sampling = []
    with torch.no_grad():
        for p, c, e in zip(prompt_ids, completions, noise):
            ids = torch.tensor([p + c])
            lp, _ = completion_logps(model, ids, torch.ones_like(ids), len(c), TEMPERATURE)
            sampling.append((lp[0] + torch.tensor(e)).tolist())

    fields = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                  temperature=TEMPERATURE, save_strategy="no", loss_type="grpo", epsilon=0.05)
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
                     **fields)
    trl = TRLTrainer(model=model, reward_funcs=[token_reward], args=args,
                     train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
    trl.model.train()
    trl.current_gradient_accumulation_steps = 1
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    trl._generate = lambda prompts: (prompt_ids, completions, None, texts, sampling, {}, None, [])
    trl.use_vllm = True  # TRL's vLLM path: old log-probs always, the ratio from the sampling table
    AcceleratorState._reset_state(reset_partial_state=True)

    cfg = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("ours")), single_process_engine="torch", **fields)
    ours = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=token_reward, args=cfg,
                       train_dataset=[{"prompt": r["prompt"]} for r in rows])
    ours.session.engines["policy"].train()

    def generate(ids, mask):
        c = torch.full((len(completions), N), tok.pad_token_id)
        m, lp = torch.zeros_like(c), torch.zeros(c.shape)
        for i, (ci, si) in enumerate(zip(completions, sampling)):
            c[i, : len(ci)], m[i, : len(ci)], lp[i, : len(si)] = torch.tensor(ci), 1, torch.tensor(si)
        return RolloutOutput(sequences=torch.cat([ids, c], 1), completion_ids=c, completion_mask=m, logprobs=lp)

    ours.rollout.generate = generate
    return trl, ours, rows, prompt_ids


CASES = [
    ("token_truncate", {"vllm_importance_sampling_clip_min": 0.5}),
    ("token_mask", {"vllm_importance_sampling_clip_min": 0.5}),
    ("sequence_truncate", {}),
    ("sequence_mask", {}),
    ("sequence_mask", {"off_policy_mask_threshold": 0.05}),
    ("token_mask", {"loss_type": "vespo", "vllm_importance_sampling_clip_min": 0.5}),
]


@pytest.mark.parametrize("separate", [False, True], ids=["in_loss", "separate_forward"])
@pytest.mark.parametrize("mode,extra", CASES, ids=[f"{m}-{'-'.join(x) or 'default'}" for m, x in CASES])
def test_correction_equals_trl_vllm_path(both, mode, extra, separate, monkeypatch):
    """in_loss: the default (the generation batch trains within one optimizer step), the ratio formed in the loss
    from its own forward; separate_forward: a generation batch that outlives its step, the old log-probs' forward."""
    from posttrain.trainers import off_policy

    trl, ours, rows, prompt_ids = both
    if separate:
        monkeypatch.setattr(ours, "needs_old_logps", lambda: True)
    fields = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": None,
              "vllm_importance_sampling_clip_max": 3.0, "off_policy_mask_threshold": None, "loss_type": "grpo",
              **extra}
    for k, v in fields.items():
        setattr(trl.args, k, v)
        setattr(trl, k, v)
        setattr(ours.cfg, k, v)
    trl._metrics["train"].clear()
    batch = trl._generate_and_score_completions([dict(r) for r in rows])
    trl.model.zero_grad()
    theirs = trl._compute_loss(trl.model, batch)
    theirs.backward()
    their_metrics = {k: v[-1] for k, v in trl._metrics["train"].items()}

    with torch.no_grad():  # as generate_and_score runs it
        mine, metrics = ours._sample_and_score(rows, prompt_ids, G, train=True)
    policy = ours.session.engines["policy"]
    policy.zero_grad()
    loss, stats = ours.compute_loss(mine)
    loss.backward()

    mask, per_sequence = mine["completion_mask"].bool(), mode.startswith("sequence")
    assert ("importance_sampling_ratio" in mine) is separate and ("sampling" in stats) is not separate
    if separate:
        ratio = mine["importance_sampling_ratio"]
        assert torch.allclose(ratio, batch["importance_sampling_ratio"], atol=TOL)
    else:  # as training_step, once the generation batch (here one micro-batch) has trained
        metrics.update(off_policy.reduce_sampling_values([stats["sampling"]], mode))
        ratio = stats["sampling"][1]  # the ratio of each completion token (token modes) or sequence
        theirs_ratio = batch["importance_sampling_ratio"]
        assert torch.allclose(ratio, theirs_ratio.flatten() if per_sequence else theirs_ratio[mask], atol=TOL)
    assert loss.item() == pytest.approx(theirs.item(), abs=TOL, rel=TOL)
    sampled = {k for k in their_metrics if k.startswith("sampling/")}
    assert len(sampled) == 5 and sampled <= set(metrics)
    for k in sampled:
        assert metrics[k] == pytest.approx(their_metrics[k], abs=TOL, rel=TOL), k
    valid = ratio if per_sequence or not separate else ratio[mask]
    if mode.endswith("mask"):  # the bounds were hit: some ratios masked, and the fraction says how many
        assert (valid == 0).any() and metrics["sampling/masked_fraction"] == pytest.approx(
            (valid == 0).float().mean().item())
    else:
        assert ((valid == 3.0) | (valid == 0.5)).any()
    theirs_named = dict(trl.model.named_parameters())
    for name, a in policy.named_parameters():
        b = theirs_named[name.removeprefix("module.")]
        assert torch.allclose(a.grad, b.grad, atol=TOL * max(1.0, b.grad.abs().max().item()), rtol=1e-4), (
            name, (a.grad - b.grad).abs().max(), b.grad.abs().max())


def test_correction_off_computes_no_old_logps_forward(both):
    """Correction off and a generation batch used within one step: no old log-probs forward (TRL's rule)."""
    _, ours, rows, prompt_ids = both
    ours.cfg.vllm_importance_sampling_correction, ours.cfg.off_policy_mask_threshold = False, None
    try:
        with torch.no_grad():
            batch, metrics = ours._sample_and_score(rows, prompt_ids, G, train=True)
    finally:
        ours.cfg.vllm_importance_sampling_correction = True
    assert "old_per_token_logps" not in batch and "importance_sampling_ratio" not in batch
    assert not any(k.startswith("sampling/") for k in metrics)



@pytest.mark.parametrize("fields,message", [
    ({"vllm_importance_sampling_mode": "token"}, "vllm_importance_sampling_mode must be one of"),
    ({"vllm_importance_sampling_clip_min": 3.0}, "clip_min .* must be less than"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
     "needs vllm_importance_sampling_clip_min or"),
    ({"loss_type": "vespo"}, "set vllm_importance_sampling_mode to token_truncate"),
    ({"dynamic_sampling_max_rounds": -1}, "dynamic_sampling_max_rounds must be >= 0"),
])
def test_bad_correction_and_dynamic_settings_name_the_fix(fields, message):
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        GRPOConfig(per_device_train_batch_size=8, num_generations=4, **fields)


def test_trls_deprecated_cap_sets_clip_max():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        assert GRPOConfig(per_device_train_batch_size=8, num_generations=4,
                          vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0


@pytest.mark.parametrize("backend", ["posttrain", "hf"])
def test_sampler_logprobs_are_over_the_full_vocabulary_not_the_top_k_support(backend):
    """What differs from TRL 1.16 with vLLM (processed_logprobs, renormalized over the top-k/top-p support):
    posttrain's sampler reports log softmax(logits / temperature) over the whole vocabulary, the training
    forward's definition, so the kept-mass term is not in the ratio; both backends (hf: generate's logits)."""
    from transformers import AutoModelForCausalLM

    from posttrain.rollout import Rollout, SamplingParams, filter_logits
    from posttrain.trainers.online import completion_logps

    tok = tiny.load_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor([tok("the cat is")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    sampling = SamplingParams(max_new_tokens=4, pad_token_id=tok.pad_token_id, temperature=0.7, top_k=3)
    out = Rollout(None, "policy", sampling, max_batch=2, max_prompt_len=ids.shape[1], model=model,
                  backend=backend).generate(ids, mask)
    full_mask = torch.cat([mask, out.completion_mask], 1)
    full, _ = completion_logps(model, out.sequences, full_mask, 4, 0.7)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].float()
    kept = torch.log_softmax(filter_logits(logits / 0.7, 3, 1.0), -1).gather(-1, out.completion_ids.unsqueeze(-1))[..., 0]
    valid = out.completion_mask.bool()
    assert (out.logprobs - full)[valid].abs().max() < TOL
    gap = (kept - out.logprobs)[valid]  # minus the log of the top-3 mass: never below 0, here up to ~2
    assert (gap > -TOL).all() and gap.max() > 0.5



def test_correction_in_the_loss_equals_a_separate_old_forward(tmp_path_factory, monkeypatch):
    """A generation batch trained within one optimizer step (two micro-batches, each trained twice: num_iterations
    2): the correction reads the loss forward's own log-probs. Per mode, the step's loss, its ``sampling/*`` over
    the whole generation batch and every micro-batch's gradients equal those with the old log-probs' own forward
    (forced, as where a generation batch outlives its step), and that forward is gone."""
    from posttrain.trainers import grpo
    from posttrain.trainers.off_policy import IS_MODES
    from posttrain.trainers.online import completion_logps

    tok = tiny.load_tokenizer()
    _, completions, noise = fixed_rollout(tok)
    c = torch.full((len(completions), N), tok.pad_token_id)
    m = torch.zeros_like(c)
    for i, ci in enumerate(completions):
        c[i, : len(ci)], m[i, : len(ci)] = torch.tensor(ci), 1
    grads, forwards = {False: [], True: []}, {False: 0, True: 0}

    def trainer(separate):
        cfg = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("steps")), single_process_engine="torch",
                         per_device_train_batch_size=G, num_generations=G, gradient_accumulation_steps=4,
                         steps_per_generation=2, num_iterations=2, max_completion_length=N, temperature=TEMPERATURE,
                         save_strategy="no", report_to=[])
        t = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=token_reward, args=cfg,
                        train_dataset=[{"prompt": p} for p in ("the cat is", "my old friend felt")])
        policy = t.session.engines["policy"]

        def generate(ids, mask):  # the fixed completions; the sampler's log-probs near the current policy's
            lp, _ = completion_logps(policy, torch.cat([ids, c], 1), torch.cat([mask, m], 1), N, TEMPERATURE)
            for i, e in enumerate(noise):
                lp[i, : len(e)] += torch.tensor(e)
            return RolloutOutput(sequences=torch.cat([ids, c], 1), completion_ids=c, completion_mask=m, logprobs=lp)

        def step(name, original=t.session.step):  # each micro-batch's accumulated gradients
            grads[separate].append([p.grad.clone() for p in policy.parameters()])
            return original(name)

        t.rollout.generate, t.session.step = generate, step
        assert not t.needs_old_logps()
        if separate:
            t.needs_old_logps = lambda: True
        return t

    pair = {separate: trainer(separate) for separate in (False, True)}
    running = [False]

    def count(*args, **kwargs):
        forwards[running[0]] += 1
        return completion_logps(*args, **kwargs)

    monkeypatch.setattr(grpo, "completion_logps", count)
    for step, mode in enumerate(IS_MODES, 1):
        out = {}
        for separate, t in pair.items():
            t.cfg.vllm_importance_sampling_mode = mode
            t.cfg.vllm_importance_sampling_clip_min = 0.5 if mode.startswith("token") else None
            t.step, running[0] = step - 1, separate
            out[separate] = t.training_step(step)
        new, old = out[False], out[True]
        # Within TOL: the separate forward packs other rows, so its float32 sums round otherwise.
        assert new["loss"] == pytest.approx(old["loss"], abs=TOL, rel=TOL)
        (gen_new,), (gen_old,) = new["generations"], old["generations"]
        sampled = {k for k in gen_old if k.startswith("sampling/")}
        assert len(sampled) == (6 if mode.endswith("mask") else 5)
        assert sampled == {k for k in gen_new if k.startswith("sampling/")}
        for k in sampled:
            assert gen_new[k] == pytest.approx(gen_old[k], abs=TOL, rel=TOL), (mode, k)
        if mode.endswith("mask"):  # the bounds were hit
            assert 0 < gen_new["sampling/masked_fraction"] < 1
        else:
            assert 3.0 == gen_new["sampling/importance_sampling_ratio/max"] or (
                gen_new["sampling/importance_sampling_ratio/min"] == 0.5)
        assert "time/policy_forward" in old["times"] and "time/policy_forward" not in new["times"]
    assert len(grads[False]) == len(grads[True]) == 4 * len(IS_MODES)
    for a, b in zip(grads[False], grads[True]):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=TOL, rtol=TOL), (x - y).abs().max()
    # Four training forwards a step either way; the separate one adds the old log-probs' forward per generation.
    assert forwards == {False: 4 * len(IS_MODES), True: 5 * len(IS_MODES)}
