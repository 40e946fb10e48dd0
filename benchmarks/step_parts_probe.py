"""The decode step's parts other than attention, alone, at the 1.1B Llama's shapes (issue 20: the
step at 128 x 768 is 2.09x its memory floor, NOTES 25): each GEMM of a layer (q|k|v, o, gate|up,
down) under cuBLAS, cuBLASLt and inductor's autotuned Triton templates; the residual add with the
RMSNorm and SiLU-and-multiply as inductor compiles them, with its persistent-reduction threshold as
it is and raised. Each part runs once per layer on its own weights or inputs (22 of them: the L2
cache does not hold them between calls) inside one CUDA graph; the time is a replay's over 22.

``step``: the variants case of ``rollout_bench.py`` under one of those settings (the arguments after
``--`` are rollout_bench's).

    python benchmarks/step_parts_probe.py parts --rows 16,128 --out parts.json
    python benchmarks/step_parts_probe.py step --blas cublaslt -- --shapes 1b --cases variants ...
"""

# ruff: noqa: B023 - each closure runs within its loop iteration (captured into one graph there)
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS, HIDDEN, INTER, QKV = 22, 2048, 5632, 2048 + 2 * 256
GEMMS = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def graph_us(calls: list[Callable[[], Any]], replays: int = 50) -> float:
    """Microseconds a call: ``calls`` captured in one CUDA graph, replayed."""
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


def persistent_choices(threshold: int) -> Any:
    """inductor's heuristics with the INNER persistent-reduction threshold at ``threshold``."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint

    class Persistent(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if features.get_reduction_hint() == ReductionHint.INNER:
                from torch._inductor.virtualized import V

                return V.graph.sizevars.statically_known_leq(features.reduction_numel, threshold)
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    return Persistent()


def set_norm_threshold(threshold: int | None) -> None:
    from torch._inductor.virtualized import V

    if threshold:
        V.set_choices_handler(persistent_choices(threshold))


def set_blas(name: str | None) -> None:
    if name:
        torch.backends.cuda.preferred_blas_library(name)


def splitk_configs(rows: int) -> list[dict[str, Any]]:
    """``triton_gemm.matmul``'s settings swept at ``rows``."""
    if rows > 64:
        grid = [dict(block_n=bn, block_k=bk, splits=s, num_stages=st, num_warps=4) for bn in (64, 128)
                for bk in (64, 128) for s in (None, 2, 4, 8) for st in (3, 4)]
        return grid + [dict(block_n=128, block_k=bk, splits=s, num_stages=3, num_warps=8) for bk in (64, 128)
                       for s in (None, 4)]
    return [dict(block_n=bn, block_k=bk, splits=s, num_stages=st, num_warps=4) for bn in (32, 64)
            for bk in (128, 256) for s in (None, 4, 8) for st in (3, 4)]


def splitk(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> None:
    """``triton_gemm.matmul`` against cuBLAS per GEMM (``down_gated``: SiLU-and-multiply in the load,
    against cuBLAS's down projection alone), every setting of :func:`splitk_configs`."""
    from posttrain.rollout import triton_gemm

    dev, dt = torch.device("cuda"), torch.bfloat16
    for rows in (int(r) for r in args.rows.split(",")):
        for gemm, (n, k) in [*GEMMS.items(), ("down_gated", GEMMS["down"])]:
            gated = gemm == "down_gated"
            ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(LAYERS)]
            xs = [torch.randn(rows, 2 * k if gated else k, device=dev, dtype=dt) for _ in range(LAYERS)]
            a0 = F.silu(xs[0][:, :k]) * xs[0][:, k:] if gated else xs[0]
            ref = F.linear(a0, ws[0])
            exact = F.linear(a0.float(), ws[0].float())
            base = graph_us([lambda x=x, w=w, k=k: F.linear(x[:, :k], w) for x, w in zip(xs, ws)])
            best = None
            for config in splitk_configs(rows):
                try:
                    y = triton_gemm.matmul(xs[0], ws[0], gated=gated, **config)
                    same = torch.equal(y, triton_gemm.matmul(xs[0], ws[0], gated=gated, **config))
                    us = graph_us([lambda x=x, w=w, c=config, g=gated: triton_gemm.matmul(x, w, gated=g, **c)
                                   for x, w in zip(xs, ws)], replays=30)
                    row = {"part": gemm, "rows": rows, "config": config, "us": round(us, 2), "cublas_us": round(base, 2),
                           "tb_s": round(n * k * 2 / us / 1e6, 2), "deterministic": same,
                           "err": round((y.float() - exact).abs().max().item(), 5),
                           "cublas_err": round((ref.float() - exact).abs().max().item(), 5)}
                    if best is None or us < best["us"]:
                        best = row
                    print(json.dumps(row), flush=True)
                except Exception as err:  # noqa: BLE001
                    print(json.dumps({"part": gemm, "rows": rows, "config": config,
                                      "error": f"{type(err).__name__}: {err}"[:300]}), flush=True)
            if best is not None:
                emit({**best, "best": True})


