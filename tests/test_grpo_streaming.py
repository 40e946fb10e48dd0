"""Streaming generation (``async_generation``), in this process: a sequence decoding across a weight update
samples each token under the weights of its step (the engine against transformers token by token); with
``max_staleness`` 0 the run is the synchronous run; with 1 it is deterministic, bounded and resumes exactly
from a checkpoint; with stale_groups drop, stale groups are dropped and their slots freed, with wait none is; settings
that cannot stream are refused.
Two processes (placements, resume) are in tests/dist/grpo_checks.py."""

import copy
import re

import pytest
import torch

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.sampling import choose_tokens
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

G, N = 4, 8
PROMPTS = bundled_prompts(16)


def reward(completion_ids, **_):
    return [float(sum(c) % 7) for c in completion_ids]


def fields(tmp, **extra):
    return {**dict(output_dir=str(tmp), per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                   max_steps=4, logging_steps=1, save_strategy="no", seed=3), **extra}


def train(config_cls=GRPOConfig, trainer_cls=GRPOTrainer, peft_config=None, eval_dataset=None, **kw):
    t = trainer_cls(str(tiny.sft_model_path()), reward_funcs=reward, args=config_cls(**kw), train_dataset=PROMPTS,
                    peft_config=peft_config, eval_dataset=eval_dataset)
    t.train()
    t.end()
    rows = Rows(r for r in t.state.log_history if "loss" in r)
    rows.evals = [r for r in t.state.log_history if "eval/reward" in r]
    return rows, [p.detach().clone() for p in t.session.unwrap("policy").parameters()]


class Rows(list):
    """The training rows of a run's log, with its evaluation rows as ``evals``."""

    evals: list


def hybrid_reference(models, switch, ids, mask, key, steps):
    """Each sequence alone through transformers' forward, one token at a time: the token fed at decode step j
    (its keys and values, and the next token's logits) under ``models[j >= switch]``."""
    from transformers import DynamicCache

    out = []
    for i in range(ids.shape[0]):
        prompt, comp, lps = ids[i][mask[i].bool()].tolist(), [], []
        cache, fed = DynamicCache(), 0
        while len(comp) < steps:
            seq = prompt + comp
            model = models[len(comp) >= switch]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[fed:]]), past_key_values=cache, use_cache=True).logits[:, -1]
            fed = len(seq)
            t, lp = choose_tokens(logits, torch.tensor([len(comp)]), torch.tensor(key), seq=torch.tensor([i]),
                                  temperature=1.0, do_sample=True)
            comp.append(int(t))
            lps.append(float(lp))
        out.append((comp, lps))
    return out


def test_a_sequence_decoding_across_a_weight_update_samples_under_each_steps_weights():
    """Batch A decodes one round (the prefill's token and 16 steps) under the old weights, the weights change in
    place, and it finishes under the new ones with the keys and values it had; batch B, waiting for slots,
    runs wholly under the new weights. Tokens exact, log-probs within 1e-5 of transformers."""
    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny.model_config()).eval()
    enc = tok(["the cat sat on the", "a", "hello world how are you", "we went to"], return_tensors="pt",
              padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    steps = 24
    r = Rollout(None, "policy", SamplingParams(max_new_tokens=steps, pad_token_id=tok.pad_token_id, temperature=1.0),
                max_batch=4, max_prompt_len=ids.shape[1], model=model, kv_slots=2)
    stream = r.open_stream()
    a, b = stream.submit(ids[:2], mask[:2]), stream.submit(ids[2:], mask[2:])
    assert stream.advance() and stream.live == 2 and stream.waiting == 2 and a.admitted_at == [0, 0]
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stream.weights_changed()
    while stream.advance():
        pass
    assert a.finished == b.finished == [True, True] and b.admitted_at == [1, 1] and stream.idle
    assert not stream.scheduler.rows  # finished sequences leave the scheduler (a long stream holds no old batch)
    switch = 1 + r.engine.sync_every  # the prefill's token and one round of steps ran under the old weights
    for batch, got_ids, got_mask, sw in ((a, ids[:2], mask[:2], switch), (b, ids[2:], mask[2:], 0)):
        want = hybrid_reference((old, model), sw, got_ids, got_mask, batch.key, steps)
        for i, (comp, lps) in enumerate(want):
            assert batch.tokens[i].tolist() == comp
            assert torch.allclose(batch.logprobs[i], torch.tensor(lps), atol=1e-5)
    # The update took effect: A's tail differs from the same sequences decoded under the old weights alone.
    unchanged = hybrid_reference((old, old), steps, ids[:2], mask[:2], a.key, steps)
    assert any(a.tokens[i].tolist() != unchanged[i][0] for i in range(2))


def test_groups_are_admitted_whole_so_each_starts_under_one_version():
    """A stream of groups of 4 through 6 slots admits a whole group at a time (4, not 6, at first); after the
    weights change mid-stream every group's rows carry one version, so none goes stale for rows that waited for
    slots. Without groups (group_size 1) the free slots fill as before."""
    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny.model_config()).eval()
    enc = tok(["the cat sat on the", "a", "hello world how are you"], return_tensors="pt", padding=True,
              padding_side="left")
    ids, mask = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(4, 0)
    for group_size, first in ((4, 4), (1, 6)):
        r = Rollout(None, "policy", SamplingParams(max_new_tokens=24, pad_token_id=tok.pad_token_id, temperature=1.0),
                    max_batch=12, max_prompt_len=ids.shape[1], model=model, kv_slots=6)
        stream = r.open_stream(group_size)
        batch = stream.submit(ids, mask)
        assert stream.advance() and stream.live == first and stream.waiting == 12 - first
        stream.weights_changed()
        while stream.advance():
            pass
        assert all(batch.finished)
        versions = [set(batch.admitted_at[g : g + 4]) for g in range(0, 12, 4)]
        if group_size == 4:
            assert all(len(v) == 1 for v in versions) and versions[0] == {0}
        else:  # the second group's first two rows started under version 0, the rest later
            assert versions[1] == {0, 1}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "grpo-lora"])
