"""Decode attention alone at the rollout engine's shapes (issue 20: the 1.1B step at 128 x 768 is
attention-bound, NOTES sections 21-22): one query per row and query head, the query heads of a
group over their key/value head, an additive key mask, as ``decoder.decode_attention`` calls SDPA.

Beside that call (``sdpa``, whatever kernel SDPA dispatches to), each SDPA backend forced, and the
keys split into S chunks ("split-K", as flash decoding does): the cache slice viewed, without a
copy, as [rows * kv_heads, S, L / S, head_dim] (the splits take the place of the heads), each
chunk's output and log-sum-exp from SDPA's memory-efficient kernel (``decoder.sdpa_lse``), merged
by their log-sum-exps. ``triton_*``: posttrain's Triton kernel split over the keys
(``posttrain/rollout/triton_decode.py``, ``SxN``: S splits and key blocks of N, either ``auto``
for the kernel's own choice; then ``:r`` masked keys read too, not skipped, ``:wW`` W warps,
``:stK`` K stages), loaded from its file so that the probe needs only torch and Triton. Each
variant runs once per layer on its own cache (22 of them: the L2 cache does not hold the keys
between layers) inside one CUDA graph; the time is a replay's over 22.

    python benchmarks/decode_attention_probe.py --shapes 128x768,16x512 --out probe.json
    python benchmarks/decode_attention_probe.py --device cpu --shapes 4x64 --layers 2   (outputs only)
    python benchmarks/decode_attention_probe.py --numerics --shapes 32x384 --triton autoxauto,1x128:rev:sm
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KV_HEADS, GROUPS, HEAD_DIM = 4, 8, 64  # the 1.1B Llama: 32 query heads, 4 key/value heads


def split_keys(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, split_bias: torch.Tensor, splits: int,
               scale: float) -> torch.Tensor:
    """Attention over the keys in ``splits`` chunks, merged. ``q`` [B, H, G, d]; ``keys``/``values``
    [B, H, L, d] (a slice of a longer cache: only its rows and heads merge); ``split_bias``
    [B * H, S, 1, L / S] (the mask, laid out once a step)."""
    b, h, g, d = q.shape
    chunk = keys.shape[2] // splits
    ks = keys.reshape(b * h, splits, chunk, d)  # a view: rows and heads merge, the keys split
    vs = values.reshape(b * h, splits, chunk, d)
    from posttrain.rollout.decoder import sdpa_lse

    qs = q.reshape(b * h, 1, g, d).expand(b * h, splits, g, d).contiguous()
    out, lse = sdpa_lse(qs, ks, vs, split_bias, scale)  # [BH, S, G, d], [BH, S, G]
    weight = torch.softmax(lse, dim=1).unsqueeze(-1)  # each chunk's share of the softmax's mass
    return (out.float() * weight).sum(1).to(q.dtype).view(b, h, g, d)


def graph_us(calls: list[Callable[[], Any]], replays: int = 50) -> float:
    """Microseconds a call: ``calls`` warmed up on a side stream, captured in one CUDA graph,
    replayed ``replays`` times between CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays / len(calls)


