"""The rollout engine (posttrain/rollout.py) on CPU, fp32: the same step logic that CUDA compiles
and captures, run eagerly. Single process except the ZeRO checks (tests/dist/rollout_checks.py)."""

import logging

import pytest
import torch
from conftest import run_json

from posttrain.demo import tiny
from posttrain.dsconfig import ConfigError
from posttrain.rollout import Rollout, SamplingParams, choose_tokens, filter_logits, unsupported_reason

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


def rollout(model, tok, backend="posttrain", max_batch=6, max_prompt_len=18, **knobs):
    knobs.setdefault("max_new_tokens", N)
    sampling = SamplingParams(pad_token_id=tok.pad_token_id, **knobs)
    return Rollout(None, "policy", sampling, max_batch=max_batch, max_prompt_len=max_prompt_len, backend=backend,
                   model=model)


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
    assert r.engine.graph is None and r.stats["captures"] == 0  # CPU: the step runs eagerly
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
    from posttrain import memory

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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_give_the_same_tokens(kind, models, tok, prompts, monkeypatch):
    """POSTTRAIN_ROLLOUT_FUSE=1 (q|k|v and gate|up copies, refreshed per rollout) decodes the same."""
    model, (ids, mask) = models[kind], prompts
    torch.manual_seed(4)
    plain = rollout(model, tok).generate(ids, mask)
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_FUSE", "1")
    r = rollout(model, tok)
    torch.manual_seed(4)
    fused = r.generate(ids, mask)
    assert r.stats["fused_weight_bytes"] > 0
    assert torch.equal(plain.sequences, fused.sequences)
    assert (plain.logprobs - fused.logprobs).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode,graphs", [("layer", 3), ("step", 1)])
def test_what_cuda_compiles_traces_in_whole_graphs(mode, graphs, models, tok, prompts):
    """What is compiled before CUDA capture traces without a graph break (fullgraph), is one graph
    per part whatever the depth (layer mode: the layers share one), is not recompiled by new
    knobs, and decodes what the eager step does. aot_eager: dynamo and AOTAutograd's tracing
    without code generation, which is cheap on CPU."""
    from torch._dynamo.utils import counters

    model, (ids, mask) = models["llama"], prompts
    r = rollout(model, tok, top_p=0.9, stop_token_ids=[tok.eos_token_id], min_new_tokens=2)
    torch.manual_seed(1)
    eager = r.generate(ids, mask)
    torch._dynamo.reset()
    counters.clear()
    r.engine.compile_parts(mode, backend="aot_eager")
    torch.manual_seed(1)
    compiled = r.generate(ids, mask)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert (eager.logprobs - compiled.logprobs).abs().max().item() < 1e-5
    r.generate(ids, mask, SamplingParams(max_new_tokens=N, pad_token_id=tok.pad_token_id, do_sample=False,
                                         top_p=0.5, temperature=0.7, stop_token_ids=[tok.eos_token_id]))
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


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
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for k, p in ((5, 1.0), (0, 0.8), (10, 0.5), (0, 0.05)):
        want = logits
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(filter_logits(logits, k, p).isinf(), want.isinf()), (k, p)
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
    assert dist["bf16"] == {"dtype": "torch.bfloat16", "ptrs_unchanged": True, "changed": True}


def test_zero3_policy_rollout_equals_zero2(dist):
    """A ZeRO-3 policy gathered into the shadow buffer samples exactly what the same weights do
    under ZeRO-2, before and after an optimizer step; the buffer keeps its address."""
    assert dist["zero3_equal"] == [True, True]
    assert dist["zero3_hf_equal"]
    assert dist["zero3_shadow_ptr_stable"]
    assert dist["zero3_logprob_diff"] < 1e-5


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
    assert ours[0] > 0 and theirs[0] > 0  # bf16: neither is exact, so the comparison means something
    assert ours[0] <= 1.5 * theirs[0] + 1e-3, (ours, theirs)
    assert ours[1] >= theirs[1] - 0.03, (ours, theirs)