def test_staleness_zero_is_the_synchronous_run(tmp_path, algorithm):
    """max_staleness 0 admits one generation batch at a time and trains it whole: the same samples, losses and
    final weights as the synchronous trainer (LoRA: the engine's merged adapters refreshed after each step)."""
    from peft import LoraConfig

    classes = (RLOOConfig, RLOOTrainer) if algorithm == "rloo" else (GRPOConfig, GRPOTrainer)
    extra = {}
    if algorithm == "grpo-lora":
        extra = dict(learning_rate=2e-2, peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                                lora_dropout=0.0))
    sync = train(*classes, **fields(tmp_path / "sync"), **extra)
    streamed = train(*classes, **fields(tmp_path / "s0", async_generation=True, max_staleness=0), **extra)
    assert [r["loss"] for r in sync[0]] == [r["loss"] for r in streamed[0]] and len(sync[0]) == 4
    assert [r["reward"] for r in sync[0]] == [r["reward"] for r in streamed[0]]
    assert all(torch.equal(x, y) for x, y in zip(sync[1], streamed[1]))
    assert all(r["sample/staleness_max"] == 0 and r["streaming/dropped_groups"] == 0 for r in streamed[0])


def test_sleep_mode_frees_the_engine_while_training_and_changes_nothing(tmp_path):
    """vllm_enable_sleep_mode (TRL's flag): the engine frees its KV cache after each generation batch and allocates
    it again for the next; the run's losses and weights are those of the run without it."""
    awake = train(**fields(tmp_path / "awake", max_steps=2))
    asleep = train(**fields(tmp_path / "asleep", max_steps=2, vllm_enable_sleep_mode=True))
    assert [r["loss"] for r in awake[0]] == [r["loss"] for r in asleep[0]] and len(awake[0]) == 2
    assert all(torch.equal(x, y) for x, y in zip(awake[1], asleep[1]))
    assert [r["rollout/sleeps"] for r in asleep[0]] == [1, 2] and awake[0][-1]["rollout/sleeps"] == 0


def test_streaming_is_deterministic_bounded_and_resumes_exactly(tmp_path):
    """max_staleness 2 through 4 slots (groups wait, start and finish across steps): two runs log the same rows
    (the stream drains before each checkpoint and evaluation, so runs compare at the same save_steps and
    eval_steps), trained groups are at most 2 updates old and some are older than 0; an evaluation at step 3 runs
    the engine's own rollout once the stream drained; resumed from its step-2 checkpoint (which holds finished,
    untrained groups, saved per rank), steps 3-4 are the uninterrupted run's."""
    stream = dict(async_generation=True, max_staleness=2, generation_kv_slots=4, max_completion_length=12,
                  save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=3,
                  per_device_eval_batch_size=8)
    evals = PROMPTS[:4]
    first, w1 = train(eval_dataset=evals, **fields(tmp_path / "a", **stream))
    again, w2 = train(eval_dataset=evals, **fields(tmp_path / "b", **stream))
    keys = ["loss", "reward", "sample/staleness_mean", "sample/staleness_max", "streaming/dropped_groups",
            "completions/mean_length"]
    assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in again]
    assert all(torch.equal(x, y) for x, y in zip(w1, w2))
    assert 0 < max(r["sample/staleness_max"] for r in first) <= 2
    assert [r["step"] for r in first.evals] == [3, 4] and first.evals == again.evals
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "state" / "streaming_rank0.pt", weights_only=True)
    assert saved["version"] == 2 and len(saved["ready"]) == 2
    resumed, w3 = train(eval_dataset=evals, **fields(tmp_path / "a", resume_from_checkpoint=str(
        tmp_path / "a" / "checkpoint-2"), **stream))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [[r[k] for k in keys] for r in resumed[2:]] == [[r[k] for k in keys] for r in first[2:]]
    assert all(torch.equal(x, y) for x, y in zip(w1, w3)) and resumed.evals == first.evals


