"""posttrain's ``varlen`` attention on this machine (issue 22): which torch kernel it found, whether its
forward and backward match SDPA run one document at a time, and one layer's attention time against
transformers' sdpa on the block-diagonal mask of a padding-free row.

One attention layer of the 1.1B shape (32 query heads, 4 key/value heads, head dim 64), bf16, 8
documents of lengths uniform in [128, 2048] (sft_race's mixed lengths) in one row.

    python benchmarks/varlen_check.py            # CUDA; on CPU it checks the per-document path only
"""

from __future__ import annotations

import inspect
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch
    import torch.nn.functional as F

    from posttrain.models import varlen_attention as va

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    fn, _ = va._kernel()
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "varlen_attn": str(inspect.signature(fn)) if fn else None, "kernel_runs": va.kernel_available(device)}
    from transformers import LlamaConfig

    kwargs: dict = {}  # what posttrain's SFT picks for padding-free rows on this device when no attention is asked
    report["sft_default_line"] = va.choose(kwargs, LlamaConfig(), True, device)
    report["sft_default_attention"] = kwargs.get("attn_implementation", "sdpa (transformers' default)")
    rng = random.Random(0)
    lens = [rng.randint(128, 2048) for _ in range(8)] if cuda else [5, 17, 3, 30]
    heads, kv_heads, dim = 32, 4, 64
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, h, dim, device=device, dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(total, heads, dim, device=device, dtype=dtype)

    def run(f):
        for x in (q, k, v):
            x.grad = None
        out = f()
        out.backward(grad)
        return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]

    def attend():  # what varlen_attention_forward runs for a padding-free row
        return va._attend(q, k, v, cu, cu, max(lens), max(lens), dim ** -0.5, True, 0.0)

    def per_document():
        return va._per_document(q.float(), k.float(), v.float(), cu, cu, dim ** -0.5, True, 0.0)

    def block_mask():  # transformers' sdpa on a padding-free row: a dense block-diagonal causal mask
        doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        mask = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool, device=device).tril()
        rep = heads // kv_heads  # with a mask transformers repeats the key/value heads (repeat_kv)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
                                             v.repeat_interleave(rep, 1).transpose(0, 1)[None], attn_mask=mask)
        return out[0].transpose(0, 1)

    ref = run(per_document)
    got = run(attend)
    report["max_abs_diff_out_dq_dk_dv"] = [float((a - b).abs().max()) for a, b in zip(got, ref)]
    report["max_abs_ref_out_dq_dk_dv"] = [float(b.abs().max()) for b in ref]
    if cuda:
        for name, f in (("varlen", attend), ("sdpa_block_mask", block_mask)):
            for _ in range(3):
                run(f)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                run(f)
            torch.cuda.synchronize()
            report[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - start) / 10 * 1e3
        report["lengths"] = lens
    print(json.dumps(report))
    worst = max(d / max(r, 1e-6) for d, r in zip(report["max_abs_diff_out_dq_dk_dv"], report["max_abs_ref_out_dq_dk_dv"]))
    ok = worst < (5e-2 if cuda else 1e-5)
    print(f"varlen check: {'ok' if ok else 'MISMATCH'} (worst difference {worst:.2e} of the largest value)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
