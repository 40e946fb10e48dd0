"""The rollout engine (posttrain/rollout/) on CPU, fp32: the same step logic that CUDA compiles
and captures, run eagerly (or traced with aot_eager). Single process except the ZeRO checks
(tests/dist/rollout_checks.py)."""

import logging

import pytest
import torch
from conftest import run_json
from transformers import GenerationConfig

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rollout import Rollout, SamplingParams, choose_tokens, filter_logits, unsupported_reason
from posttrain.rollout.sampling import gumbel_from_bits

N = 10  # new tokens


@pytest.fixture(scope="module")
def tok():
    return tiny.load_tokenizer()


def build(kind: str, tok):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tiny.model_config()
    else:  # another architecture: q/k/v biases and tied embeddings
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if kind == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module")
def models(tok):
    return {kind: build(kind, tok) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def prompts(tok):
    enc = tok(["the cat sat on the", "a", "hello world how are you", "we went to"], return_tensors="pt",
              padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def rollout(model, tok, backend="posttrain", max_batch=6, max_prompt_len=18, kv_slots=None, engine_options=None,
            **knobs):
    knobs.setdefault("max_new_tokens", N)
    sampling = SamplingParams(pad_token_id=tok.pad_token_id, **knobs)
    return Rollout(None, "policy", sampling, max_batch=max_batch, max_prompt_len=max_prompt_len, backend=backend,
                   model=model, kv_slots=kv_slots, engine_options=engine_options)


def forward_logprobs(model, out, mask, temperature=1.0):
    """Log-probs of the completion under one forward pass over the produced sequences."""
    full = torch.cat([mask, out.completion_mask], 1)
    positions = (full.cumsum(1) - 1).clamp(min=0)
    p = mask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=full, position_ids=positions).logits[:, p - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, out.completion_ids.unsqueeze(-1))[..., 0]
    return logp.masked_fill(out.completion_mask == 0, 0.0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_equals_generate_and_logprobs_equal_forward(kind, models, tok, prompts):
    model, (ids, mask) = models[kind], prompts
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
    r = rollout(model, tok, do_sample=False)
    out = r.generate(ids, mask)
    assert r.stats["backend"] == "posttrain" and r.stats["fallback"] is None
    assert not r.engine.graphs and r.stats["captures"] == 0  # CPU: the step runs eagerly
    assert torch.equal(out.sequences, ref)
    assert out.completion_mask.all()
    assert (forward_logprobs(model, out, mask) - out.logprobs).abs().max().item() < 1e-5
    # A second rollout reuses the buffers: same result.
    assert torch.equal(r.generate(ids, mask).sequences, ref)


def test_sampled_logprobs_and_backends_agree(models, tok, prompts):
    """Sampled tokens' log-probs equal a forward pass at the temperature; the hf backend (transformers'
    generate with the same keyed Gumbel sampler) gives the same samples for the same seed."""
    model, (ids, mask) = models["llama"], prompts
    knobs = dict(temperature=0.7, top_k=40, top_p=0.9, stop_token_ids=[tok.eos_token_id])
    outs = {}
    for backend in ("posttrain", "hf"):
        torch.manual_seed(3)
        outs[backend] = rollout(model, tok, backend, **knobs).generate(ids, mask)
        lp = forward_logprobs(model, outs[backend], mask, temperature=0.7)
        assert (lp - outs[backend].logprobs).abs().max().item() < 1e-5
    assert torch.equal(outs["posttrain"].sequences, outs["hf"].sequences)
    assert (outs["posttrain"].logprobs - outs["hf"].logprobs).abs().max().item() < 1e-5
    # A model whose generation config carries sampling defaults (an instruct model's repetition penalty and
    # the like): transformers would fill the call's unset fields with them; the hf backend samples as before.
    saved = model.generation_config
    model.generation_config = GenerationConfig(repetition_penalty=3.0, no_repeat_ngram_size=2, do_sample=True,
                                               suppress_tokens=[int(outs["hf"].completion_ids[0, 0])])
    try:
        torch.manual_seed(3)
        again = rollout(model, tok, "hf", **knobs).generate(ids, mask)
    finally:
        model.generation_config = saved
    assert torch.equal(again.sequences, outs["hf"].sequences) and model.generation_config is saved


def test_same_seed_same_samples(models, tok, prompts):
    model, (ids, mask) = models["llama"], prompts
    r = rollout(model, tok)

    def sample(seed):
        torch.manual_seed(seed)
        return r.generate(ids, mask).completion_ids

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Successive rollouts of a run draw new keys: different samples.
    torch.manual_seed(1)
    first, second = r.generate(ids, mask).completion_ids, r.generate(ids, mask).completion_ids
    assert torch.equal(first, a) and not torch.equal(first, second)


def test_a_sleeping_engine_frees_its_cache_and_samples_the_same(models, tok, prompts):
    """vllm_enable_sleep_mode: the engine's KV cache is freed between rollouts (its storage 0 bytes) and the next
    rollout allocates it again; the samples and log-probs are those of an engine that never slept."""
    model, (ids, mask) = models["llama"], prompts
    awake, sleeper = rollout(model, tok), rollout(model, tok)
    outs = {}
    for name, r in (("awake", awake), ("sleeper", sleeper)):
        torch.manual_seed(3)
        outs[name] = [r.generate(ids, mask)]
        if r is sleeper:
            r.sleep()
            cache = r.engine.slots.keys + r.engine.slots.values
            assert all(t.untyped_storage().nbytes() == 0 for t in cache) and not r.engine.graphs
        outs[name].append(r.generate(ids, mask))
    for a, b in zip(outs["awake"], outs["sleeper"]):
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)
    assert sleeper.stats["sleeps"] == 1 and sleeper.metrics()["rollout/sleeps"] == 1
    assert all(t.untyped_storage().nbytes() > 0 for t in sleeper.engine.slots.keys)


def test_knobs_change_without_a_new_engine(models, tok, prompts):
    """Temperature, do_sample, top_p and min_new_tokens are buffers of the step: one engine (one
    graph on CUDA) serves greedy and sampled rollouts."""
    model, (ids, mask) = models["llama"], prompts
    r = rollout(model, tok, top_p=0.95)
    sampled = r.generate(ids, mask)
    engine = r.engine
    greedy = r.generate(ids, mask, SamplingParams(max_new_tokens=N, pad_token_id=tok.pad_token_id, do_sample=False,
                                                  top_p=0.9, temperature=0.5))
    assert r.engine is engine
    want = rollout(model, tok, do_sample=False, temperature=0.5).generate(ids, mask)
    assert torch.equal(greedy.sequences, want.sequences) and not torch.equal(greedy.sequences, sampled.sequences)
    assert torch.allclose(greedy.logprobs, want.logprobs)


def test_live_weights_and_moved_storage(tok, prompts):
    """An in-place change is read by the next rollout with nothing re-pointed; replaced storage is
    detected (on CUDA the graph is captured again) and read too."""
    model, (ids, mask) = build("llama", tok), prompts
    r = rollout(model, tok, do_sample=False)
    before = r.generate(ids, mask)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    scaled = r.generate(ids, mask)
    assert r.stats["storage_moves"] == 0
    assert (forward_logprobs(model, scaled, mask) - scaled.logprobs).abs().max().item() < 1e-5
    assert not torch.allclose(before.logprobs, scaled.logprobs)
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data * 2.0  # new storage
    moved = r.generate(ids, mask)
    assert r.stats["storage_moves"] == 1
    assert (forward_logprobs(model, moved, mask) - moved.logprobs).abs().max().item() < 1e-5


def test_planner_counts_the_engine():
    """posttrain plan: the engine keeps its KV cache (and graph pool, and a ZeRO-3 policy's copy)
    for the run; transformers' generate holds them only while it generates."""
    from posttrain.planner import memory

    size = memory.model_size("1b")
    kv = memory.kv_cache_bytes(size, 8, 512)
    assert kv == 2 * 22 * 4 * 64 * 8 * 512 * 2  # 2 * layers * kv_heads * head_dim * batch * length * bf16
    for mix, stage in (("zero2-zero3", 2), ("zero3", 3)):
        fast = memory.plan("ppo", "1b", mix, world_size=2, micro_batch=8, seq_len=512)
        hf = memory.plan("ppo", "1b", mix, world_size=2, micro_batch=8, seq_len=512, generation_backend="hf")
        policy = fast.roles[0]
        pool = memory.GRAPH_POOL_BYTES_PER_ROW_VOCAB * 8 * size.vocab
        assert policy.rollout == kv + pool + (2 * size.params if stage == 3 else 0)
        assert fast.at_rest - hf.at_rest == policy.rollout
        assert hf.phases["generate"] - fast.phases["generate"] == kv + (2 * size.params if stage == 3 else 0)


def test_planner_counts_the_repetition_penalty(tok, prompts, capsys):
    """``posttrain plan --repetition-penalty``: the engine's per-slot token sets (counted as the engine allocates
    them) and the penalized step's larger pool; nothing without the penalty, and only for GRPO/RLOO."""
    from posttrain import cli
    from posttrain.planner import memory

    model, (ids, mask) = build("llama", tok), prompts
    r = rollout(model, tok, kv_slots=4, repetition_penalty=1.5)
    r.generate(ids, mask)
    seen = r.engine.slots.seen
    assert seen.numel() * seen.element_size() == memory.PENALTY_SEEN_BYTES_PER_ROW_VOCAB * 4 * model.config.vocab_size
    plain = rollout(model, tok, kv_slots=4)
    plain.generate(ids, mask)
    assert plain.engine.slots.seen is None
    size = memory.model_size("1b")
    args = dict(world_size=1, micro_batch=8, seq_len=512, kv_slots=4)
    off, on = (memory.plan("grpo", "1b", "zero2-zero3", repetition_penalty=p, **args) for p in (False, True))
    per = memory.PENALTY_SEEN_BYTES_PER_ROW_VOCAB + memory.PENALTY_POOL_BYTES_PER_ROW_VOCAB
    assert on.roles[0].rollout - off.roles[0].rollout == per * 4 * size.vocab
    asleep = [memory.plan("grpo", "1b", "zero2-zero3", repetition_penalty=p, sleep_mode=True, **args)
              for p in (False, True)]  # the token sets stay; the pool sleeps with the graphs
    assert asleep[1].roles[0].rollout - asleep[0].roles[0].rollout == 4 * size.vocab
    base = ["plan", "--workload", "grpo", "--shape", "1b", "--world-size", "1", "--micro-batch", "8"]
    assert cli.main(base + ["--repetition-penalty", "1.2"]) == 0
    assert cli.main([*base[:2], "dpo", *base[3:], "--repetition-penalty", "1.2"]) == 2
    assert "--repetition-penalty plans grpo or rloo" in capsys.readouterr().err
    assert cli.main(base + ["--repetition-penalty", "0"]) == 2
    assert "repetition_penalty must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_give_the_same_tokens(kind, models, tok, prompts):
    """``fused`` (q|k|v and gate|up copies, refreshed per rollout) decodes the same."""
    model, (ids, mask) = models[kind], prompts
    torch.manual_seed(4)
    plain = rollout(model, tok).generate(ids, mask)
    r = rollout(model, tok, engine_options=dict(fused=True))
    torch.manual_seed(4)
    fused = r.generate(ids, mask)
    assert r.stats["fused_weight_bytes"] > 0
    assert torch.equal(plain.sequences, fused.sequences)
    assert (plain.logprobs - fused.logprobs).abs().max().item() < 1e-5


def test_fused_buffers_are_refreshed_every_rollout(tok, prompts):
    """The fused q|k|v and gate|up copies are rewritten in place at each rollout's start: an
    in-place weight update (an optimizer step) is decoded by the next rollout, nothing re-pointed."""
    model, (ids, mask) = build("llama", tok), prompts
    r = rollout(model, tok, engine_options=dict(fused=True))
    torch.manual_seed(2)
    before = r.generate(ids, mask)
    engine = r.engine
    layer, entry = model.model.layers[1], engine.fused[1]
    ptrs = (entry["qkv"].data_ptr(), entry["gate_up"].data_ptr())
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(1.7)
        layer.mlp.up_proj.weight.add_(0.05)
    torch.manual_seed(2)
    after = r.generate(ids, mask)
    assert r.engine is engine and r.stats["storage_moves"] == 0
    assert (entry["qkv"].data_ptr(), entry["gate_up"].data_ptr()) == ptrs
    attn, mlp = layer.self_attn, layer.mlp
    assert torch.equal(entry["qkv"], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(entry["gate_up"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert (forward_logprobs(model, after, mask) - after.logprobs).abs().max().item() < 1e-5
    assert (before.logprobs - after.logprobs).abs().max().item() > 1e-3
    rows = sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    # The memory cost: those weights once more (fp32 here, no biases).
    assert r.stats["fused_weight_bytes"] == rows * model.config.hidden_size * 4 * len(model.model.layers)


def flat_parameters(model):
    """The parameters made views of one flat buffer in module order, as DeepSpeed's ZeRO-1/2
    optimizer keeps them."""
    params = list(model.parameters())
    flat = torch._utils._flatten_dense_tensors([p.data for p in params])
    for p, view in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.data for p in params])):
        p.data = view


def test_fused_views_of_a_flat_buffer(tok, prompts):
    """Where q|k|v and gate|up lie end to end (a flat buffer), the fused GEMMs read views of the
    live weights by default: no copy, the same tokens, an in-place update decoded by the next
    rollout. A weight re-allocated apart from its group turns fusing off, counted; separately
    allocated weights, or biases between the matrices, are not fused unless asked (copies)."""
    model, (ids, mask) = build("llama", tok), prompts
    r = rollout(model, tok)
    torch.manual_seed(3)
    plain = r.generate(ids, mask)
    assert r.stats["fused_projections"] == "off" and r.stats["fused_weight_bytes"] == 0
    flat_parameters(model)
    r = rollout(model, tok)
    torch.manual_seed(3)
    out = r.generate(ids, mask)
    assert r.stats["fused_projections"] == "views" and r.stats["fused_weight_bytes"] == 0
    assert torch.equal(plain.sequences, out.sequences)
    assert (plain.logprobs - out.logprobs).abs().max().item() < 1e-5
    layer = model.model.layers[1]
    entry = r.engine.weights["layers"][1]
    assert entry["qkv"].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    assert entry["gate_up"].data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(1.7)
        layer.mlp.up_proj.weight.add_(0.05)
    torch.manual_seed(3)
    after = r.generate(ids, mask)
    assert r.stats["storage_moves"] == 0 and not r.degraded
    assert (forward_logprobs(model, after, mask) - after.logprobs).abs().max().item() < 1e-5
    assert (out.logprobs - after.logprobs).abs().max().item() > 1e-3
    up = model.model.layers[0].mlp.up_proj
    up.weight.data = up.weight.data.clone()  # re-allocated: no longer beside gate_proj
    moved = r.generate(ids, mask)
    assert r.stats["fused_fallbacks"] == 1 and r.degraded and r.stats["fused_projections"] == "off"
    assert (forward_logprobs(model, moved, mask) - moved.logprobs).abs().max().item() < 1e-5
    qwen = build("qwen2", tok)
    flat_parameters(qwen)  # q.weight, q.bias, k.weight, ...: the matrices are not end to end
    for options, how in ((None, "off"), ({"fused": True}, "copies")):
        q = rollout(qwen, tok, engine_options=options)
        q.generate(ids, mask)
        assert q.stats["fused_projections"] == how


@pytest.mark.parametrize("fused", [False, True])
def test_the_step_traces_and_decodes_the_same(fused, tok, prompts):
    """The step traced as CUDA compiles it (fullgraph, aot_eager), with and without fused
    projections, samples what the eager default does, with no fallback."""
    model, (ids, mask) = build("qwen2", tok), prompts  # q/k/v biases: the fused bias too
    torch.manual_seed(7)
    eager = rollout(model, tok).generate(ids, mask)
    torch._dynamo.reset()
    r = rollout(model, tok, engine_options=dict(fused=fused, compile_backend="aot_eager", smallest_bucket=2,
                                                 length_bucket=8, sync_every=3))
    torch.manual_seed(7)
    out = r.generate(ids, mask)
    st = r.stats
    assert st["compiled"] and not r.degraded and not st["fallback_reasons"], st
    assert (st["fused_weight_bytes"] > 0) == fused
    assert torch.equal(eager.sequences, out.sequences)
    assert (eager.logprobs - out.logprobs).abs().max().item() < 1e-5
    torch._dynamo.reset()


def test_min_p_samples_alike_eager_traced_and_through_generate(tok, prompts):
    """TRL's min_p (transformers' MinPLogitsWarper, tests below): the engine's eager step, its step traced as CUDA
    compiles it (the torch sampler, since the Triton one has no min-p) and the hf backend sample the same tokens for
    the same seed, the log-probs over the full vocabulary at the temperature; min_p changes what is sampled."""
    model, (ids, mask) = build("llama", tok), prompts
    knobs = dict(temperature=0.5, min_p=0.9)  # the test model is nearly uniform: a high min_p bites
    outs = {}
    for name, backend, options in (("eager", "posttrain", None), ("hf", "hf", None),
                                   ("traced", "posttrain", dict(compile_backend="aot_eager", smallest_bucket=2,
                                                                length_bucket=8, sync_every=3))):
        torch._dynamo.reset()
        torch.manual_seed(5)
        r = rollout(model, tok, backend, engine_options=options, **knobs)
        outs[name] = r.generate(ids, mask)
        assert (forward_logprobs(model, outs[name], mask, temperature=0.5) - outs[name].logprobs).abs().max() < 1e-5
        assert backend == "hf" or not r.degraded
    torch._dynamo.reset()
    assert torch.equal(outs["eager"].sequences, outs["hf"].sequences)
    assert torch.equal(outs["eager"].sequences, outs["traced"].sequences)
    torch.manual_seed(5)
    plain = rollout(model, tok, temperature=0.5).generate(ids, mask)
    assert not torch.equal(plain.sequences, outs["eager"].sequences)


def test_repetition_penalty_samples_alike_eager_traced_streamed_and_through_generate(tok, prompts):
    """TRL's repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor over the prompt, left padding
    skipped, and the sampled tokens): the eager step, the step traced as CUDA compiles it, sequences streamed
    through two slots (moved between slots) and the hf backend sample the same tokens for the same seed; the
    log-probs stay those of the unpenalized distribution at the temperature, the training forward's."""
    model, (ids, mask) = build("llama", tok), prompts
    knobs = dict(temperature=0.5, repetition_penalty=0.05, stop_token_ids=[tok.eos_token_id])  # < 1 rewards repeats
    outs = {}
    for name, backend, options, slots in (
            ("eager", "posttrain", None, None), ("hf", "hf", None, None), ("streamed", "posttrain", None, 2),
            ("traced", "posttrain", dict(compile_backend="aot_eager", smallest_bucket=2, length_bucket=8,
                                         sync_every=3), None)):
        torch._dynamo.reset()
        torch.manual_seed(5)
        r = rollout(model, tok, backend, engine_options=options, kv_slots=slots, **knobs)
        outs[name] = r.generate(ids, mask)
        assert (forward_logprobs(model, outs[name], mask, temperature=0.5) - outs[name].logprobs).abs().max() < 1e-5
        assert backend == "hf" or not r.degraded
    torch._dynamo.reset()
    for name in ("hf", "streamed", "traced"):
        assert torch.equal(outs["eager"].sequences, outs[name].sequences), name
    torch.manual_seed(5)
    plain = rollout(model, tok, temperature=0.5, stop_token_ids=[tok.eos_token_id]).generate(ids, mask)
    assert not torch.equal(plain.sequences, outs["eager"].sequences)
    # Rewarding repeats makes completions repeat their own and their prompt's tokens more than plain sampling.
    def repeats(out):
        return sum(len(row) - len(set(row)) for row in out.completion_ids.tolist())
    assert repeats(outs["eager"]) > repeats(plain)


def test_repetition_penalty_equals_transformers_processor():
    """The penalty as transformers applies it before the temperature, over left-padded rows."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from posttrain.rollout.sampling import seen_tokens

    torch.manual_seed(0)
    ids = torch.tensor([[0, 0, 5, 7, 5], [3, 4, 9, 9, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    logits = torch.randn(2, 12) * 3
    want = RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=(mask == 0).sum(1))(ids, logits.clone())
    for do_sample in (False, True):
        got, _ = choose_tokens(logits, torch.zeros(2, dtype=torch.long), torch.tensor(3), temperature=0.8,
                               do_sample=do_sample, seen=seen_tokens(ids, mask, 12), penalty=1.7)
        ref, _ = choose_tokens(want, torch.zeros(2, dtype=torch.long), torch.tensor(3), temperature=0.8,
                               do_sample=do_sample)
        assert torch.equal(got, ref)
    assert seen_tokens(ids, mask, 12)[0].nonzero().flatten().tolist() == [5, 7]  # padding (0) not seen


def graph_breaking(fn):
    """``fn`` with a graph break first: a part dynamo cannot trace in one graph."""
    def broken(*args):
        torch._dynamo.graph_break()
        return fn(*args)
    return broken


def prepared_policy(how: str, tok):
    """The tiny Llama as a trainer prepares its policy: GRPO/RLOO (TRL's defaults: dropout off,
    gradient checkpointing, TRL's fused LM head, train mode), PPO/distillation (train mode), or a
    frozen role (eval)."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    from posttrain.models.setup import enable_gradient_checkpointing

    model = build("llama", tok)
    if how == "grpo":
        disable_dropout_in_model(model)
        enable_gradient_checkpointing(model)
        add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
        assert model.get_input_embeddings()._forward_hooks  # the hook that broke fullgraph compiles
    return model.train() if how != "frozen" else model.eval()


@pytest.mark.parametrize("how", ["grpo", "ppo", "frozen"])
def test_compiled_step_traces_under_every_trainers_policy(how, tok, prompts):
    """What CUDA compiles before capture traces in whole graphs (fullgraph, aot_eager: dynamo and
    AOTAutograd without code generation) for the policy exactly as each trainer prepares it, with
    no fallback, decodes what the eager step does, and serves new knobs and new buckets without
    a recompile per layer (the layers share one graph per part)."""
    from torch._dynamo.utils import counters

    model, (ids, mask) = prepared_policy(how, tok), prompts
    knobs = dict(top_p=0.9, stop_token_ids=[tok.eos_token_id], min_new_tokens=2)
    torch.manual_seed(1)
    eager = rollout(model, tok, **knobs).generate(ids, mask)
    torch._dynamo.reset()
    counters.clear()
    r = rollout(model, tok, engine_options=dict(compile_backend="aot_eager", smallest_bucket=2, length_bucket=8,
                                                 sync_every=3), **knobs)
    torch.manual_seed(1)
    compiled = r.generate(ids, mask)
    assert r.stats["compiled"] and r.stats["compile_fallbacks"] == 0 and not r.degraded, r.stats
    assert r.metrics()["rollout/compile_fallbacks"] == 0
    assert torch.equal(eager.sequences, compiled.sequences)
    assert (eager.logprobs - compiled.logprobs).abs().max().item() < 1e-5
    r.generate(ids, mask, SamplingParams(max_new_tokens=N, pad_token_id=tok.pad_token_id, do_sample=False,
                                         top_p=0.5, temperature=0.7, **{k: knobs[k] for k in ("stop_token_ids",)}))
    assert r.stats["compile_fallbacks"] == 0
    # Prologue, the layer's two halves, sampler, epilogue: a few graphs (dynamic shapes), not one per
    # layer.
    parts = 5
    assert parts <= counters["stats"]["unique_graphs"] <= 2 * parts, dict(counters["stats"])
    torch._dynamo.reset()


def test_a_compile_that_fails_is_counted_not_silent(tok, prompts, monkeypatch, caplog):
    """A part dynamo cannot trace in one graph: the engine runs the eager step (same tokens), and
    says so in its stats, its metrics and the log; benchmarks mark such rows degraded."""
    from posttrain.rollout import step as step_module

    model, (ids, mask) = build("llama", tok), prompts
    torch.manual_seed(2)
    eager = rollout(model, tok).generate(ids, mask)
    monkeypatch.setattr(step_module, "inputs", graph_breaking(step_module.inputs))
    torch._dynamo.reset()
    r = rollout(model, tok, engine_options=dict(compile_backend="aot_eager"))
    torch.manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout"):
        out = r.generate(ids, mask)
    torch._dynamo.reset()
    assert torch.equal(out.sequences, eager.sequences)
    assert r.stats["compile_fallbacks"] == 1 and not r.stats["compiled"] and r.degraded
    assert r.metrics()["rollout/compile_fallbacks"] == 1
    assert "torch.compile" in r.stats["fallback_reasons"][0]
    assert [rec for rec in caplog.records if "counted" in rec.getMessage()]


def test_top_k_1_is_greedy(models, tok, prompts):
    model, (ids, mask) = models["qwen2"], prompts
    greedy = rollout(model, tok, do_sample=False).generate(ids, mask)
    top1 = rollout(model, tok, top_k=1, temperature=1.3).generate(ids, mask)
    assert torch.equal(greedy.sequences, top1.sequences)


def test_stop_tokens_pad_after_and_min_new_tokens(models, tok, prompts):
    model, (ids, mask) = models["llama"], prompts
    free = rollout(model, tok, do_sample=False).generate(ids, mask).completion_ids
    stop = int(free[0, 2])  # a token the greedy path produces at step 2 of row 0
    out = rollout(model, tok, do_sample=False, stop_token_ids=[stop]).generate(ids, mask)
    for row, (c, m) in enumerate(zip(out.completion_ids, out.completion_mask)):
        hits = (free[row] == stop).nonzero()
        end = int(hits[0]) if len(hits) else N - 1
        assert m.tolist() == [1] * (end + 1) + [0] * (N - end - 1)
        assert c[: end + 1].tolist() == free[row, : end + 1].tolist()  # the stop token itself kept
        assert (c[end + 1 :] == tok.pad_token_id).all()
    assert (out.logprobs[out.completion_mask == 0] == 0).all()
    # min_new_tokens: the stop token is barred from the first 5 positions.
    late = rollout(model, tok, do_sample=False, stop_token_ids=[stop], min_new_tokens=5).generate(ids, mask)
    assert (late.completion_ids[:, :5] != stop).all() and late.completion_mask[:, :5].all()
    # hf backend: transformers' own stopping and min_new_tokens give the same.
    hf = rollout(model, tok, "hf", do_sample=False, stop_token_ids=[stop], min_new_tokens=5).generate(ids, mask)
    assert torch.equal(hf.sequences, late.sequences) and torch.equal(hf.completion_mask, late.completion_mask)


def test_filters_equal_transformers_warpers():
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for k, p, m in ((5, 1.0, None), (0, 0.8, None), (10, 0.5, None), (0, 0.05, None), (0, 1.0, 0.1),
                    (0, 1.0, 0.5), (8, 0.9, 0.2), (0, 1.0, 1.0)):
        want = logits
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        if m:
            want = MinPLogitsWarper(m)(None, want)
        got = filter_logits(logits, k, p, min_p=m)
        assert torch.equal(got.isinf(), want.isinf()), (k, p, m)
        if m:  # as a graph input: a 0-d tensor with the on/off fixed
            assert torch.equal(filter_logits(logits, k, p, min_p=torch.tensor(m), use_min_p=True).isinf(),
                               want.isinf())
            assert (~got.isinf()).sum() < (~filter_logits(logits, k, p).isinf()).sum()
    # The kept set's mass: the smallest top set with probability >= top_p.
    crafted = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = ~filter_logits(crafted, 0, 0.75).isinf()
    assert kept.tolist() == [[True, True, False, False]]


def test_sampling_frequencies_follow_the_distribution():
    """Gumbel-max with the hashed noise samples softmax(logits / T): 40000 draws within 0.01."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = 40000
    logits = (probs.log() * 0.5).expand(rows, -1)  # at temperature 0.5 the distribution is `probs`
    tokens, logp = choose_tokens(logits, torch.tensor(0), torch.tensor(12345), temperature=0.5, do_sample=True)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert (freq - probs).abs().max().item() < 0.01
    assert torch.allclose(logp, probs.log()[tokens], atol=1e-6)


def test_the_noise_is_bounded_so_a_token_far_below_is_never_sampled():
    """Every 32-bit draw gives finite noise in [-2.9, 16.7]: a token 20 nats below the best is never chosen
    (with 24 bits the highest draw rounded to u = 1, infinite noise, a random token once in 2**24 logits)."""
    bits = torch.tensor([0, 1, 0x1FF, 0x200, 0xFFFFFDFF, 0xFFFFFE00, 0xFFFFFEFF, 0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64)
    noise = gumbel_from_bits(bits)
    assert bool(noise.isfinite().all())
    assert noise.min().item() > -2.9 and noise.max().item() < 16.7
    assert noise.max().item() - noise.min().item() < 20.0


def test_fallback_logs_why(tok, prompts, caplog):
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2,
                                                        n_positions=64)).eval()
    assert "gpt2" in unsupported_reason(model)
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout"):
        r = rollout(model, tok)
    assert r.stats["backend"] == "hf" and "gpt2" in r.stats["fallback"]
    assert [rec for rec in caplog.records if "generate" in rec.getMessage() and "gpt2" in rec.getMessage()]
    ids, mask = prompts
    out = r.generate(ids, mask)
    assert out.completion_ids.shape == (4, N)
    # A sliding-window model is refused too.
    from transformers import MistralConfig

    mistral = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with torch.device("meta"):
        assert "sliding" in unsupported_reason(AutoModelForCausalLM.from_config(mistral), cache_len=32)


def test_bad_input_names_the_fix(models, tok, prompts):
    ids, mask = prompts
    with pytest.raises(ConfigError, match="generation_backend"):
        rollout(models["llama"], tok, backend="vllm")
    with pytest.raises(ConfigError, match="max_prompt_len"):
        rollout(models["llama"], tok, max_prompt_len=3).generate(ids, mask)
    with pytest.raises(ConfigError, match="do_sample=False"):
        SamplingParams(max_new_tokens=4, pad_token_id=0, temperature=0.0)
    off = SamplingParams(max_new_tokens=4, pad_token_id=0, top_k=None, top_p=None)  # TRL configs' "off"
    assert (off.top_k, off.top_p) == (0, 1.0)


# -- two processes: DeepSpeed ZeRO-2 storage and a ZeRO-3 policy ------------------------------------
@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout")
    return run_json("rollout_checks.py", tmp_path=tmp)


def test_zero2_parameters_keep_their_storage_across_steps(dist):
    """The engine reads the live parameters: DeepSpeed's optimizer step writes them in place."""
    assert dist["world"] == 2
    assert dist["zero2_ptrs_unchanged"] and dist["zero2_weights_changed"]
    assert dist["zero2_storage_moves"] == 0  # the engine saw no parameter move across the steps
    # DeepSpeed's flat buffer and the ZeRO-3 shadow hold q|k|v and gate|up end to end: fused, no copy.
    for name in ("p2", "p3", "frozen3"):
        st = dist["stats"][name]
        assert st["fused_projections"] == "views" and st["fused_weight_bytes"] == 0, (name, st)
    assert dist["bf16"] == {"dtype": "torch.bfloat16", "ptrs_unchanged": True, "changed": True}


def test_zero3_policy_rollout_equals_zero2(dist):
    """A ZeRO-3 policy gathered into the shadow buffer samples exactly what the same weights do
    under ZeRO-2, before and after an optimizer step; the buffer keeps its address."""
    assert dist["zero3_equal"] == [True, True]
    assert dist["zero3_hf_equal"]
    assert dist["zero3_shadow_ptr_stable"]
    assert dist["zero3_logprob_diff"] < 1e-5


def test_lora_policy_under_zero3_equals_zero2(dist):
    """A peft policy's rollout under ZeRO-3 (base and adapters gathered into the shadow, each projection group
    laid out with room for the A rows) equals its ZeRO-2 rollout and the adapted forward, before and after the
    adapters train; so does the ZeRO-2 policy's "grouped" rollout (its frozen base re-pointed into the appended
    buffers while DeepSpeed trains)."""
    lora = dist["lora"]
    # The default, auto: grouped, on the ZeRO-2 policy's live weights and in the ZeRO-3 shadow's layout.
    assert lora["backends"] == ["posttrain"] * 4 and lora["lora_mode"] == ["grouped", "grouped", "live", "grouped"]
    assert lora["appended_groups"] == lora["appended_groups_zero3"] == 4 * tiny.model_config().num_hidden_layers
    assert lora["repointed"] == [0, 0] and lora["shared_buffers"]
    assert lora["equal"] == [True, True] and lora["changed"]
    assert lora["logprob_diff"] < 1e-5


@torch.no_grad()
def test_bf16_engine_is_as_close_to_a_forward_as_generate_is():
    """In bf16 neither decode equals a full forward exactly; the engine must be no further from it
    than transformers' own ``generate`` (greedy, same weights): log-probs and argmax agreement."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    b, p, n = 4, 64, 24
    ids = torch.randint(1, 8000, (b, p))
    mask = torch.ones_like(ids)

    def distance(sequences, completion, logprobs):
        logits = model(input_ids=sequences, attention_mask=torch.ones_like(sequences), logits_to_keep=n + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        gap = (logp.gather(-1, completion[..., None])[..., 0] - logprobs).abs().max().item()
        return gap, (logp.argmax(-1) == completion).float().mean().item()

    out = Rollout(None, "policy", SamplingParams(max_new_tokens=n, pad_token_id=0, do_sample=False),
                  max_batch=b, max_prompt_len=p, model=model).generate(ids, mask)
    ours = distance(out.sequences, out.completion_ids, out.logprobs)
    g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_scores=True,
                       return_dict_in_generate=True, pad_token_id=0)
    comp = g.sequences[:, p:]
    lp = torch.stack([torch.log_softmax(s.float(), -1) for s in g.scores], 1).gather(-1, comp[..., None])[..., 0]
    theirs = distance(g.sequences, comp, lp)
    # bf16: generate is not exact, so the comparison means something (the engine can be: on CPU its
    # decode attention is the forward's own SDPA kernel).
    assert theirs[0] > 0
    assert ours[0] <= 1.5 * theirs[0] + 1e-3, (ours, theirs)
    assert ours[1] >= theirs[1] - 0.03, (ours, theirs)


# -- slots: compaction, refill, prefix sharing, slot-independent samples ----------------------------
GROUPS = 4  # generations per prompt, as GRPO's num_generations


@pytest.fixture(scope="module")
def grouped(tok):
    """3 prompts x GROUPS generations, each group's rows next to each other (as GRPO lays them out)."""
    enc = tok(["the cat sat on the", "a", "hello world how are you"], return_tensors="pt", padding=True,
              padding_side="left")
    return enc["input_ids"].repeat_interleave(GROUPS, 0), enc["attention_mask"].repeat_interleave(GROUPS, 0)


def stopping(tok, n=24):
    """Sampling that ends rows at scattered lengths: 60 of the 547 tokens stop."""
    return dict(max_new_tokens=n, temperature=1.0, stop_token_ids=list(range(5, 65)))


def run_slots(model, tok, ids, mask, seed=5, **options):
    kv_slots = options.pop("kv_slots", ids.shape[0])
    r = rollout(model, tok, max_batch=ids.shape[0], kv_slots=kv_slots, engine_options=options, **stopping(tok))
    torch.manual_seed(seed)
    return r.generate(ids, mask), r.stats


def test_slots_hold_the_state_and_change_it_only_by_their_methods():
    """``Slots``: the cache and each slot's decode state in one object; sequences enter
    (``admit``, after ``store`` of their prompts), a step's tokens are recorded (done slots keep
    theirs), a sequence moves to a free slot (its cache columns and state with it, the old slot
    done), and finished slots' outputs go to their sequences' rows (``harvest``)."""
    from posttrain.rollout.slots import Slots

    slots = Slots(4, layers=1, kv_heads=1, head_dim=2, length=6, max_new=3, dtype=torch.float32,
                  device=torch.device("cpu"))
    assert len(slots) == 4 and slots.done.all() and slots.nbytes == 2 * 4 * 6 * 2 * 4
    dst = torch.tensor([1, 3])
    slots.store(0, dst, torch.arange(8.0).view(2, 1, 2, 2), -torch.arange(8.0).view(2, 1, 2, 2))
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 0] = False
    slots.admit(dst, torch.tensor([7, 8]), torch.tensor([5, 6]), torch.tensor([11, 12]), torch.tensor([-1.0, -2.0]),
                torch.tensor([1, 2]), valid, 2, torch.tensor(False), pad=0)
    assert slots.done.tolist() == [True, False, True, False] and slots.seq[dst].tolist() == [7, 8]
    assert slots.sample_key[dst].tolist() == [5, 6]
    assert slots.out_tokens[dst].tolist() == [[11, 0, 0], [12, 0, 0]] and slots.col[dst].tolist() == [2, 2]
    assert slots.last[dst].tolist() == [11, 12] and slots.pos[dst].tolist() == [1, 2] and not slots.key_valid[1, 0]
    slots.record(torch.tensor([5, 6, 5, 9]), torch.tensor([-0.5, -0.6, -0.5, -0.9]), torch.tensor(3), None, pad=0)
    assert slots.out_tokens[dst].tolist() == [[11, 6, 0], [12, 9, 0]] and slots.out_tokens[0].tolist() == [0, 0, 0]
    assert slots.step[dst].tolist() == [2, 2] and slots.col[dst].tolist() == [3, 3] and slots.last[3].item() == 9
    slots.move([3], [0], length=3)
    assert slots.done.tolist() == [False, False, True, True] and slots.seq[0].item() == 8
    assert slots.sample_key[0].item() == 6
    assert torch.equal(slots.keys[0][0, :, :2], torch.arange(4.0, 8.0).view(1, 2, 2))
    tokens, logprobs = torch.zeros(10, 3, dtype=torch.long), torch.zeros(10, 3)
    slots.harvest([0, 1], [8, 7], tokens, logprobs)
    assert tokens[8].tolist() == [12, 9, 0] and tokens[7].tolist() == [11, 6, 0]
    assert logprobs[8, :2].tolist() == pytest.approx([-2.0, -0.9]) and slots.done_flags(2) == [False, False]
    slots.free([1])
    assert slots.done[1]
    slots.reset()
    assert slots.done.all()


def test_finished_rows_leave_the_step_with_the_same_samples(models, tok, grouped):
    """Compaction into smaller row buckets and length buckets that follow the longest live row give
    the same tokens and log-probs as one static bucket (every row, the whole cache, to the end)."""
    model, (ids, mask) = models["llama"], grouped
    static, st = run_slots(model, tok, ids, mask, smallest_bucket=ids.shape[0], length_bucket=10**6, sync_every=100)
    lengths = static.completion_mask.sum(1)
    assert lengths.min() < lengths.max() < 24 or lengths.max() == 24 and lengths.min() < 12, lengths
    packed, sp = run_slots(model, tok, ids, mask, smallest_bucket=1, length_bucket=4, sync_every=2)
    assert torch.equal(static.sequences, packed.sequences)
    assert torch.equal(static.completion_mask, packed.completion_mask)
    assert (static.logprobs - packed.logprobs).abs().max().item() < 1e-5
    assert sp["compactions"] > 0 and st["compactions"] == 0
    assert sp["row_steps"] < st["row_steps"] and sp["cache_cells_read"] < st["cache_cells_read"] / 2, (sp, st)


def test_more_sequences_than_slots_stream_through(models, tok, grouped):
    """3 slots for 12 sequences: waiting sequences enter as slots free; each sequence samples what it
    samples with a slot of its own (its noise is keyed by its index, not its slot or wave)."""
    model, (ids, mask) = models["llama"], grouped
    alone, _ = run_slots(model, tok, ids, mask, smallest_bucket=ids.shape[0], length_bucket=10**6)
    streamed, st = run_slots(model, tok, ids, mask, kv_slots=3, smallest_bucket=1, length_bucket=4, sync_every=2,
                             admit_min=1)
    assert st["admissions"] > 3 and st["prefill_sequences"] == 12
    assert torch.equal(alone.sequences, streamed.sequences)
    assert (alone.logprobs - streamed.logprobs).abs().max().item() < 1e-5
    # The same sequences in another order sample other tokens (their indices changed), and a
    # sequence's samples do not depend on the other rows: a rollout of one row equals its row.
    one, _ = run_slots(model, tok, ids[:1], mask[:1])
    assert torch.equal(one.sequences[0], alone.sequences[0])


def test_generation_kv_slots_is_a_config_field(models, tok, grouped):
    """``RolloutFields.generation_kv_slots`` (a trainer config mixin): checked by its flag, and as
    Rollout's ``kv_slots`` it caps the cache at that many sequences with the same samples."""
    from dataclasses import dataclass

    from posttrain.rollout import RolloutFields, check_rollout_fields

    @dataclass
    class Cfg(RolloutFields):
        pass

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="--generation_kv_slots"):
            check_rollout_fields(Cfg(generation_kv_slots=bad))
    check_rollout_fields(Cfg())
    cfg = Cfg(generation_kv_slots=4)
    check_rollout_fields(cfg)
    model, (ids, mask) = models["llama"], grouped
    r = rollout(model, tok, max_batch=ids.shape[0], max_prompt_len=ids.shape[1], kv_slots=cfg.generation_kv_slots)
    torch.manual_seed(9)
    capped = r.generate(ids, mask)
    assert len(r.engine.slots) == 4 and r.stats["kv_cache_bytes"] == r.engine.cache_nbytes
    full = rollout(model, tok, max_batch=ids.shape[0], max_prompt_len=ids.shape[1])
    torch.manual_seed(9)
    assert torch.equal(full.generate(ids, mask).sequences, capped.sequences)
    assert len(full.engine.slots) == ids.shape[0] and full.stats["kv_cache_bytes"] > r.stats["kv_cache_bytes"]


