"""Shared prompt slots (the rollout engine's ``shared_prompt_kv``, posttrain/rollout/prompt_cache.py)
on CPU, fp32: a GRPO group's rows hold their prompt's keys and values once and sample exactly
what rows with their own copies sample, streamed or not; the slots' bookkeeping; the step traced
as CUDA compiles it; the trainers' field and the planner's count."""

import pytest
import torch
from test_rollout import GROUPS, build, rollout, stopping

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rollout.prompt_cache import SharedPrompts, default_prompt_slots


@pytest.fixture(scope="module")
def tok():
    return tiny.load_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return {kind: build(kind, tok) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def grouped(tok):
    """3 prompts x GROUPS generations, each group's rows side by side (GRPO's layout)."""
    enc = tok(["the cat sat on the", "a", "hello world how are you"], return_tensors="pt", padding=True,
              padding_side="left")
    return enc["input_ids"].repeat_interleave(GROUPS, 0), enc["attention_mask"].repeat_interleave(GROUPS, 0)


def run(model, tok, ids, mask, seed=5, **options):
    kv_slots = options.pop("kv_slots", ids.shape[0])
    r = rollout(model, tok, max_batch=ids.shape[0], kv_slots=kv_slots, engine_options=options, **stopping(tok))
    torch.manual_seed(seed)
    return r.generate(ids, mask), r


def same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert (a.logprobs - b.logprobs).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_group_holds_its_prompt_once_and_samples_what_copies_sample(kind, models, tok, grouped):
    """Every row in a slot, rows of a group sharing one prompt slot: the samples and log-probs of
    the default engine (each row its own copy), one prefill per prompt, and the prompts' KV memory
    divided by the group's size (what ``posttrain plan`` counts; the planner in bf16)."""
    from posttrain.planner import memory

    model, (ids, mask) = models[kind], grouped
    copies, rc = run(model, tok, ids, mask)
    shared, rs = run(model, tok, ids, mask, shared_prompt_kv=True, group_size=GROUPS)
    same(copies, shared)
    st = rs.stats
    assert st["shared_prompt_kv"] and st["prefill_rows"] == 3 and st["prefill_sequences"] == 12
    assert not rs.degraded
    n, p, new = ids.shape[0], rc.engine.prompt_len, rc.engine.max_new
    slots = default_prompt_slots(n, GROUPS)
    assert rs.engine.prompts.capacity == slots == 3  # whole groups: one slot each
    per_column = rc.engine.cache_nbytes // (n * (p + new))
    assert st["prompt_kv_bytes"] == slots * p * per_column  # against the copies' n * p
    assert st["kv_cache_bytes"] == rs.engine.cache_nbytes == (n * new + slots * p) * per_column
    if kind == "llama":  # the tiny default's shape
        size = memory.model_size(str(tiny.sft_model_path()))
        assert rs.engine.cache_nbytes == 2 * memory.kv_cache_bytes(size, n, p + new, slots, p)
        assert rc.engine.cache_nbytes == 2 * memory.kv_cache_bytes(size, n, p + new)
    # Rows of one group still sample differently (their own noise).
    assert len({tuple(r.tolist()) for r in shared.completion_ids[:GROUPS]}) > 1


def test_a_group_split_across_waves_joins_its_prompt_slot(models, tok, grouped):
    """5 row slots and 2 prompt slots for 12 sequences: later rows of a group in flight join its
    prompt slot with no second prefill, rows wait for a free prompt slot, finished rows leave the
    step, and each sequence samples what it samples alone."""
    model, (ids, mask) = models["llama"], grouped
    copies, _ = run(model, tok, ids, mask, seed=6)
    streamed, r = run(model, tok, ids, mask, seed=6, shared_prompt_kv=True, group_size=GROUPS, prompt_slots=2,
                      kv_slots=5, smallest_bucket=1, length_bucket=4, sync_every=2)
    same(copies, streamed)
    st = r.stats  # (seed 6: a group whose rows all finish before its later rows enter is prefilled again)
    assert st["prompt_joins"] == 3 and st["prefill_rows"] == 3 and st["admissions"] == 4, st
    assert st["compactions"] > 0 and st["prompt_compactions"] > 0, st
    assert r.engine.prompts.capacity == 2 and len(r.engine.slots) == 5


def test_more_rows_of_a_prompt_than_its_slot_has_places(models, tok, grouped):
    """Groups of 4 rows in prompt slots of 2 places: each group takes two slots (two prefills of
    its prompt), with the same samples; and a group size of 1 is every row with its own prompt."""
    model, (ids, mask) = models["qwen2"], grouped
    copies, _ = run(model, tok, ids, mask)
    halves, r = run(model, tok, ids, mask, shared_prompt_kv=True, group_size=2)
    same(copies, halves)
    assert r.stats["prefill_rows"] == 6
    ones, r = run(model, tok, ids, mask, shared_prompt_kv=True, group_size=1, kv_slots=3, smallest_bucket=1)
    same(copies, ones)
    assert r.engine.prompts.capacity == 3 and r.stats["prefill_rows"] == 12


def test_prompt_slots_bookkeeping():
    """SharedPrompts on its own: who fits, places, the index tensors the step reads, leaving, and
    compaction into the smallest bucket of slots (the moved slot's keys, mask and logits with it)."""
    from posttrain.rollout.decoder import DecoderSpec

    spec = DecoderSpec(heads=2, kv_heads=1, head_dim=4, scaling=0.5, eps=1e-6, rope_scaling=1.0,
                       act=torch.nn.functional.silu, vocab=7)
    sp = SharedPrompts(spec, layers=2, prompt_slots=4, group_size=2, max_prompt_len=3, slots=8, dtype=torch.float32,
                       device=torch.device("cpu"))
    assert sp.buckets == [1, 2, 4] and sp.bucket() == 1
    # Groups 0,0,0 need two slots; then 1 takes a third and 2 a fourth; a fifth group does not fit.
    assert sp.fits([0, 0, 0, 1, 2, 3]) == 5
    placed, taken = sp.enter([0, 1, 2, 3, 4], [0, 0, 0, 1, 2])
    assert placed == [0, 0, 1, 2, 3] and taken == [(0, 0), (1, 2), (2, 3), (3, 4)]
    assert sp.members.tolist() == [[0, 1], [2, 8], [3, 8], [4, 8]]
    assert sp.place.tolist()[:5] == [0, 1, 2, 4, 6]
    assert sp.fits([0, 1, 3]) == 2  # 0 joins slot 1, 1 joins slot 2, 3 finds no free slot
    for i in range(2):
        sp.keys[i][3].fill_(3.0)
    sp.valid[3].fill_(True)
    sp.logits[3].fill_(1.5)
    sp.leave([0, 1, 2, 3])  # slots 0, 1 and 2 are free again
    assert sp.owner == [None, None, None, 2] and sp.bucket() == 4
    assert sp.compact(width=3) and sp.bucket() == 1
    assert sp.owner == [2, None, None, None] and sp.where == {4: (0, 0)} and sp.place[4].item() == 0
    assert sp.members.tolist()[0] == [4, 8]
    assert sp.keys[1][0].eq(3.0).all() and sp.valid[0].all() and sp.logits[0].eq(1.5).all()
    assert not sp.compact(width=3)
    sp.move_rows([4], [0])
    assert sp.where == {0: (0, 0)} and sp.members.tolist()[0] == [0, 8]
    sp.reset()
    assert sp.owner == [None] * 4 and sp.members.eq(8).all()


def test_sdpa_with_its_log_sum_exp():
    """decoder.sdpa_lse: SDPA's output and the scores' log-sum-exp under an additive mask; a row
    whose every key is masked gives 0 and float32's lowest, as the explicit parts do."""
    from posttrain.rollout.decoder import sdpa_lse

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    bias = torch.zeros(3, 1, 1, 10)
    bias[0, ..., 7:] = float("-inf")
    bias[2] = float("-inf")
    out, lse = sdpa_lse(q, k, v, bias, 0.25)
    scores = q @ k.transpose(-1, -2) * 0.25 + bias
    live = slice(0, 2)
    assert torch.allclose(out[live], (scores[live].softmax(-1) @ v[live]), atol=1e-5)
    assert torch.allclose(lse[live], scores[live].logsumexp(-1), atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] == torch.finfo(torch.float32).min).all()


