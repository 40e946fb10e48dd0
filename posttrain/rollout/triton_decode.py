"""Decode attention as a Triton kernel split over the keys (flash decoding), for the engine's cache.

One query token per row; the query heads of a group read their key/value head once. SDPA's cudnn
kernel, which the engine calls by default, reads the cache at 1.85 TB/s with the engine's additive
mask and at 2.84 without it (NOTES 22). This kernel takes the same mask ([B, L], 0 or -inf), reads
no masked key (a row's left padding, its columns past its end: the loads are predicated off per
key) and splits each row's columns over ``splits`` programs (a row's few heads alone do not fill
the GPU), whose partial outputs a second kernel merges by their log-sum-exps.

Numerics as SDPA's fused kernels: scores, softmax and the sums in float32, the probabilities cast
to the cache dtype for the value product. A row whose every key is masked gives zeros.

CPU runs it under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported), which
is how the tests check it against SDPA.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # what a kernel may read of a global


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, lse_ptr, final_ptr,
             sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sbias_b,
             so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s, sf_b, sf_h, sf_g,
             scale_log2, length, split_len,
             G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
             SKIP_MASKED: tl.constexpr, FINAL: tl.constexpr):
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
    lo = s * split_len
    hi = tl.minimum(lo + split_len, length)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores (base 2)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < hi
        bias = tl.load(bias_ptr + b * sbias_b + n, mask=inside, other=float("-inf")).to(tl.float32)
        read = inside
        if SKIP_MASKED:  # a masked key's row is not loaded (its 0 scores count nothing beside -inf)
            read = inside & (bias > float("-inf"))
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_l + d[None, :], mask=read[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2 + bias[None, :] * _LOG2E
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing unmasked yet: exp2(-inf) = 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_l + d[None, :], mask=read[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    if FINAL:  # one split: this is the output
        tl.store(final_ptr + b * sf_b + h * sf_h + g[:, None] * sf_g + d[None, :],
                 out.to(final_ptr.dtype.element_ty), mask=g[:, None] < G)
    else:
        lse = tl.where(total == 0.0, float("-inf"), m + tl.log2(tl.where(total == 0.0, 1.0, total)))
        tl.store(out_ptr + b * so_b + h * so_h + s * so_s + g[:, None] * so_g + d[None, :], out, mask=g[:, None] < G)
        tl.store(lse_ptr + b * sl_b + h * sl_h + s * sl_s + g, lse, mask=g < G)


@triton.jit
def _merge(out_ptr, lse_ptr, final_ptr, so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s, sf_b, sf_h, sf_g, splits,
           G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    live = (s[:, None] < splits) & (g[None, :] < G)
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + s[:, None] * sl_s + g[None, :], mask=live, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[None, :])  # [S, G]; empty splits give 0
    norm = tl.sum(weight, 0)
    weight = weight / tl.where(norm == 0.0, 1.0, norm)[None, :]
    parts = tl.load(out_ptr + b * so_b + h * so_h + s[:, None, None] * so_s + g[None, :, None] * so_g
                    + d[None, None, :], mask=live[:, :, None], other=0.0)
    out = tl.sum(parts * weight[:, :, None], 0)
    tl.store(final_ptr + b * sf_b + h * sf_h + g[:, None] * sf_g + d[None, :], out.to(final_ptr.dtype.element_ty),
             mask=g[:, None] < G)


def default_splits(rows: int, kv_heads: int, length: int, block_n: int, device: torch.device) -> int:
    """Enough programs for every SM about four times over, no split shorter than one key block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    want = math.ceil(4 * sms / max(1, rows * kv_heads))
    return max(1, min(triton.next_power_of_2(want), triton.next_power_of_2(math.ceil(length / block_n)), 16))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
                     splits: int | None = None, block_n: int = 64, skip_masked: bool = True, num_warps: int = 4,
                     num_stages: int = 2) -> torch.Tensor:
    """``q`` [B, kv_heads, G, d] (a group's query heads over their key/value head); ``keys`` and
    ``values`` [B, kv_heads, L, d] (views of a longer cache are read in place); ``bias`` [B, L] or
    [B, 1, 1, L] (0 or -inf). ``skip_masked``: masked keys are not read (left padding, columns
    past a row's end). Returns [B, kv_heads, G, d] in q's dtype."""
    b, hkv, groups, d = q.shape
    length = keys.shape[2]
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dimension contiguous in q, keys and values")
    bias = bias.reshape(b, length)
    splits = splits or default_splits(b, hkv, length, block_n, q.device)
    split_len = math.ceil(math.ceil(length / splits) / block_n) * block_n
    splits = math.ceil(length / split_len)
    final = torch.empty_like(q)
    block_g = max(16, triton.next_power_of_2(groups))  # tl.dot's smallest tile
    if splits > 1:
        parts = torch.empty(b, hkv, splits, groups, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hkv, splits, groups, dtype=torch.float32, device=q.device)
    else:
        parts = lse = final  # not written
    so = parts.stride()[:4] if splits > 1 else (0, 0, 0, 0)
    sl = lse.stride()[:3] if splits > 1 else (0, 0, 0)
    _partial[(b, hkv, splits)](
        q, keys, values, bias, parts, lse, final,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), bias.stride(0), *so, *sl,
        final.stride(0), final.stride(1), final.stride(2), scale * LOG2E, length, split_len,
        G=groups, BLOCK_G=block_g, D=d, BLOCK_N=block_n, SKIP_MASKED=skip_masked, FINAL=splits == 1,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _merge[(b, hkv)](parts, lse, final, *so, *sl, final.stride(0), final.stride(1), final.stride(2), splits,
                         G=groups, BLOCK_G=block_g, D=d, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                         num_warps=num_warps)
    return final


# The engine's step calls the kernel through this op, so torch.compile and CUDA graph capture see
# one opaque call with a known output (inductor does not trace into the launch).
@torch.library.custom_op("posttrain::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                        scale: float) -> torch.Tensor:
    return decode_attention(q, keys, values, bias, scale)


@decode_attention_op.register_fake
def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)