def pointwise(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> None:
    """SiLU-and-multiply and the residual add with the RMSNorm as hand-written Triton kernels at a
    few settings, against inductor's (``torch.compile`` of the engine's functions), inputs cold."""
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul(x_ptr, out_ptr, n, inter, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        row, col = i // inter, i % inter
        g = tl.load(x_ptr + row * 2 * inter + col, mask=ok).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + col, mask=ok)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        tl.store(out_ptr + i, (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=ok)

    @triton.jit
    def add_norm(x_ptr, r_ptr, w_ptr, x_out, h_out, eps, H: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, H)
        at = rows[:, None] * H + c[None, :]
        x = (tl.load(x_ptr + at) + tl.load(r_ptr + at))
        tl.store(x_out + at, x)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / H + eps)
        h = (xf * inv[:, None]).to(x.dtype)
        tl.store(h_out + at, tl.load(w_ptr + c)[None, :] * h)

    from posttrain.rollout.decoder import rms_norm

    def residual_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + r
        return x, rms_norm(x, w, 1e-5)

    def silu_mul_eager(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    dev, dt = torch.device("cuda"), torch.bfloat16
    for rows in (int(r) for r in args.rows.split(",")):
        gus = [torch.randn(rows, 2 * INTER, device=dev, dtype=dt) for _ in range(LAYERS)]
        outs = [torch.empty(rows, INTER, device=dev, dtype=dt) for _ in range(LAYERS)]
        compiled = torch.compile(silu_mul_eager, dynamic=True, fullgraph=True)
        want = silu_mul_eager(gus[0])
        emit({"part": "silu_mul", "rows": rows, "kernel": "inductor",
              "us": round(graph_us([lambda g=g: compiled(g) for g in gus]), 2),
              "equal": (compiled(gus[0]) == want).float().mean().item()})
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                n = rows * INTER

                def run(g: torch.Tensor, o: torch.Tensor, block: int = block, warps: int = warps) -> None:
                    silu_mul[(triton.cdiv(n, block),)](g, o, n, INTER, BLOCK=block, num_warps=warps)

                run(gus[0], outs[0])
                emit({"part": "silu_mul", "rows": rows, "kernel": f"triton b{block} w{warps}",
                      "us": round(graph_us([lambda g=g, o=o, f=run: f(g, o) for g, o in zip(gus, outs)]), 2),
                      "equal": (outs[0] == want).float().mean().item()})
        xs = [torch.randn(rows, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
        rs = [torch.randn(rows, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
        w = torch.randn(HIDDEN, device=dev, dtype=dt)
        xo = [torch.empty_like(x) for x in xs]
        ho = [torch.empty_like(x) for x in xs]
        compiled_norm = torch.compile(residual_norm, dynamic=True, fullgraph=True)
        want_x, want_h = residual_norm(xs[0], rs[0], w)
        emit({"part": "residual_norm", "rows": rows, "kernel": "inductor",
              "us": round(graph_us([lambda x=x, r=r: compiled_norm(x, r, w) for x, r in zip(xs, rs)]), 2),
              "equal": (compiled_norm(xs[0], rs[0], w)[1] == want_h).float().mean().item()})
        for per in (1, 2, 4):
            for warps in (4, 8, 16):
                def run_norm(x: torch.Tensor, r: torch.Tensor, a: torch.Tensor, b: torch.Tensor, per: int = per,
                             warps: int = warps) -> None:
                    add_norm[(triton.cdiv(rows, per),)](x, r, w, a, b, 1e-5, H=HIDDEN, ROWS=per, num_warps=warps)

                run_norm(xs[0], rs[0], xo[0], ho[0])
                emit({"part": "residual_norm", "rows": rows, "kernel": f"triton rows{per} w{warps}",
                      "us": round(graph_us([lambda x=x, r=r, a=a, b=b, f=run_norm: f(x, r, a, b)
                                            for x, r, a, b in zip(xs, rs, xo, ho)]), 2),
                      "equal": (ho[0] == want_h).float().mean().item(), "x_equal": bool(torch.equal(xo[0], want_x))})


def parts(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    dev, dt = torch.device("cuda"), torch.bfloat16

    def emit(row: dict[str, Any]) -> None:
        out.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))

    if args.splitk:
        splitk(args, emit)
        return out
    if args.pointwise:
        pointwise(args, emit)
        return out
    for rows in (int(r) for r in args.rows.split(",")):
        for gemm, (n, k) in GEMMS.items():
            ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(LAYERS)]
            xs = [torch.randn(rows, k, device=dev, dtype=dt) for _ in range(LAYERS)]
            ref = F.linear(xs[0], ws[0])
            for method in ("cublas", "cublaslt", "autotune"):
                try:
                    fn: Callable[..., torch.Tensor] = F.linear
                    if method == "autotune":
                        torch._dynamo.reset()
                        fn = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs",
                                           dynamic=False)
                    torch.backends.cuda.preferred_blas_library("cublaslt" if method == "cublaslt" else "cublas")
                    y = fn(xs[0], ws[0])
                    us = graph_us([lambda x=x, w=w, fn=fn: fn(x, w) for x, w in zip(xs, ws)])
                    emit({"part": gemm, "rows": rows, "method": method, "us": round(us, 2),
                          "tb_s": round(n * k * 2 / us / 1e6, 2),
                          "equal_to_cublas": round((y == ref).float().mean().item(), 4)})
                except Exception as err:  # noqa: BLE001 - one method failing must not lose the rest
                    emit({"part": gemm, "rows": rows, "method": method, "error": f"{type(err).__name__}: {err}"[:300]})
            torch.backends.cuda.preferred_blas_library("cublas")

        def residual_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            from posttrain.rollout.decoder import rms_norm

            x = x + r
            return x, rms_norm(x, w, 1e-5)

        def silu_mul(gu: torch.Tensor) -> torch.Tensor:
            g, u = gu.chunk(2, dim=-1)
            return F.silu(g) * u

        norm_in = [(torch.randn(rows, 1, HIDDEN, device=dev, dtype=dt), torch.randn(rows, 1, HIDDEN, device=dev,
                    dtype=dt), torch.randn(HIDDEN, device=dev, dtype=dt)) for _ in range(LAYERS)]
        gu_in = [torch.randn(rows, 1, 2 * INTER, device=dev, dtype=dt) for _ in range(LAYERS)]
        from torch._inductor.virtualized import V

        for threshold in (None, 2048, 4096, 16384):
            for part, fn, inputs, nbytes in (("residual_norm", residual_norm, norm_in, rows * HIDDEN * 2 * 4),
                                            ("silu_mul", silu_mul, [(g,) for g in gu_in], rows * INTER * 2 * 3)):
                torch._dynamo.reset()
                handler = persistent_choices(threshold) if threshold else None
                try:
                    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
                    with V.set_choices_handler(handler) if handler else contextlib.nullcontext():
                        compiled(*inputs[0])
                    us = graph_us([lambda a=a, c=compiled: c(*a) for a in inputs])
                    emit({"part": part, "rows": rows, "threshold": threshold, "us": round(us, 2),
                          "tb_s": round(nbytes / us / 1e6, 2)})
                except Exception as err:  # noqa: BLE001
                    emit({"part": part, "rows": rows, "threshold": threshold,
                          "error": f"{type(err).__name__}: {err}"[:300]})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("parts", "step"))
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--splitk", action="store_true", help="parts: triton_gemm's settings swept, against cuBLAS")
    ap.add_argument("--pointwise", action="store_true", help="parts: hand-written SiLU-mul and norm kernels")
    ap.add_argument("--blas", default=None, help="step: cublas or cublaslt, preferred for every GEMM")
    ap.add_argument("--norm-threshold", type=int, default=None, help="step: inductor's INNER persistent threshold")
    ap.add_argument("--out", default="step_parts.json")
    args = ap.parse_args(argv)
    if args.what == "parts":
        parts(args)
        return 0
    set_blas(args.blas)
    set_norm_threshold(args.norm_threshold)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollout_bench

    return rollout_bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