def test_the_shared_step_traces_as_cuda_compiles_it(models, tok, grouped):
    """The step with shared prompt slots compiled as on CUDA (fullgraph, dynamic shapes; aot_eager
    here), its two parts by SDPA's kernels: no fallback, the eager default's samples (every row to
    the end: one bucket, one compile)."""
    from torch._dynamo.backends.registry import lookup_backend

    model, (ids, mask) = models["qwen2"], grouped
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def go(**options):
        r = rollout(model, tok, max_batch=ids.shape[0], engine_options=options)
        torch.manual_seed(5)
        return r.generate(ids, mask), r

    copies, _ = go()
    torch._dynamo.reset()
    out, r = go(shared_prompt_kv=True, group_size=GROUPS, compile_backend=backend)
    torch._dynamo.reset()
    st = r.stats
    assert st["compiled"] and graphs and not r.degraded and not st["fallback_reasons"], st
    same(copies, out)


def small_grpo_config(out, **kw):
    """Two GRPO steps of the tiny SFT model, groups of 4, 6 new tokens: a rollout setting's run."""
    from posttrain.trainers.grpo import GRPOConfig

    return GRPOConfig(output_dir=str(out), beta=0.04, learning_rate=5e-2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no",
                      disable_tqdm=True, **kw)


def small_grpo(out, peft_config=None, **kw):
    """:func:`small_grpo_config`'s trainer on the tiny SFT model, the bundled reward and 16 bundled prompts."""
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOTrainer

    return GRPOTrainer(str(tiny.sft_model_path()), reward_funcs="posttrain.demo.synthetic.sentiment_reward",
                       args=small_grpo_config(out, **kw), train_dataset=bundled_prompts(16), peft_config=peft_config)


