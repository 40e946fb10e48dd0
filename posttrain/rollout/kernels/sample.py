"""The engine's sampler (``sampling.choose_tokens`` without top-k/top-p) as a Triton kernel over vocabulary
chunks. CPU runs it under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _mix(x):
    """``sampling._hash32`` on uint32 (multiplication wraps, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _partial(logits_ptr, stride_row, key_ptr, step_ptr, seq_ptr, stop_ptr, temp_ptr, sample_ptr, min_new_ptr,
             max_ptr, sum_ptr, best_ptr, index_ptr, vocab, chunk, CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
             HAS_STOP: tl.constexpr):
    """Program (row, c): max and exp-sum of the chunk's scaled logits and its first best noised one."""
    row, c = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temp_ptr)
    do_sample = tl.load(sample_ptr)
    step = tl.load(step_ptr + row)
    early = step < tl.load(min_new_ptr)
    # gumbel_noise's row hash modulo 2**32: the int64 products' low bits are the uint32 products.
    base = _mix(tl.load(key_ptr + row).to(tl.uint32) ^ (step.to(tl.uint32) * 0x2545F491))
    base = _mix(base + tl.load(seq_ptr + row).to(tl.uint32) * 0x5851F42D)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    # Per lane, no cross-lane reduction in the loop; strictly larger, so a lane keeps its first best.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    index = tl.zeros([BLOCK_V], tl.int32) + lo
    for start in range(0, chunk, BLOCK_V):  # bounds from arguments, not program ids: every Triton interpreter takes them
        v = lo + start + tl.arange(0, BLOCK_V)
        ok = v < hi
        scaled = tl.load(logits_ptr + row * stride_row + v, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        above = scaled > m
        e = tl.exp(tl.where(above, m - scaled, scaled - m))  # 0 where either is -inf and the other not
        total = tl.where(above, total * e + 1.0, total + tl.where(scaled == float("-inf"), 0.0, e))
        m = tl.maximum(m, scaled)
        pick = scaled
        if HAS_STOP:
            barred = tl.load(stop_ptr + v, mask=ok, other=0) != 0
            pick = tl.where(barred & early, float("-inf"), pick)
        bits = _mix(base ^ _mix((v + 0x9E3779B).to(tl.uint32)))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)  # sampling.gumbel_from_bits
        pick = tl.where(ok, pick + -tl.log(-tl.log(u)) * do_sample, float("-inf"))
        index = tl.where(pick > best, v, index)
        best = tl.maximum(best, pick)
    top = tl.max(m, 0)
    lane_sum = tl.where(m == float("-inf"), 0.0, total * tl.exp(m - top))
    chunk_best = tl.max(best, 0)
    first = tl.min(tl.where(best == chunk_best, index, 2147483647), 0)  # the first index among the ties
    out = row * CHUNKS + c
    tl.store(max_ptr + out, top)
    tl.store(sum_ptr + out, tl.sum(lane_sum, 0))
    tl.store(best_ptr + out, chunk_best)
    tl.store(index_ptr + out, first)


def chunks_for(vocab: int) -> int:
    """Chunks a row: four blocks or more each, at most 16, independent of the rows."""
    return max(1, min(16, triton.cdiv(vocab, 4 * BLOCK_V)))


def _chunking(vocab: int, chunks: int) -> tuple[int, int]:
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK_V) * BLOCK_V
    return chunk, triton.cdiv(vocab, chunk)


def partials(logits: torch.Tensor, key: torch.Tensor, step: torch.Tensor, seq: torch.Tensor,
             stop_mask: torch.Tensor | None,
             temperature: torch.Tensor, do_sample: torch.Tensor, min_new: torch.Tensor, chunks: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and chunk: max, sum of exponentials, best noised logit and its index ([rows, chunks])."""
    rows, vocab = logits.shape
    chunk, chunks = _chunking(vocab, chunks)
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, total, best = (torch.empty((rows, chunks), **f32) for _ in range(3))
    index = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    stop = stop_mask if stop_mask is not None else m  # not read
    key = key.expand(rows).contiguous() if key.dim() == 0 else key  # one key per row
    _partial[(rows, chunks)](logits, logits.stride(0), key, step, seq, stop, temperature, do_sample, min_new, m, total,
                             best, index, vocab, chunk, CHUNKS=chunks, BLOCK_V=BLOCK_V, HAS_STOP=stop_mask is not None,
                             num_warps=4)
    return m, total, best, index


@torch.library.custom_op("posttrain::sample_partials", mutates_args=())
def sample_partials_op(logits: torch.Tensor, key: torch.Tensor, step: torch.Tensor, seq: torch.Tensor,
                       stop_mask: torch.Tensor | None, temperature: torch.Tensor, do_sample: torch.Tensor,
                       min_new: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return partials(logits, key, step, seq, stop_mask, temperature, do_sample, min_new, chunks)


@sample_partials_op.register_fake
def _(logits, key, step, seq, stop_mask, temperature, do_sample, min_new, chunks):  # noqa: ANN001, ANN202
    rows, vocab = logits.shape
    shape = (rows, _chunking(vocab, chunks)[1])
    f32 = logits.new_empty(shape, dtype=torch.float32)
    return f32, torch.empty_like(f32), torch.empty_like(f32), logits.new_empty(shape, dtype=torch.int64)


def choose_tokens(logits: torch.Tensor, step: torch.Tensor, key: torch.Tensor, seq: torch.Tensor,
                  temperature: torch.Tensor, do_sample: torch.Tensor, min_new: torch.Tensor,
                  stop_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.choose_tokens`` sans top-k/top-p, logits [B, V]; scalars 0-d, ``key`` 0-d or one per row,
    ``stop_mask`` [V] or None."""
    m, total, best, index = torch.ops.posttrain.sample_partials(logits, key, step, seq, stop_mask, temperature,
                                                                do_sample, min_new, chunks_for(logits.shape[1]))
    top = m.amax(1, keepdim=True)
    log_sum = torch.log((total * torch.exp(m - top)).sum(1))
    tokens = index.gather(1, best.argmax(1, keepdim=True)).squeeze(1)
    scaled = logits.gather(1, tokens.unsqueeze(1)).squeeze(1).float() / temperature
    return tokens, (scaled - top.squeeze(1)) - log_sum
