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
"""


def test_the_pointwise_kernels_compile_for_an_h200(tmp_path):
    from conftest import compile_ahead_of_time

    out = compile_ahead_of_time(AHEAD_OF_TIME, tmp_path)
    assert out.split() == ["silu", "True", "norm", "True"], out