def trained_rows(trainer) -> list[dict]:
    """Train; the logged rows (one a step), TRL's ``state.log_history``."""
    trainer.train()
    trainer.end()
    return trainer.state.log_history


def test_generation_shared_prompt_kv_is_a_config_field(tmp_path):
    """``RolloutFields.generation_shared_prompt_kv``: checked by its flag; GRPO passes its
    num_generations as the group size, and trains as it does without it; ``posttrain plan``
    counts the smaller cache."""
    from posttrain.planner import memory
    from posttrain.rollout.api import engine_options

    cfg = small_grpo_config

    with pytest.raises(ConfigError, match="--generation_shared_prompt_kv"):
        cfg(tmp_path / "bad", generation_shared_prompt_kv="yes")
    assert engine_options(cfg(tmp_path / "o", generation_shared_prompt_kv=True)) == {
        "lora_mode": "auto", "shared_prompt_kv": True, "group_size": 4}
    runs = {}
    for on in (False, True):
        # The sampler correction off: the two cache layouts' sampler log-probs differ by float32 rounding, which
        # the correction would carry into the updates (lr 5e-2); the samples and their training are compared.
        trainer = small_grpo(tmp_path / str(on), generation_shared_prompt_kv=on,
                             vllm_importance_sampling_correction=False)
        runs[on] = trained_rows(trainer)
        assert trainer.rollout.stats["shared_prompt_kv"] is on
    for a, b in zip(runs[False], runs[True]):
        for k in ("reward", "kl", "loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k
    size = memory.model_size(str(tiny.sft_model_path()))
    plans = {g: memory.plan("grpo", str(tiny.sft_model_path()), "zero2-zero3", world_size=1, micro_batch=8,
                            seq_len=32, response_len=16, shared_prompt_group=g) for g in (None, 4)}
    saved = plans[None].roles[0].rollout - plans[4].roles[0].rollout
    assert saved == memory.kv_cache_bytes(size, 8, 32) - memory.kv_cache_bytes(size, 8, 32, 2, 16) > 0
    assert default_prompt_slots(8, 4) == 2 and default_prompt_slots(6, 4) == 3 and default_prompt_slots(5, 1) == 5
    # Groups of one (PPO: one completion a prompt) hold as many prompts as rows: the same bytes.
    ppo = [memory.plan("ppo", str(tiny.sft_model_path()), "zero2-zero3", world_size=1, micro_batch=8, seq_len=32,
                       response_len=16, shared_prompt_group=g).roles[0].rollout for g in (None, 1)]
    assert ppo[0] == ppo[1]