def test_from_config_reads_every_rollout_setting(models, tok, grouped):
    """``Rollout.from_config``: every ``RolloutFields`` setting of a trainer's config (backend, KV
    budget, fused projections, shared prompt KV with the config's ``num_generations`` as the group,
    LoRA mode) and TRL's ``ds3_gather_for_generation`` reach the rollout and its engine, with the samples of the
    constructor given the same settings; a bad setting is refused by its flag, and a config
    without the fields by what to mix in."""
    from dataclasses import dataclass

    from posttrain.rollout import RolloutFields, check_rollout_fields

    @dataclass
    class Cfg(RolloutFields):
        num_generations: int = GROUPS
        ds3_gather_for_generation: bool = True  # the TRL config's field (GRPOConfig, DistillationConfig)

    model, (ids, mask) = models["llama"], grouped
    sampling = SamplingParams(pad_token_id=tok.pad_token_id, **stopping(tok, N))
    cfg = Cfg(generation_kv_slots=5, generation_fused_projections=True, generation_shared_prompt_kv=True,
              generation_lora_mode="live", ds3_gather_for_generation=False)
    r = Rollout.from_config(cfg, None, "policy", sampling, max_batch=ids.shape[0], max_prompt_len=ids.shape[1],
                            model=model)
    assert (r.backend, r.kv_slots, r.gather) == ("posttrain", 5, False)
    assert r.engine_options == {"lora_mode": "live", "fused": True, "shared_prompt_kv": True, "group_size": GROUPS}
    torch.manual_seed(4)
    out = r.generate(ids, mask)
    st = r.stats
    assert len(r.engine.slots) == 5 and st["shared_prompt_kv"] and st["fused_projections"] == "copies"
    assert r.engine.prompts.group == GROUPS and r.engine.adapters.mode == "live"
    snapshot = r.engine.stats()  # the engine's own counters, read, never written from outside
    snapshot["admissions"] = -1
    assert r.engine.stats()["admissions"] == st["admissions"] > 0
    want = Rollout(None, "policy", sampling, max_batch=ids.shape[0], max_prompt_len=ids.shape[1], model=model,
                   kv_slots=5, engine_options=dict(fused=True, shared_prompt_kv=True, group_size=GROUPS))
    torch.manual_seed(4)
    assert torch.equal(want.generate(ids, mask).sequences, out.sequences)
    grouped_by_hand = Rollout.from_config(cfg, None, "policy", sampling, max_batch=4, max_prompt_len=ids.shape[1],
                                          group_size=2, model=model)
    assert grouped_by_hand.engine_options["group_size"] == 2
    hf = Rollout.from_config(Cfg(generation_backend="hf"), None, "policy", sampling, max_batch=4,
                             max_prompt_len=ids.shape[1], model=model)
    assert hf.backend == "hf" and hf.kv_slots == 4
    for bad, flag in ((dict(generation_backend="vllm"), "--generation_backend"),
                      (dict(generation_lora_mode="fast"), "--generation_lora_mode"),
                      (dict(ds3_gather_for_generation="no"), "--ds3_gather_for_generation"),
                      (dict(generation_shared_prompt_kv=1), "--generation_shared_prompt_kv")):
        with pytest.raises(ConfigError, match=flag):
            check_rollout_fields(Cfg(**bad))
        with pytest.raises(ConfigError, match=flag):
            Rollout.from_config(Cfg(**bad), None, "policy", sampling, max_batch=4, max_prompt_len=8, model=model)

    @dataclass
    class Bare:
        generation_backend: str = "posttrain"

    with pytest.raises(ConfigError, match="RolloutFields"):
        Rollout.from_config(Bare(), None, "policy", sampling, max_batch=4, max_prompt_len=8, model=model)