def triton_kernel() -> Any:
    """posttrain's Triton decode kernel from its file (not through the package, which imports transformers)."""
    spec = importlib.util.spec_from_file_location("triton_decode", ROOT / "posttrain" / "rollout" / "triton_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def triton_options(config: str) -> dict[str, Any]:
    """``SxN[:r][:wW][:stK][:n]`` as the kernel's keyword arguments (``n``: as the engine's step
    calls it, the step's key and value written and q and k rotated by the kernel). The switches
    that NOTES 25 measured for the numerics (the new key in the loop, the block order, the max over
    scaled scores, the sum over rounded probabilities: flags a, rev, sm, sr) were in the kernel at
    commit 2411293, a group's query heads spread over programs (hH) at b6ed6d9."""
    head, *flags = config.split(":")
    s, n = head.split("x")
    options: dict[str, Any] = {"splits": None if s == "auto" else int(s), "block_n": None if n == "auto" else int(n)}
    for flag in flags:
        if flag == "r":
            options["skip_masked"] = False
        elif flag == "n":
            options["in_step"] = True
        elif flag.startswith("st"):
            options["num_stages"] = int(flag[2:])
        elif flag.startswith("w"):
            options["num_warps"] = int(flag[1:])
        else:
            raise SystemExit(f"--triton {config!r}: flags are r, wW, stK, n")
    return options


def triton_call(kernel: Any, options: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """The kernel with ``options`` (:func:`triton_options`), called as ``variants`` calls the rest;
    in-step (``n``), the step's key and value (copies of the row's last column, made on the first
    call, before any capture) written by the kernel, and q and k rotated by it (cos 1, sin 0: the
    same work, and the output still comparable with the reference)."""
    options = dict(options)
    in_step = options.pop("in_step", False)
    held: dict[int, tuple[torch.Tensor, ...]] = {}

    def run(q, k, v, bias, _sb, scale):
        extra: dict[str, Any] = {}
        if in_step:
            b, h, length, d = k.shape
            if k.data_ptr() not in held:
                held[k.data_ptr()] = (k[:, :, length - 1 :].clone(), v[:, :, length - 1 :].clone(),
                                      torch.full((b,), length - 1, dtype=torch.long, device=q.device),
                                      torch.ones(b, d, dtype=q.dtype, device=q.device),
                                      torch.zeros(b, d, dtype=q.dtype, device=q.device))
            kn, vn, col, cos, sin = held[k.data_ptr()]
            extra.update(new=(kn, vn, col), rope=(cos, sin))
        return kernel.decode_attention(q, k, v, bias, scale, **options, **extra)
    return run


def variants(splits: list[int], cuda: bool, triton_configs: list[str]) -> dict[str, Callable[..., torch.Tensor]]:
    def forced(backend: SDPBackend, masked: bool = True) -> Callable[..., torch.Tensor]:
        def run(q, k, v, bias, _split_bias, scale):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias if masked else None, scale=scale)
        return run

    out: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa": lambda q, k, v, bias, _sb, scale: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)}
    if cuda:
        out.update(cudnn=forced(SDPBackend.CUDNN_ATTENTION), efficient=forced(SDPBackend.EFFICIENT_ATTENTION),
                   flash_no_mask=forced(SDPBackend.FLASH_ATTENTION, masked=False),
                   cudnn_no_mask=forced(SDPBackend.CUDNN_ATTENTION, masked=False))
    def split(s: int) -> Callable[..., torch.Tensor]:
        return lambda q, k, v, _bias, split_bias, scale: split_keys(q, k, v, split_bias[s], s, scale)

    out.update({f"split{s}": split(s) for s in splits})
    if triton_configs:
        kernel = triton_kernel()

        out.update({f"triton_{c.replace(':', '_')}": triton_call(kernel, triton_options(c)) for c in triton_configs})
    return out


def probe(rows: int, length: int, layers: int, splits: list[int], device: torch.device, replays: int,
          triton_configs: list[str]) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    cache_len = length + 128  # the engine reads a column bucket of a longer cache
    q = torch.randn(rows, KV_HEADS, GROUPS, HEAD_DIM, device=device, dtype=dtype)
    caches = [(torch.randn(rows, KV_HEADS, cache_len, HEAD_DIM, device=device, dtype=dtype),
               torch.randn(rows, KV_HEADS, cache_len, HEAD_DIM, device=device, dtype=dtype)) for _ in range(layers)]
    valid = torch.arange(length) >= (torch.arange(rows) % 7).unsqueeze(1) * 3  # some left padding
    bias = torch.zeros(rows, 1, 1, length, dtype=dtype).masked_fill(~valid.view(rows, 1, 1, length), float("-inf"))
    bias = bias.to(device)
    split_bias = {s: bias.view(rows, 1, s, length // s).expand(rows, KV_HEADS, s, length // s)
                  .reshape(rows * KV_HEADS, s, 1, length // s).contiguous() for s in splits if length % s == 0}
    scale = HEAD_DIM ** -0.5
    ref_k, ref_v = caches[0][0][:, :, :length].float(), caches[0][1][:, :, :length].float()
    reference = torch.softmax(q.float() @ ref_k.transpose(-1, -2) * scale + bias.float(), -1) @ ref_v
    results = []
    for name, fn in variants([s for s in splits if s in split_bias], cuda, triton_configs).items():
        row: dict[str, Any] = {"rows": rows, "columns": length, "variant": name}
        try:
            def layer_calls(fn: Callable[..., torch.Tensor] = fn) -> torch.Tensor:
                out = None
                for k, v in caches:
                    out = fn(q, k[:, :, :length], v[:, :, :length], bias, split_bias, scale)
                return out

            first = fn(q, caches[0][0][:, :, :length], caches[0][1][:, :, :length], bias, split_bias, scale)
            row["max_abs_diff"] = (first.float() - reference).abs().max().item()
            if cuda:
                us = graph_us([layer_calls], replays) / layers
                kv_bytes = 2 * rows * KV_HEADS * length * HEAD_DIM * q.element_size()
                row.update(us_per_layer=round(us, 2), kv_tb_per_s=round(kv_bytes / us / 1e6, 3))
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one variant that cannot run must not lose the others
            row.update(status="error", error=f"{type(err).__name__}: {str(err)[:300]}")
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def numerics(rows: int, length: int, device: torch.device, triton_configs: list[str]) -> list[dict[str, Any]]:
    """How each decode kernel's output compares with a causal forward's last row over the same
    keys (no padding, as the log-prob gap's forward runs): the share of output elements equal to
    the bit and the mean |difference|, against each SDPA backend's forward. The forward's default
    kernel is named by which forced backend it equals."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(1)
    heads = KV_HEADS * GROUPS
    q = torch.randn(rows, heads, length, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(rows, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(rows, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    k_rep, v_rep = (t.repeat_interleave(GROUPS, 1) for t in (k, v))  # transformers' repeat_kv
    scale = HEAD_DIM ** -0.5

    def forward(backend: SDPBackend | None) -> torch.Tensor:
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=scale)[:, :, -1]

    refs: dict[str, torch.Tensor] = {"default": forward(None)}
    if cuda:
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                refs[name] = forward(backend)
            except Exception as err:  # noqa: BLE001 - a backend this build lacks
                print(json.dumps({"forward": name, "error": str(err)[:200]}), flush=True)
    default_is = [n for n, r in refs.items() if n != "default" and torch.equal(r, refs["default"])]
    q_last = q[:, :, -1:]  # [rows, heads, 1, d]
    bias = torch.zeros(rows, 1, 1, length, device=device, dtype=dtype)
    decoders: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa_no_mask": lambda: F.scaled_dot_product_attention(q_last, k_rep, v_rep, scale=scale)[:, :, 0],
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q_last, k_rep, v_rep, attn_mask=bias, scale=scale)[:, :, 0]}
    if cuda:
        def forced(backend: SDPBackend, masked: bool) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q_last, k_rep, v_rep, attn_mask=bias if masked else None,
                                                          scale=scale)[:, :, 0]
            return run
        decoders.update(cudnn_mask=forced(SDPBackend.CUDNN_ATTENTION, True),
                        flash_no_mask=forced(SDPBackend.FLASH_ATTENTION, False),
                        efficient_mask=forced(SDPBackend.EFFICIENT_ATTENTION, True))
    if triton_configs:
        kernel = triton_kernel()
        for c in triton_configs:
            call = triton_call(kernel, triton_options(c))
            decoders[f"triton_{c.replace(':', '_')}"] = (
                lambda call=call: call(q_last.reshape(rows, KV_HEADS, GROUPS, HEAD_DIM), k, v, bias, None, scale)
                .reshape(rows, heads, HEAD_DIM))
    results = []
    for name, fn in decoders.items():
        row: dict[str, Any] = {"rows": rows, "columns": length, "decode": name, "forward_default_is": default_is}
        try:
            out = fn()
            for ref_name, ref in refs.items():
                row[f"equal_{ref_name}"] = round((out == ref).float().mean().item(), 5)
                row[f"mean_diff_{ref_name}"] = (out.float() - ref.float()).abs().mean().item()
        except Exception as err:  # noqa: BLE001 - one decoder that cannot run must not lose the others
            row.update(status="error", error=f"{type(err).__name__}: {str(err)[:300]}")
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x768,16x512", help="rows x columns, comma-separated")
    ap.add_argument("--splits", default="2,4,8", help="split-K over SDPA's kernel ('' for none)")
    ap.add_argument("--triton", default="", help="the Triton kernel's configurations, e.g. autox64,2x64,"
                    "autox64:r,autox64:w8:st3 (r: masked keys read; '' for none)")
    ap.add_argument("--numerics", action="store_true", help="compare each decode kernel's output with causal "
                    "forwards' last rows (bitwise share, mean difference) instead of timing")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    splits = [int(s) for s in args.splits.split(",") if s]
    triton_configs = [c for c in args.triton.split(",") if c]
    for c in triton_configs:
        triton_options(c)  # a bad configuration fails before anything runs
    t0 = time.perf_counter()
    rows = []
    for shape in args.shapes.split(","):
        r, c = (int(x) for x in shape.split("x"))
        if args.numerics:
            rows += numerics(r, c, device, triton_configs)
        else:
            rows += probe(r, c, args.layers, splits, device, args.replays, triton_configs)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