def test_stale_groups_are_dropped_and_their_slots_freed(tmp_path):
    """stale_groups drop: groups started under version 0 and unfinished when the weights reach version 2
    (max_staleness 1) are dropped, their slots freed and counted; groups not yet started are not stale."""
    cfg = GRPOConfig(**fields(tmp_path, async_generation=True, max_staleness=1, generation_kv_slots=4,
                              max_completion_length=40, stale_groups="drop"))
    t = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=reward, args=cfg, train_dataset=PROMPTS)
    st = t.streaming
    st._submit()
    st._submit()
    assert st.stream.advance() and st.stream.live == 4 and st.stream.waiting == 12
    st.weights_changed()
    assert st.dropped == 0 and st.stream.live == 4
    st.weights_changed()  # the one started group is 2 updates old now
    assert st.dropped == st.dropped_total == 1 and st.stream.live == 0
    assert st.stream.waiting == 12 and [c for _, _, c in st.pending] == [[True, False], [False, False]]
    t.end()


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_stale_groups_on_long_tailed_completions(tmp_path, policy):
    """The engine and trainer at max_staleness 1 on completions of long-tailed lengths (a random model whose
    completions end on a 25th of the vocabulary, up to 128 tokens; one group a step through 8 slots): "drop" (TRL
    AsyncGRPO's way) drops groups whose long member outlives two updates; "wait" drops none, and every trained group
    is within the bound either way. tests/test_streaming_policy.py holds the policies' exact scenarios."""
    import dataclasses

    cfg = GRPOConfig(**fields(tmp_path, async_generation=True, max_staleness=1, generation_kv_slots=8,
                              max_completion_length=128, stale_groups=policy, max_steps=20,
                              per_device_train_batch_size=G))
    t = GRPOTrainer(str(tiny.model_path()), reward_funcs=reward, args=cfg, train_dataset=bundled_prompts(64))
    stops = list(range(3, t.session.unwrap("policy").config.vocab_size, 25))
    t.rollout.sampling = dataclasses.replace(t.rollout.sampling, stop_token_ids=stops)
    t.sampling, t.eos_ids = t.rollout.sampling, stops  # what truncation reads, as benchmarks/races do
    t.train()
    t.end()
    rows = [r for r in t.state.log_history if "loss" in r]
    dropped = sum(r["streaming/dropped_groups"] for r in rows)
    assert len(rows) == 20 and max(r["sample/staleness_max"] for r in rows) <= 1
    assert max(r["completions/max_length"] for r in rows) > 64  # the long tail is there
    held = sum(r["streaming/held_rounds"] for r in rows)  # rounds decoded only to keep the bound
    assert (dropped > 0 == held) if policy == "drop" else (dropped == 0 == t.streaming.dropped_total < held)


@pytest.mark.parametrize("extra,needs", [
    (dict(generation_backend="hf"), "generation_backend posttrain"),
    (dict(num_iterations=2), "num_iterations 1"),
    (dict(steps_per_generation=2), "steps_per_generation equal to gradient_accumulation_steps"),
    (dict(dynamic_sampling=True), "dynamic_sampling false"),
    (dict(max_inflight_tasks=4), "max_inflight_tasks -1 or at least one step's completions (8)"),
    (dict(max_staleness=-1), "max_staleness must be a whole number >= 0"),
    (dict(weight_sync_steps=2), "weight_sync_steps other than 1 needs separate generation ranks"),
    (dict(vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode false"),
    (dict(stale_groups="later"), "stale_groups must be one of wait, drop"),
    (dict(max_staleness=1, max_inflight_tasks=24), "max_inflight_tasks 24 starts more sequences than the "
     "max_staleness + 1 steps that may train them take (16)"),
])
def test_settings_that_cannot_stream_are_refused_by_name(tmp_path, extra, needs):
    kw = {**fields(tmp_path, async_generation=True), **extra}
    with pytest.raises(ConfigError, match=re.escape(needs)):
        GRPOConfig(**kw)