def test_rows_sharing_a_prompt_prefill_it_once(models, tok, grouped):
    """A GRPO group's rows share their prompt's prefill (one row per distinct prompt), with the
    same samples as prefilling every row (one slot: each row admitted, and prefilled, alone)."""
    model, (ids, mask) = models["qwen2"], grouped
    shared, ss = run_slots(model, tok, ids, mask)
    each, se = run_slots(model, tok, ids, mask, kv_slots=1)
    assert ss["prefill_rows"] == 3 and se["prefill_rows"] == 12 and ss["prefill_sequences"] == 12
    assert torch.equal(shared.sequences, each.sequences)
    assert (shared.logprobs - each.logprobs).abs().max().item() < 1e-5
    # Rows of one group sample differently from each other (their own noise).
    assert len({tuple(r.tolist()) for r in shared.completion_ids[:GROUPS]}) > 1


def test_shorter_rollouts_from_a_longer_engine(models, tok, grouped):
    """A rollout may ask for fewer new tokens than the engine was built for (down to one): the
    same samples as an engine built for that length, with the stop set on and off."""
    model, (ids, mask) = models["llama"], grouped
    for stops in ([], list(range(5, 65))):
        r = rollout(model, tok, max_batch=12, stop_token_ids=stops, max_new_tokens=N)
        for n in (1, 4):
            knobs = SamplingParams(max_new_tokens=n, pad_token_id=tok.pad_token_id, stop_token_ids=stops)
            torch.manual_seed(9)
            short = r.generate(ids, mask, knobs)
            torch.manual_seed(9)
            want = rollout(model, tok, max_batch=12, stop_token_ids=stops, max_new_tokens=n).generate(ids, mask)
            assert short.completion_ids.shape == (12, n)
            assert torch.equal(short.sequences, want.sequences), (stops, n)


