"""The engine's Triton pointwise kernels (SiLU-and-multiply, add + RMSNorm, the prefill's rotary embedding),
rounding as transformers' eager modules."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from posttrain.rollout.kernels.decode_attention import _rope

SILU_BLOCK = 1024  # elements a program
SILU_WARPS = 4
NORM_ROWS = 1  # rows a program
NORM_WARPS = 8


@triton.jit
def _silu_mul(x_ptr, out_ptr, n, inter, stride_row, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row, col = (i // inter).to(tl.int64), i % inter  # 64-bit offsets: a long prefill's rows x 2 x inter
    g = tl.load(x_ptr + row * stride_row + col, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_row + inter + col, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + i, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, x_out, h_out, rows, eps, H: tl.constexpr, BLOCK_H: tl.constexpr,
                  ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_H)
    ok = (r < rows)[:, None] & (c < H)[None, :]
    at = r.to(tl.int64)[:, None] * H + c[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0) + tl.load(r_ptr + at, mask=ok, other=0.0)
    tl.store(x_out + at, x, mask=ok)
    xf = x.to(tl.float32)
    scale = tl.math.rsqrt(tl.sum(xf * xf, 1) / H + eps)
    h = (xf * scale[:, None]).to(x.dtype)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0)
    tl.store(h_out + at, (w[None, :].to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=ok)


@triton.jit
def _rope_heads(x_ptr, cos_ptr, sin_ptr, out_ptr, T, sx_b, sx_h, sx_t, sc_b, sc_t, ss_b, ss_t,
                H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)  # one position of one row, every head
    b, t = bt // T, bt % T
    h, d = tl.arange(0, BLOCK_H), tl.arange(0, D)
    ok = (h < H)[:, None]
    at = x_ptr + b * sx_b + t * sx_t + h[:, None] * sx_h
    x = tl.load(at + d[None, :], mask=ok, other=0.0)
    partner = tl.load(at + ((d + D // 2) % D)[None, :], mask=ok, other=0.0)  # rotate_half's source
    cos = tl.load(cos_ptr + b * sc_b + t * sc_t + d)[None, :]
    sin = tl.load(sin_ptr + b * ss_b + t * ss_t + d)[None, :]
    tl.store(out_ptr + ((b * H + h[:, None]) * T + t) * D + d[None, :], _rope(x, partner, cos, sin, D), mask=ok)


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` of ``x`` [B, H, T, d] (any strides; unit along d), cos and sin
    [B, T, d]: contiguous [B, H, T, d], what SDPA reads without a copy."""
    b, heads, t, d = x.shape
    out = torch.empty((b, heads, t, d), dtype=x.dtype, device=x.device)
    if out.numel():
        _rope_heads[(b * t,)](x, cos, sin, out, t, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                              cos.stride(1), sin.stride(0), sin.stride(1), H=heads,
                              BLOCK_H=triton.next_power_of_2(heads), D=d, num_warps=SILU_WARPS)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up``'s halves along its last dimension (unit stride)."""
    lead, width = gate_up.shape[:-1], gate_up.shape[-1]
    x = gate_up.reshape(-1, width)
    inter = width // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    n = out.numel()
    _silu_mul[(triton.cdiv(n, SILU_BLOCK),)](x, out, n, inter, x.stride(0), BLOCK=SILU_BLOCK, num_warps=SILU_WARPS)
    return out.view(*lead, inter)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` and its RMSNorm by ``weight`` (``decoder.rms_norm``), contiguous [..., H]."""
    h = x.shape[-1]
    x2, r2 = x.reshape(-1, h).contiguous(), residual.reshape(-1, h).contiguous()
    total, normed = torch.empty_like(x2), torch.empty_like(x2)
    rows = x2.shape[0]
    _add_rms_norm[(triton.cdiv(rows, NORM_ROWS),)](x2, r2, weight, total, normed, rows, eps, H=h,
                                                   BLOCK_H=triton.next_power_of_2(h), ROWS=NORM_ROWS,
                                                   num_warps=NORM_WARPS)
    return total.view(x.shape), normed.view(x.shape)


@torch.library.custom_op("posttrain::silu_mul", mutates_args=())
def silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(gate_up)


@silu_mul_op.register_fake
def _(gate_up):  # noqa: ANN001, ANN202
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("posttrain::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, residual, weight, eps)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as add_rms_norm returns them


@torch.library.custom_op("posttrain::rope_heads", mutates_args=())
def rope_heads_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope_heads(x, cos, sin)


@rope_heads_op.register_fake
def _(x, cos, sin):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)  # contiguous
