"""posttrain's Triton decode-attention kernel (posttrain/rollout/kernels/decode_attention.py), run on the CPU
by Triton's interpreter (TRITON_INTERPRET=1, set by conftest before Triton is imported): against
the attention it replaces, and inside the engine, eager and traced as CUDA compiles it.
(The interpreter's bf16 matrix product is wrong, so float32 and float16 here.)"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_rollout import build, rollout

from posttrain.demo import tiny
from posttrain.errors import ConfigError


def attention(q, keys, values, bias, scale):
    """What the kernel computes, in float32: softmax over the unmasked keys; a row with none gives
    zeros."""
    bias = bias.reshape(q.shape[0], 1, 1, keys.shape[2]).float()
    scores = q.float() @ keys.float().transpose(-1, -2) * scale + bias
    return torch.softmax(scores, -1).nan_to_num(0.0) @ values.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups, head_dim, length, block_n", [
    (2, 16, 40, 16),  # the tiny default's shape, one program a row and head, the last block partial
    (8, 64, 200, 64),  # the 1.1B Llama's group and head size
    (8, 64, 200, None),  # the kernel's own block size
])
def test_the_kernel_computes_masked_attention(dtype, groups, head_dim, length, block_n):
    from posttrain.rollout.kernels.decode_attention import decode_attention

    torch.manual_seed(0)
    rows, kv_heads, cache_len = 5, 2, length + 24
    q = torch.randn(rows, kv_heads, groups, head_dim, dtype=dtype)
    # A bucket of a longer cache, read in place.
    keys = torch.randn(rows + 2, kv_heads, cache_len, head_dim, dtype=dtype)[:rows, :, :length]
    values = torch.randn(rows + 2, kv_heads, cache_len, head_dim, dtype=dtype)[:rows, :, :length]
    valid = torch.arange(length) >= (torch.arange(rows) * 3).unsqueeze(1)  # left padding
    valid &= torch.arange(length) < (length - 7 * torch.arange(rows)).unsqueeze(1)  # rows that end earlier
    valid[1] = False  # a row with every key masked
    bias = torch.zeros(rows, 1, 1, length, dtype=dtype).masked_fill(~valid.view(rows, 1, 1, length), float("-inf"))
    out = decode_attention(q, keys, values, bias, head_dim**-0.5, block_n=block_n)
    want = attention(q, keys, values, bias, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    # masked keys are not read: garbage there changes nothing
    for cache in (keys, values):
        cache.masked_fill_(~valid.view(rows, 1, length, 1), float("nan"))
    again = decode_attention(q, keys, values, bias, head_dim**-0.5, block_n=block_n)
    assert torch.equal(again, out)


@pytest.mark.parametrize("shared", [False, True])
def test_the_kernel_writes_the_steps_keys_as_it_attends_them(shared):
    """``new``: the step's keys and values go into the cache views at each row's column (clamped to
    the bucket's last), attended from registers (the stale cell, NaN here, is never read): what two
    ``index_copy_`` into the cache and then the kernel give, cache and output alike."""
    from posttrain.rollout.kernels.decode_attention import decode_attention, decode_attention_shared

    torch.manual_seed(2)
    rows, kv_heads, groups, d, length, cache_len = 5, 2, 2, 16, 40, 56
    q = torch.randn(rows, kv_heads, groups, d)
    caches = [torch.randn(rows + 1, kv_heads, cache_len, d) for _ in range(2)]
    col = torch.tensor([3, 17, 39, 60, 25])  # row 3 is done: its column is past the bucket, clamped to 39
    cells = col.clamp(max=length - 1)
    for cache in caches:
        cache[torch.arange(rows), :, cells] = float("nan")
    new = [torch.randn(rows, 1, kv_heads, d).transpose(1, 2) for _ in range(2)]  # [B, kv_heads, 1, d], as q/k/v
    valid = (torch.arange(length) <= cells.unsqueeze(1)) & (torch.arange(length) >= torch.arange(rows).unsqueeze(1))
    bias = torch.zeros(rows, length).masked_fill(~valid, float("-inf"))
    want_caches = [c.clone() for c in caches]
    for cache, kv in zip(want_caches, new):
        cache[torch.arange(rows), :, cells] = kv[:, :, 0]
    views = [c[:rows, :, :length] for c in caches]
    want_views = [c[:rows, :, :length] for c in want_caches]
    scale = d**-0.5
    if shared:
        pkeys, pvalues = torch.randn(2, kv_heads, 24, d), torch.randn(2, kv_heads, 24, d)
        prompt = (pkeys, pvalues, torch.zeros(2, 24), torch.tensor([[0, 1, 2], [3, 4, rows]]),
                  torch.tensor([0, 1, 2, 3, 4]))
        want = decode_attention_shared(q, *want_views, bias, *prompt, scale, block_n=16)
        out = decode_attention_shared(q, *views, bias, *prompt, scale, block_n=16, new=(*new, col))
    else:
        want = decode_attention(q, *want_views, bias, scale, block_n=16)
        out = decode_attention(q, *views, bias, scale, block_n=16, new=(*new, col))
    assert (out - want).abs().max().item() < 1e-6
    exact = (shared_attention(q, *want_views, bias, *prompt, scale) if shared
             else attention(q, *want_views, bias, scale))
    assert (out - exact).abs().max().item() < 1e-5
    for cache, want_cache in zip(caches, want_caches):
        assert torch.equal(cache, want_cache)  # the cells outside the bucket untouched


def shared_attention(q, keys, values, bias, pkeys, pvalues, pbias, members, place, scale):
    """Each row over its prompt slot's keys then its own, one softmax; a row that is not the member
    its place names (a finished row's stale place) over its own keys only."""
    n, out = members.shape[1], []
    for r in range(q.shape[0]):
        slot, j = divmod(int(place[r]), n)
        k, v, bias_r = keys[r], values[r], bias[r]
        if int(members[slot, j]) == r:
            k, v, bias_r = torch.cat([pkeys[slot], k], 1), torch.cat([pvalues[slot], v], 1), torch.cat([pbias[slot], bias_r])
        scores = q[r].float() @ k.float().transpose(-1, -2) * scale + bias_r.float()
        out.append(torch.softmax(scores, -1).nan_to_num(0.0) @ v.float())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, slots, members, kv_heads, groups, head_dim, length, width, block_n", [
    (7, 3, 3, 2, 2, 16, 24, 40, 16),  # the tiny default's heads; a slot with a missing member
    (7, 3, 3, 2, 2, 16, 24, 40, None),  # the kernels' own block size
    (9, 2, 4, 4, 8, 64, 70, 130, 64),  # the 1.1B Llama's heads: a tile of 4 rows x 8 query heads
])
def test_the_shared_prompt_kernels_compute_attention_over_both_parts(dtype, rows, slots, members, kv_heads, groups,
                                                                     head_dim, length, width, block_n):
    from posttrain.rollout.kernels.decode_attention import decode_attention_shared

    torch.manual_seed(1)
    q = torch.randn(rows, kv_heads, groups, head_dim, dtype=dtype)
    keys, values = (torch.randn(rows, kv_heads, length, head_dim, dtype=dtype) for _ in range(2))
    pkeys, pvalues = (torch.randn(slots, kv_heads, width, head_dim, dtype=dtype) for _ in range(2))
    filled = torch.arange(length) < torch.randint(0, length + 1, (rows, 1))  # some rows with no completion yet
    padded = torch.arange(width) >= torch.randint(0, width // 2, (slots, 1))  # prompts left-padded
    bias = torch.zeros(rows, length, dtype=dtype).masked_fill(~filled, float("-inf"))
    pbias = torch.zeros(slots, width, dtype=dtype).masked_fill(~padded, float("-inf"))
    member_rows = torch.full((slots, members), rows, dtype=torch.long)  # rows: no member
    place = torch.zeros(rows, dtype=torch.long)
    order = torch.randperm(rows)
    for i, r in enumerate(order[:-1].tolist()):
        slot, j = divmod(i, members)
        if slot < slots:
            member_rows[slot, j], place[r] = r, slot * members + j
    place[int(order[-1])] = 0  # a finished row whose place is stale: its own keys only
    scale = head_dim**-0.5
    out = decode_attention_shared(q, keys, values, bias, pkeys, pvalues, pbias, member_rows, place, scale,
                                  block_n=block_n)
    want = shared_attention(q, keys, values, bias, pkeys, pvalues, pbias, member_rows, place, scale)
    assert (out.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.fixture(scope="module", autouse=True)
def subprocesses(request, tmp_path_factory):
    """The selected tests' subprocesses (conftest.compile_ahead_of_time: Triton without its interpreter),
    started as the module starts, one at a time, on the core this module's in-process tests leave: name ->
    (future of its stdout, its Triton cache folder)."""
    from conftest import compile_ahead_of_time

    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    jobs = {"cpu": ("test_the_kernel_on_a_cpu_without_the_interpreter_is_refused", CPU_WITHOUT_INTERPRETER),
            "h200": ("test_the_kernels_compile_for_an_h200", AHEAD_OF_TIME)}
    with ThreadPoolExecutor(1) as pool:
        started = {}
        for name, (test, source) in jobs.items():
            if test in selected:
                cache = tmp_path_factory.mktemp(f"triton-{name}")
                started[name] = pool.submit(compile_ahead_of_time, source, cache), cache
        yield started


@pytest.fixture(scope="module")
def tok():
    return tiny.load_tokenizer()


@pytest.mark.parametrize("compiled, shared", [(False, False), (True, False), (False, True), (True, True)])
def test_the_engine_with_the_kernel_samples_what_the_default_samples(compiled, shared, tok, monkeypatch):
    """``triton_decode`` (CUDA's step: the kernels rotate q and k and write the step's key and
    value), each row's own cache or shared prompt slots: eager, and traced in whole graphs as CUDA
    compiles it (fullgraph, aot_eager; the kernels between the compiled halves), streamed through
    fewer slots with small buckets: the default engine's samples and log-probs, with no fallback;
    the step's pointwise kernels and (no top-k or top-p) its sampler ran too."""
    from posttrain.rollout.kernels import decode_attention as triton_decode
    from posttrain.rollout.kernels import pointwise

    rotated_by_kernel, pointwise_calls = [], []
    attend_step, add_rms_norm = triton_decode.attend_step, pointwise.add_rms_norm

    def recorded(q, k, v, keys, values, bias, col, cos, sin, *args):
        rotated_by_kernel.append(cos is not None)
        return attend_step(q, k, v, keys, values, bias, col, cos, sin, *args)

    monkeypatch.setattr(triton_decode, "attend_step", recorded)
    monkeypatch.setattr(pointwise, "add_rms_norm", lambda *a: pointwise_calls.append(1) or add_rms_norm(*a))
    model = build("llama", tok)
    enc = tok(["the cat sat on the", "a", "hello world how are you"], return_tensors="pt", padding=True,
              padding_side="left")
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    torch.manual_seed(3)
    want = rollout(model, tok).generate(ids, mask)
    options = dict(triton_decode=True, smallest_bucket=1, length_bucket=8, sync_every=2)
    if shared:
        options.update(shared_prompt_kv=True, group_size=2)
    if compiled:
        torch._dynamo.reset()
        options.update(compile_backend="aot_eager")
    r = rollout(model, tok, kv_slots=3, engine_options=options)
    torch.manual_seed(3)
    out = r.generate(ids, mask)
    torch._dynamo.reset()
    assert r.stats["triton_decode"] and r.stats["triton_fallbacks"] == 0 and not r.degraded, r.stats
    assert r.stats["triton_sampler"] and pointwise_calls  # no top-k or top-p: the sampler too
    assert r.stats["compiled"] is compiled and r.stats["shared_prompt_kv"] is shared
    assert torch.equal(want.sequences, out.sequences) and torch.equal(want.completion_mask, out.completion_mask)
    assert (want.logprobs - out.logprobs).abs().max().item() < 1e-5
    assert rotated_by_kernel and set(rotated_by_kernel) == {True}


CPU_WITHOUT_INTERPRETER = r"""
import torch
from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rollout import Rollout, SamplingParams
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_config(tiny.model_config())
r = Rollout(None, "policy", SamplingParams(max_new_tokens=2, pad_token_id=0), max_batch=1, max_prompt_len=4,
            model=model, engine_options={"triton_decode": True})
try:
    r.generate(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))
except ConfigError as err:
    print("refused:", err)
print("default:", Rollout(None, "policy", SamplingParams(max_new_tokens=2, pad_token_id=0), max_batch=1,
                          max_prompt_len=4, model=model).generate(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))
      is not None)
"""


def test_the_kernel_on_a_cpu_without_the_interpreter_is_refused(subprocesses):
    """Asked for on a CPU where Triton does not interpret: refused, saying why; the default there
    is SDPA (not a fallback)."""
    out = subprocesses["cpu"][0].result()
    assert "refused: triton_decode: the Triton decode kernels run on CUDA, not cpu" in out, out
    assert "default: True" in out, out


AHEAD_OF_TIME = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from posttrain.rollout.kernels import decode_attention as td

def types(fn, constexprs, fp32=("out_ptr", "lse_ptr"), cache="*bf16"):
    def one(n):
        if n in constexprs:
            return "constexpr"
        if n.endswith("_ptr"):
            return "*i64" if n in ("members_ptr", "col_ptr", "place_ptr") else "*fp32" if n in fp32 else cache
        return "fp32" if n == "scale_log2" else "i32"
    return {n: one(n) for n in fn.arg_names}

target = GPUTarget("cuda", 90, 32)  # an H100 / H200
for partial in (False, True):  # the step's attention, and its own part with shared prompt slots
    c = dict(G=8, BLOCK_G=16, D=64, BLOCK_N=128, PARTIAL=partial, PRECISION="tf32", HAS_NEW=True, ROPE=True)
    sig = types(td._own, c, fp32=("out_ptr", "lse_ptr") if partial else ("lse_ptr",))
    k = triton.compile(ASTSource(td._own, sig, c), target=target, options={"num_warps": 2, "enable_fp_fusion": False})
    print("own", partial, k.metadata.shared, "mma" in k.asm["ptx"] and "fma.rn.bf16" not in k.asm["ptx"])
c = dict(G=8, BLOCK_G=16, D=64, BLOCK_N=128, PARTIAL=False, PRECISION="ieee", HAS_NEW=True, ROPE=True)  # float32
k = triton.compile(ASTSource(td._own, types(td._own, c, fp32=("lse_ptr",), cache="*fp32"), c), target=target,
                   options={"num_warps": 2})
print("own float32", "tf32" not in k.asm["ptx"])
c = dict(G=8, MEMBERS=8, BLOCK_M=64, D=64, BLOCK_N=128, PRECISION="tf32", ROPE=True)  # 8 rows
k = triton.compile(ASTSource(td._prompt, types(td._prompt, c), c), target=target, options={"num_warps": 2})
print("prompt", k.metadata.shared, "mma" in k.asm["ptx"])
c = dict(G=8, BLOCK_G=16, D=64, MEMBERS=8)
k = triton.compile(ASTSource(td._merge, types(td._merge, c), c), target=target, options={"num_warps": 2})
print("merge", k.metadata.shared)
"""


def test_the_kernels_compile_for_an_h200(subprocesses):
    """Triton compiles the kernels for sm_90 on this CPU (no GPU needed): what the interpreter
    does not check (a kernel reading a plain global, a shape no MMA tile takes)."""
    import os

    future, tmp_path = subprocesses["h200"]
    lines = future.result().splitlines()
    # tensor-core products; no bf16 FMA (the rotation rounds each product, as eager torch does)
    assert lines[0].startswith("own False") and lines[0].endswith("True"), lines
    assert lines[1].startswith("own True") and lines[1].endswith("True") and lines[2] == "own float32 True", lines
    assert lines[3].startswith("prompt") and lines[3].endswith("True"), lines
    assert lines[4].startswith("merge"), lines
    assert os.listdir(tmp_path)  # compiled, not only parsed


def test_a_triton_step_that_fails_falls_back_to_sdpa_counted(tok, monkeypatch):
    """The kernels fail (a kernel this GPU cannot build, say): the engine compiles the step with
    SDPA instead, samples what the default does, and the rollout says it is degraded
    (``triton_fallbacks``, the reason)."""
    from posttrain.rollout.kernels import decode_attention as triton_decode

    model = build("llama", tok)
    enc = tok(["the cat sat on the", "a"], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    torch.manual_seed(4)
    want = rollout(model, tok).generate(ids, mask)

    def out_of_resources(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(triton_decode, "attend_step", out_of_resources)
    torch._dynamo.reset()
    r = rollout(model, tok, engine_options=dict(triton_decode=True, compile_backend="aot_eager"))
    torch.manual_seed(4)
    out = r.generate(ids, mask)
    torch._dynamo.reset()
    assert r.stats["triton_fallbacks"] == 1 and r.metrics()["rollout/triton_fallbacks"] == 1, r.stats
    assert not r.stats["triton_decode"] and not r.stats["triton_sampler"]
    assert r.stats["compiled"] and r.degraded and r.stats["compile_fallbacks"] == 0
    assert any("Triton decode kernels" in why for why in r.stats["fallback_reasons"]), r.stats["fallback_reasons"]
    assert torch.equal(out.sequences, want.sequences)


def test_the_kernels_block_and_where_they_run(tok):
    """One pass over a row's keys in 128-key blocks for heads of up to 64 (cudnn's forward's
    rounding, and a row's output independent of the rows beside it), 64-key blocks above. The
    kernels take head sizes that are powers of two from 16 to 256 (a model with others is refused
    them by name; on CUDA it runs SDPA, counted); on a CPU the engine runs SDPA unless asked."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from posttrain.rollout import kernels
    from posttrain.rollout.kernels import decode_attention as triton_decode

    cuda = torch.device("cuda")
    assert triton_decode.block_size(64) == 128 and triton_decode.block_size(128) == 64
    assert kernels.unavailable(cuda, 64) is None and kernels.unavailable(cuda, 128) is None
    assert "head size 96" in kernels.unavailable(cuda, 96)  # tl.arange takes powers of two
    r = rollout(build("llama", tok), tok)
    enc = tok(["the cat sat"], return_tensors="pt")
    r.generate(enc["input_ids"], enc["attention_mask"])
    assert not r.stats["triton_decode"] and not r.degraded
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="triton_decode: head size 96"):
        rollout(AutoModelForCausalLM.from_config(cfg), tok, engine_options=dict(triton_decode=True)).generate(
            torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
def test_the_kernel_rotates_the_query_and_the_new_key_as_the_forward_does(dtype, shared):
    """``rope``: the kernel rotates q and the step's k itself, each product and the sum rounded as
    transformers' apply_rotary_pos_emb rounds them in the model dtype: the key it writes into the
    cache is that rotation's to the bit, and the output is the attention of the rotated query."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from posttrain.rollout import decoder
    from posttrain.rollout.kernels.decode_attention import decode_attention, decode_attention_shared

    torch.manual_seed(5)
    rows, kv_heads, groups, d, length = 5, 2, 2, 16, 40
    q = torch.randn(rows, kv_heads * groups, 1, d, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, 1, d, dtype=dtype) for _ in range(2))
    col = torch.tensor([3, 17, 39, 30, 25])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = decoder.rotary(col.unsqueeze(1), inv_freq, 1.0, dtype)  # [B, 1, d]
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes to [B, 1, 1, d]
    keys, values = (torch.randn(rows, kv_heads, length, d, dtype=dtype) for _ in range(2))
    valid = torch.arange(length) <= col.unsqueeze(1)
    bias = torch.zeros(rows, length, dtype=dtype).masked_fill(~valid, float("-inf"))
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[torch.arange(rows), :, col], want_values[torch.arange(rows), :, col] = k_rot[:, :, 0], v[:, :, 0]
    new, rope = (k, v, col), (cos.reshape(rows, d), sin.reshape(rows, d))
    qg, want_qg = q.reshape(rows, kv_heads, groups, d), q_rot.reshape(rows, kv_heads, groups, d)
    scale = d**-0.5
    if shared:
        prompt = (torch.randn(2, kv_heads, 24, d, dtype=dtype), torch.randn(2, kv_heads, 24, d, dtype=dtype),
                  torch.zeros(2, 24, dtype=dtype), torch.tensor([[0, 1, 2], [3, 4, rows]]), torch.arange(rows))
        out = decode_attention_shared(qg, keys, values, bias, *prompt, scale, block_n=16, new=new, rope=rope)
        want = shared_attention(want_qg, want_keys, want_values, bias, *prompt, scale)
    else:
        out = decode_attention(qg, keys, values, bias, scale, block_n=16, new=new, rope=rope)
        want = attention(want_qg, want_keys, want_values, bias, scale)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert (out.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-3)
