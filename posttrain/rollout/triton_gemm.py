"""The decode step's projections as one Triton kernel: ``x @ w.T`` for a few rows (one token per
row), the weights' columns split over programs where the rows are too few to fill the GPU.

At 128 rows cuBLAS reads the 1.1B Llama's q|k|v and o weights at 1.3-1.6 TB/s and splits the down
projection's inner dimension with a reduction kernel of its own (NOTES 26). Here each program
multiplies one tile of rows x outputs over one slice of the inner dimension and writes its float32
partial; the last program of a tile to finish (a counter per tile) sums the tile's partials in
split order, so the result does not depend on which program ends first, and resets the counter.
No launch of its own for the reduction, and none for SiLU-and-multiply when the down projection
takes the gate|up output (``gated``): the kernel computes ``silu(gate) * up`` as it loads it,
rounded as eager torch rounds each op.

CPU runs it under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported), which
is how the tests check it, in float32 (the interpreter's ``tl.dot`` takes bf16 for integers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMS_DEFAULT = 132  # an H100/H200's; the device's own count is used where there is one


@triton.jit
def _gemm(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_split,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
          GATED: tl.constexpr, PRECISION: tl.constexpr):
    """``out[M, N] = x[M, K] @ w[N, K].T`` (``GATED``: x is [M, 2K], ``silu(x[:, :K]) * x[:, K:]``).
    Program (n, s, m): output tile (m, n) over inner columns ``s * k_split`` on. ``PRECISION``:
    "ieee" for float32 inputs (not TF32)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    lo = pid_s * k_split
    hi = tl.minimum(lo + k_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(lo, hi, BLOCK_K):
        kk = k + rk
        k_ok = kk < hi
        a_mask = m_ok[:, None] & k_ok[None, :]
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
        if GATED:  # eager's rounding: silu in float32 rounded to x's dtype, the product rounded too
            up = tl.load(x_ptr + rm[:, None] * stride_xm + (kk + K)[None, :], mask=a_mask, other=0.0)
            g = a.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(a.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(a.dtype)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_s * M * N + tile, acc, mask=out_mask)
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        # acq_rel: this program's partial is visible before its count, the others' to the last one.
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLITS):  # split order, not arrival order: the same sum every time
                total += tl.load(part_ptr + s * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (on the same stream)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, kept per device (each launch leaves them zero)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SMS_DEFAULT


def layout(m: int, n: int, k: int, sms: int, block_n: int | None = None, block_k: int | None = None,
           splits: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits): rows in one tile where they fit (up to 128), and the
    inner dimension split until tiles x splits about fill the SMs, each split at least two blocks."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = block_n or 64
    block_k = block_k or 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if splits is None:
        splits = max(1, min(sms // tiles, triton.cdiv(k, 2 * block_k)))
    return block_m, block_n, block_k, splits


def matmul(x: torch.Tensor, w: torch.Tensor, gated: bool = False, block_n: int | None = None,
           block_k: int | None = None, splits: int | None = None, num_warps: int = 4, num_stages: int = 3
           ) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [..., K] (``gated``: [..., 2K], ``silu(gate) * up`` of its halves) and
    ``w`` [N, K] with unit inner strides; the output in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, n, k = x2.shape[0], w.shape[0], w.shape[1]
    assert x2.shape[1] == (2 * k if gated else k) and x2.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk, s = layout(m, n, k, _sms(x.device), block_n, block_k, splits)
    k_split = triton.cdiv(triton.cdiv(k, s), bk) * bk
    s = triton.cdiv(k, k_split)
    grid = (triton.cdiv(n, bn), s, triton.cdiv(m, bm))
    part = torch.empty((s, m, n) if s > 1 else (1,), dtype=torch.float32, device=x.device)
    counters = _counters(x.device, grid[0] * grid[2])
    _gemm[grid](x2, w, out, part, counters, m, n, k, x2.stride(0), w.stride(0), out.stride(0), k_split,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLITS=s, GATED=gated,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
                num_stages=num_stages)
    return out.view(*lead, n)