def test_generation_fused_projections_is_a_config_field(models, tok, prompts):
    """``RolloutFields.generation_fused_projections``: checked by its flag, passed to the engine
    by ``engine_options`` (unset, the engine fuses only views of weights that lie end to end), the same
    samples as the unfused step, and the buffers' bytes are what ``posttrain plan`` counts for
    them where the engine copies (the planner in bf16: 2 bytes an element; this model is float32)."""
    from dataclasses import dataclass

    from posttrain.planner import memory
    from posttrain.rollout import RolloutFields, check_rollout_fields
    from posttrain.rollout.api import engine_options

    @dataclass
    class Cfg(RolloutFields):
        pass

    with pytest.raises(ConfigError, match="--generation_fused_projections"):
        check_rollout_fields(Cfg(generation_fused_projections="yes"))
    assert engine_options(Cfg()) == {"lora_mode": "auto"}
    assert engine_options(Cfg(generation_fused_projections=True)) == {"lora_mode": "auto", "fused": True}
    ids, mask = prompts
    model = models["llama"]
    runs = {}
    for fused in (False, True):
        r = rollout(model, tok, engine_options=engine_options(Cfg(generation_fused_projections=fused)))
        torch.manual_seed(3)
        runs[fused] = (r.generate(ids, mask), r.stats["fused_weight_bytes"])
    assert torch.equal(runs[False][0].sequences, runs[True][0].sequences)
    assert (runs[False][0].logprobs - runs[True][0].logprobs).abs().max().item() < 1e-5
    size = memory.model_size(str(tiny.sft_model_path()))
    assert runs[False][1] == 0 and runs[True][1] == memory.fused_projection_bytes(size) * 4 // 2
    for master, copied in (("bf16", True), ("fp32", False)):  # the torch path's weights are copied, DeepSpeed's not
        plan = {f: memory.plan("grpo", str(tiny.sft_model_path()), "zero2-zero3", world_size=1, micro_batch=4,
                               seq_len=32, response_len=16, fused_projections=f, master_weights=master)
                for f in (False, True)}
        extra = plan[True].roles[0].rollout - plan[False].roles[0].rollout
        assert extra == (memory.fused_projection_bytes(size) if copied else 0), master
