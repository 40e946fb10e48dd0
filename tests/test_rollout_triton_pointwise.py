"""posttrain's Triton pointwise kernels for the decode step (posttrain/rollout/kernels/pointwise.py),
run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set by conftest before Triton is
imported): SiLU-and-multiply and the residual add with the RMSNorm equal eager torch's (the
interpreter rounds bf16 by truncation, so float32 and float16 here); the decoder uses them only
where they apply; they compile for an H200."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.rollout import decoder
from posttrain.rollout.kernels import pointwise as triton_pointwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 1, 96), (3, 7, 40), (130, 1, 64)])
def test_silu_mul_equals_eager(dtype, shape, monkeypatch):
    monkeypatch.setattr(triton_pointwise, "SILU_BLOCK", 64)  # several programs, the last one partial
    torch.manual_seed(0)
    gate_up = torch.randn(shape, dtype=dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    got = triton_pointwise.silu_mul(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    want = F.silu(gate) * up
    # Each op rounded as eager rounds it; the interpreter's exp (numpy's) may differ from torch's in
    # its last float32 bit, which turns a few float16 roundings by one unit.
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    if dtype == torch.float16:
        assert (got == want).float().mean().item() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, hidden, per", [(6, 40, 1), (5, 64, 2), (1, 48, 4)])
def test_add_rms_norm_equals_the_decoders(dtype, rows, hidden, per, monkeypatch):
    """The sum to the bit, its norm as ``decoder.rms_norm`` (transformers' LlamaRMSNorm), a
    hidden size that is not a power of two, rows a program not dividing the rows."""
    monkeypatch.setattr(triton_pointwise, "NORM_ROWS", per)
    torch.manual_seed(0)
    x, r = torch.randn(rows, 1, hidden, dtype=dtype), torch.randn(rows, 1, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    total, normed = triton_pointwise.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    want = decoder.rms_norm(x + r, w, 1e-5)
    torch.testing.assert_close(normed, want, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, d", [(3, 16), (4, 8)])
def test_rope_heads_equals_eager_rotation(dtype, heads, d):
    """The prefill's rotation of a [B, heads, T, d] view (transposed from the projection's [B, T, heads, d]),
    to the bit as ``q * cos + rotate_half(q) * sin``, contiguous; a head count that is not a power of two."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, heads, d, dtype=dtype).transpose(1, 2)
    cos, sin = decoder.rotary(torch.arange(10).view(2, 5) + 3, 1.0 / (10000 ** (torch.arange(0, d, 2) / d)), 1.0,
                              dtype)
    got = triton_pointwise.rope_heads(x, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = x * c + decoder._rotate_half(x) * s
    assert got.is_contiguous() and torch.equal(got, want)


def test_the_layers_take_the_rotation_kernel_only_with_triton():
    """``decoder.layers`` (the prefill's and the tool append's) gives the same hidden states with the Triton
    rotation and fused norms as eager (float32, within rounding of the fused norm)."""
    torch.manual_seed(0)
    hidden, inter, d = 16, 24, 8
    spec = _spec(heads=2, kv_heads=1, head_dim=d)

    def layer():
        return {"ln1": torch.randn(hidden), "qkv": torch.randn(4 * d, hidden) / 4, "o": torch.randn(hidden, hidden) / 4,
                "ln2": torch.randn(hidden), "gate_up": torch.randn(2 * inter, hidden) / 4,
                "down": torch.randn(hidden, inter) / 5}

    weights = {"layers": [layer(), layer()]}
    x = torch.randn(2, 5, hidden)
    cos, sin = decoder.rotary(torch.arange(10).view(2, 5), 1.0 / (10000 ** (torch.arange(0, d, 2) / d)), 1.0,
                              x.dtype)

    def attend(i, q, k, v):
        assert q.shape == (2, 2, 5, d) and k.shape == (2, 1, 5, d)
        return decoder.query_attention(spec, q, k, v, torch.zeros(2, 1, 10, 5))

    want = decoder.layers(spec, weights, x, cos, sin, attend)
    got = decoder.layers(_spec(heads=2, kv_heads=1, head_dim=d, triton=True), weights, x, cos, sin, attend)
    assert (got - want).abs().max().item() < 1e-5


def _spec(**changes):
    spec = decoder.DecoderSpec(heads=2, kv_heads=1, head_dim=8, scaling=8**-0.5, eps=1e-6, rope_scaling=1.0, act=F.silu,
                               vocab=10)
    import dataclasses

    return dataclasses.replace(spec, **changes)


@pytest.mark.parametrize("case", ["fused", "lora", "separate", "gelu"])
def test_attention_out_takes_the_kernels_only_where_they_apply(case, monkeypatch):
    """With ``triton`` the layer's output equals the eager path's; SiLU-and-multiply only
    for one gate|up GEMM without LoRA terms and a SiLU activation (counted by wrapping the op)."""
    torch.manual_seed(0)
    hidden, inter = 16, 24
    w = {"o": torch.randn(hidden, hidden) / 4, "ln2": torch.randn(hidden), "down": torch.randn(hidden, inter) / 5}
    gate_up = torch.randn(2 * inter, hidden) / 4
    if case == "separate":
        w.update(gate=gate_up[:inter], up=gate_up[inter:])
    else:
        w["gate_up"] = gate_up
    if case == "lora":
        w["gate_lora"] = [(torch.randn(2, hidden) / 4, torch.randn(inter, 2) / 4, None, 0.5)]
    spec = _spec(act=F.gelu) if case == "gelu" else _spec()
    calls = []
    silu_mul = triton_pointwise.silu_mul
    monkeypatch.setattr(triton_pointwise, "silu_mul", lambda t: calls.append(t.shape) or silu_mul(t))
    x, attn, nxt = torch.randn(3, 1, hidden), torch.randn(3, 2, 1, 8), torch.randn(hidden)
    want_x, want_h = decoder.attention_out(spec, w, x, attn, nxt)
    got_x, got_h = decoder.attention_out(_spec(triton=True, act=spec.act), w, x, attn, nxt)
    assert (got_x - want_x).abs().max().item() < 1e-5 and (got_h - want_h).abs().max().item() < 1e-5
    assert len(calls) == (1 if case == "fused" else 0)
    assert torch.equal(decoder.attention_out(_spec(triton=True, act=spec.act), w, x, attn),
                       decoder.attention_out(_spec(triton=True, act=spec.act), w, x, attn, nxt)[0])


AHEAD_OF_TIME = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from posttrain.rollout.kernels import pointwise as tp

target = GPUTarget("cuda", 90, 32)
sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32", "inter": "i32", "stride_row": "i32", "BLOCK": "constexpr"}
k = triton.compile(ASTSource(tp._silu_mul, sig, {"BLOCK": 1024}), target=target, options={"num_warps": 4})
print("silu", "ld.global" in k.asm["ptx"])
c = {"H": 2048, "BLOCK_H": 2048, "ROWS": 1}
sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "x_out": "*bf16", "h_out": "*bf16", "rows": "i32",
       "eps": "fp32", **{n: "constexpr" for n in c}}
k = triton.compile(ASTSource(tp._add_rms_norm, sig, c), target=target, options={"num_warps": 8})
print("norm", "rsqrt" in k.asm["ptx"])
c = {"H": 32, "BLOCK_H": 32, "D": 64}
sig = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32",
       **{n: "i64" for n in ("sx_b", "sx_h", "sx_t", "sc_b", "sc_t", "ss_b", "ss_t")}, **{n: "constexpr" for n in c}}
k = triton.compile(ASTSource(tp._rope_heads, sig, c), target=target, options={"num_warps": 4})
print("rope", "st.global" in k.asm["ptx"])
"""


def test_the_pointwise_kernels_compile_for_an_h200(tmp_path):
    from conftest import compile_ahead_of_time

    out = compile_ahead_of_time(AHEAD_OF_TIME, tmp_path)
    assert out.split() == ["silu", "True", "norm", "True", "rope", "True"], out
