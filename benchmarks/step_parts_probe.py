"""The decode step's parts other than attention, alone, at the 1.1B Llama's shapes (issue 20: the
step at 128 x 768 is 2.09x its memory floor, NOTES 25-26): each GEMM of a layer (q|k|v, o,
gate|up, down) under cuBLAS, cuBLASLt and inductor's autotuned Triton templates; with
``--pointwise`` SiLU-and-multiply and the residual add with the RMSNorm as inductor compiles the
engine's functions, beside hand-written Triton kernels at a few settings. Each part runs once per
layer on its own weights or inputs (22 of them: the L2 cache does not hold them between calls)
inside one CUDA graph; the time is a replay's over 22.

    python benchmarks/step_parts_probe.py --rows 16,128 --out parts.json
    python benchmarks/step_parts_probe.py --pointwise --rows 16,128 --out pointwise.json
"""

# ruff: noqa: B023 - each closure runs within its loop iteration (captured into one graph there)
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_attention_probe import graph_us  # noqa: E402 - after the path

LAYERS, HIDDEN, INTER, QKV = 22, 2048, 5632, 2048 + 2 * 256
GEMMS = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def pointwise(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> None:
    """SiLU-and-multiply and the residual add with the RMSNorm: ``triton_pointwise.py``'s kernels
    at a few settings, against inductor's (``torch.compile`` of the same eager functions), inputs
    cold. (Run4's figures came from copies of the kernels in this file, before they moved there.)"""
    from posttrain.rollout.decoder import rms_norm
    from posttrain.rollout.kernels import pointwise as tp

    def residual_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + r
        return x, rms_norm(x, w, 1e-5)

    def silu_mul_eager(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    def settings(**values: int) -> None:
        for name, value in values.items():
            setattr(tp, name, value)

    defaults = dict(SILU_BLOCK=tp.SILU_BLOCK, SILU_WARPS=tp.SILU_WARPS, NORM_ROWS=tp.NORM_ROWS,
                    NORM_WARPS=tp.NORM_WARPS)
    dev, dt = torch.device("cuda"), torch.bfloat16
    for rows in (int(r) for r in args.rows.split(",")):
        gus = [torch.randn(rows, 2 * INTER, device=dev, dtype=dt) for _ in range(LAYERS)]
        compiled = torch.compile(silu_mul_eager, dynamic=True, fullgraph=True)
        want = silu_mul_eager(gus[0])
        emit({"part": "silu_mul", "rows": rows, "kernel": "inductor",
              "us": round(graph_us([lambda g=g: compiled(g) for g in gus]), 2),
              "equal": (compiled(gus[0]) == want).float().mean().item()})
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                settings(SILU_BLOCK=block, SILU_WARPS=warps)
                emit({"part": "silu_mul", "rows": rows, "kernel": f"triton b{block} w{warps}",
                      "us": round(graph_us([lambda g=g: tp.silu_mul(g) for g in gus]), 2),
                      "equal": (tp.silu_mul(gus[0]) == want).float().mean().item()})
        xs = [torch.randn(rows, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
        rs = [torch.randn(rows, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
        w = torch.randn(HIDDEN, device=dev, dtype=dt)
        compiled_norm = torch.compile(residual_norm, dynamic=True, fullgraph=True)
        want_x, want_h = residual_norm(xs[0], rs[0], w)
        emit({"part": "residual_norm", "rows": rows, "kernel": "inductor",
              "us": round(graph_us([lambda x=x, r=r: compiled_norm(x, r, w) for x, r in zip(xs, rs)]), 2),
              "equal": (compiled_norm(xs[0], rs[0], w)[1] == want_h).float().mean().item()})
        for per in (1, 2, 4):
            for warps in (4, 8, 16):
                settings(NORM_ROWS=per, NORM_WARPS=warps)
                got_x, got_h = tp.add_rms_norm(xs[0], rs[0], w, 1e-5)
                emit({"part": "residual_norm", "rows": rows, "kernel": f"triton rows{per} w{warps}",
                      "us": round(graph_us([lambda x=x, r=r: tp.add_rms_norm(x, r, w, 1e-5) for x, r in zip(xs, rs)]),
                                  2),
                      "equal": (got_h == want_h).float().mean().item(), "x_equal": bool(torch.equal(got_x, want_x))})
        settings(**defaults)


def parts(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    dev, dt = torch.device("cuda"), torch.bfloat16

    def emit(row: dict[str, Any]) -> None:
        out.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))

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

    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--pointwise", action="store_true", help="the pointwise parts, not the GEMMs")
    ap.add_argument("--out", default="step_parts.json")
    parts(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
