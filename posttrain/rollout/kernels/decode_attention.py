"""Decode attention as Triton kernels over the engine's cache, rounding as SDPA's fused kernels. CPU runs
them under ``TRITON_INTERPRET=1`` (the tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NUM_WARPS = 2
NUM_STAGES = 2  # software pipelining of the key loop

NewKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the step's keys, values [B, kv_heads, 1, d], columns [B]
Rope = tuple[torch.Tensor, torch.Tensor]  # each row's rotary cos, sin [B, d]


@triton.jit
def _attend(q, k_base, v_base, bias_base, sk_l, sv_l, length, scale_log2, k_new, v_new, col,
            M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
            HAS_NEW: tl.constexpr):
    """Queries ``q`` [M, D] over keys ``0:length``: the normalized output and the log2-sum-exp (-inf if all
    masked); ``HAS_NEW`` attends column ``col`` from registers."""
    d = tl.arange(0, D)
    m = tl.full([M], float("-inf"), tl.float32)  # running max of the unscaled scores
    total = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < length
        bias = tl.load(bias_base + n, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_NEW:
            bias = tl.where(n == col, float("-inf"), bias)
        read = inside & (bias > float("-inf"))  # a masked key's row is not loaded
        k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=read[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) + bias[None, :]
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing unmasked yet: p = 0, alpha = 0
        alpha = tl.exp2((m - m_safe) * scale_log2)
        p = tl.exp2(tl.fma(scores, scale_log2, -(m_safe * scale_log2)[:, None]))
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * sv_l + d[None, :], mask=read[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if HAS_NEW:  # the step's own key, last (it is the row's last column)
        at = tl.zeros([M], tl.int32) + col  # vectors: the interpreter does not broadcast scalar addresses
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)
        score += tl.load(bias_base + at).to(tl.float32)
        m_new = tl.maximum(m, score)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * scale_log2)
        p = tl.exp2(tl.fma(score, scale_log2, -(m_safe * scale_log2)))
        total = total * alpha + p
        acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    empty = total == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, total))[:, None]
    return out, tl.where(empty, float("-inf"), m * scale_log2 + tl.log2(tl.where(empty, 1.0, total)))


@triton.jit
def _rope(x, partner, cos, sin, D: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` rounded as eager ``apply_rotary_pos_emb``."""
    d = tl.arange(0, D)
    rot = tl.where(d < D // 2, -partner.to(tl.float32), partner.to(tl.float32))
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
    b = (rot * sin.to(tl.float32)).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@triton.jit
def _own(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, lse_ptr, kn_ptr, vn_ptr, col_ptr, cos_ptr, sin_ptr,
         sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sbias_b,
         so_b, so_h, so_g, sl_b, sl_h, skn_b, skn_h, svn_b, svn_h, scos_b, ssin_b, scale_log2, length,
         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
         PARTIAL: tl.constexpr, PRECISION: tl.constexpr, HAS_NEW: tl.constexpr, ROPE: tl.constexpr):
    """Row b's query heads of kv head h over its own keys (``PARTIAL``: float32 partial and lse);
    ``HAS_NEW`` caches k/v, ``ROPE`` rotates."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)  # b * a cache stride: past 2**31
    g = tl.arange(0, BLOCK_G)
    mine = g < G
    d = tl.arange(0, D)
    q_at = q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g
    q = tl.load(q_at + d[None, :], mask=mine[:, None], other=0.0)
    if ROPE:
        cos, sin = tl.load(cos_ptr + b * scos_b + d), tl.load(sin_ptr + b * ssin_b + d)
        q = _rope(q, tl.load(q_at + ((d + D // 2) % D)[None, :], mask=mine[:, None], other=0.0), cos[None, :],
                  sin[None, :], D)
    k_base, v_base = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h
    col = -1
    k_new = tl.zeros([D], k_ptr.dtype.element_ty)
    v_new = tl.zeros([D], v_ptr.dtype.element_ty)
    if HAS_NEW:
        col = tl.minimum(tl.load(col_ptr + b), length - 1)
        k_new = tl.load(kn_ptr + b * skn_b + h * skn_h + d)
        if ROPE:
            k_new = _rope(k_new, tl.load(kn_ptr + b * skn_b + h * skn_h + (d + D // 2) % D), cos, sin, D)
        v_new = tl.load(vn_ptr + b * svn_b + h * svn_h + d)
        tl.store(k_base + col * sk_l + d, k_new)
        tl.store(v_base + col * sv_l + d, v_new)
    out, lse = _attend(q, k_base, v_base, bias_ptr + b * sbias_b, sk_l, sv_l, length, scale_log2, k_new, v_new, col,
                       BLOCK_G, D, BLOCK_N, PRECISION, HAS_NEW)
    at = out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :]
    if PARTIAL:
        tl.store(at, out, mask=mine[:, None])
        tl.store(lse_ptr + b * sl_b + h * sl_h + g, lse, mask=mine)
    else:
        tl.store(at, out.to(out_ptr.dtype.element_ty), mask=mine[:, None])


@triton.jit
def _prompt(q_ptr, k_ptr, v_ptr, bias_ptr, members_ptr, out_ptr, lse_ptr, cos_ptr, sin_ptr,
            sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sbias_b, smem,
            so_b, so_h, so_g, sl_b, sl_h, scos_b, ssin_b, scale_log2, length, rows,
            G: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr):
    """Prompt slot p's member rows over the prompt's keys, written as each row's prompt partial."""
    p, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    r = tl.load(members_ptr + p * smem + i // G, mask=i < MEMBERS * G, other=rows)  # rows: no member
    live = (i < MEMBERS * G) & (r < rows)
    g = i % G
    q_at = q_ptr + r[:, None] * sq_b + h * sq_h + g[:, None] * sq_g
    q = tl.load(q_at + d[None, :], mask=live[:, None], other=0.0)
    if ROPE:
        cos = tl.load(cos_ptr + r[:, None] * scos_b + d[None, :], mask=live[:, None], other=0.0)
        sin = tl.load(sin_ptr + r[:, None] * ssin_b + d[None, :], mask=live[:, None], other=0.0)
        q = _rope(q, tl.load(q_at + ((d + D // 2) % D)[None, :], mask=live[:, None], other=0.0), cos, sin, D)
    zero = tl.zeros([D], k_ptr.dtype.element_ty)
    out, lse = _attend(q, k_ptr + p * sk_b + h * sk_h, v_ptr + p * sv_b + h * sv_h, bias_ptr + p * sbias_b,
                       sk_l, sv_l, length, scale_log2, zero, zero, -1, BLOCK_M, D, BLOCK_N, PRECISION, False)
    tl.store(out_ptr + r[:, None] * so_b + h * so_h + g[:, None] * so_g + d[None, :], out, mask=live[:, None])
    tl.store(lse_ptr + r * sl_b + h * sl_h + g, lse, mask=live)


@triton.jit
def _merge(out_ptr, lse_ptr, final_ptr, place_ptr, members_ptr, so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s,
           sf_b, sf_h, sf_g, smem, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, MEMBERS: tl.constexpr):
    """Row b's own and prompt partials merged by log-sum-exp (the prompt's only for a member)."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.arange(0, 2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    place = tl.load(place_ptr + b)
    member = tl.load(members_ptr + (place // MEMBERS) * smem + place % MEMBERS) == b
    live = (s[:, None] < tl.where(member, 2, 1)) & (g[None, :] < G)
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + s[:, None] * sl_s + g[None, :], mask=live, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[None, :])  # [2, G]; an empty part gives 0
    norm = tl.sum(weight, 0)
    weight = weight / tl.where(norm == 0.0, 1.0, norm)[None, :]
    parts = tl.load(out_ptr + b * so_b + h * so_h + s[:, None, None] * so_s + g[None, :, None] * so_g
                    + d[None, None, :], mask=live[:, :, None], other=0.0)
    out = tl.sum(parts * weight[:, :, None], 0)
    tl.store(final_ptr + b * sf_b + h * sf_h + g[:, None] * sf_g + d[None, :], out.to(final_ptr.dtype.element_ty),
             mask=g[:, None] < G)


def block_size(head_dim: int) -> int:
    """Keys a block of the key loop: 128 for heads of up to 64, else 64."""
    return 128 if head_dim <= 64 else 64


def _precision(q: torch.Tensor) -> str:
    """float32 products as float32 (SDPA's), not TF32; half types multiply exactly either way."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _check(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("decode attention needs the head dimension contiguous in q, keys and values")


def _tile(rows: int) -> int:
    """An MMA tile's rows for ``rows`` queries (tl.dot's smallest is 16)."""
    return max(16, triton.next_power_of_2(rows))


def _launch_own(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor | None, scale: float, block_n: int, new: NewKV | None, rope: Rope | None) -> None:
    b, hkv, groups, d = q.shape
    k_new, v_new, col = new if new is not None else (keys, values, out)
    cos, sin = rope if rope is not None else (out, out)
    if new is not None:
        _check(k_new, v_new)
    sl = lse.stride()[:2] if lse is not None else (0, 0)
    # No FP contraction: a fused rotation FMA would round the cached keys unlike the training forward.
    _own[(b, hkv)](
        q, keys, values, bias, out, out if lse is None else lse, k_new, v_new, col, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), bias.stride(0),
        out.stride(0), out.stride(1), out.stride(2), *sl, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), cos.stride(0), sin.stride(0), scale * LOG2E, keys.shape[2],
        G=groups, BLOCK_G=_tile(groups), D=d, BLOCK_N=block_n, PARTIAL=lse is not None, PRECISION=_precision(q),
        HAS_NEW=new is not None, ROPE=rope is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=False)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
                     block_n: int | None = None, new: NewKV | None = None, rope: Rope | None = None) -> torch.Tensor:
    """``q`` [B, kv_heads, G, d] over ``keys``/``values`` [B, kv_heads, L, d]; ``new`` = (k, v, col) cached
    by the kernel, ``rope`` = (cos, sin) applied in it."""
    b, _, _, d = q.shape
    _check(q, keys, values)
    out = torch.empty_like(q)
    _launch_own(q, keys, values, bias.reshape(b, keys.shape[2]), out, None, scale, block_n or block_size(d), new,
                rope)
    return out


def decode_attention_shared(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                            pkeys: torch.Tensor, pvalues: torch.Tensor, pbias: torch.Tensor, members: torch.Tensor,
                            place: torch.Tensor, scale: float, block_n: int | None = None, new: NewKV | None = None,
                            rope: Rope | None = None) -> torch.Tensor:
    """:func:`decode_attention` over each row's shared prompt slot (``pkeys``..``place``) and own keys."""
    b, hkv, groups, d = q.shape
    slots, n = members.shape
    length, width = keys.shape[2], pkeys.shape[2]
    _check(q, keys, values, pkeys, pvalues)
    bias, pbias = bias.reshape(b, length), pbias.reshape(slots, width)
    members, place = members.contiguous(), place.contiguous()
    block = block_n or block_size(d)
    parts = torch.empty(b, hkv, 2, groups, d, dtype=torch.float32, device=q.device)  # own, prompt
    lse = torch.empty(b, hkv, 2, groups, dtype=torch.float32, device=q.device)
    _launch_own(q, keys, values, bias, parts[:, :, 0], lse[:, :, 0], scale, block, new, rope)
    cos, sin = rope if rope is not None else (q, q)
    prompt_parts, prompt_lse = parts[:, :, 1], lse[:, :, 1]
    _prompt[(slots, hkv)](
        q, pkeys, pvalues, pbias, members, prompt_parts, prompt_lse, cos, sin, q.stride(0), q.stride(1), q.stride(2),
        pkeys.stride(0), pkeys.stride(1), pkeys.stride(2), pvalues.stride(0), pvalues.stride(1), pvalues.stride(2),
        pbias.stride(0), members.stride(0), *prompt_parts.stride()[:3], *prompt_lse.stride()[:2], cos.stride(0),
        sin.stride(0), scale * LOG2E, width, b, G=groups, MEMBERS=n, BLOCK_M=_tile(n * groups), D=d, BLOCK_N=block,
        PRECISION=_precision(q), ROPE=rope is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=False)
    final = torch.empty_like(q)
    _merge[(b, hkv)](parts, lse, final, place, members, *parts.stride()[:4], *lse.stride()[:3], final.stride(0),
                     final.stride(1), final.stride(2), members.stride(0), G=groups, BLOCK_G=_tile(groups), D=d,
                     MEMBERS=n, num_warps=NUM_WARPS)
    return final


def attend_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                bias: torch.Tensor, col: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                prompt: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """One decode step's attention as the engine runs it: rotates and caches ``k``/``v``."""
    b, heads, _, d = q.shape
    qg = q.reshape(b, keys.shape[1], heads // keys.shape[1], d)
    new, rope = (k, v, col), (cos.reshape(b, d), sin.reshape(b, d))
    if prompt is None:
        out = decode_attention(qg, keys, values, bias, scale, new=new, rope=rope)
    else:
        out = decode_attention_shared(qg, keys, values, bias, *prompt, scale, new=new, rope=rope)
    return out.reshape(b, heads, 1, d)
