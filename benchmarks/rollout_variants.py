"""The ``variants`` case of ``rollout_bench.py`` (issue 20): the decode step's switches side by side
in ONE process, at one shape (the 1.1B Llama by default), each variant a new engine:

- ``fused`` (``POSTTRAIN_ROLLOUT_FUSE``): q|k|v and gate|up as one GEMM each (a copy of those
  weights, refreshed every rollout);
- ``split`` (``POSTTRAIN_ROLLOUT_SPLIT``): the layer compiled in two halves around two eager
  ``index_copy_`` cache writes (1), or one compiled layer writing the cache in place (0);
- ``fp32`` (``POSTTRAIN_ROLLOUT_SCORES_FP32``): attention scores from a bf16 ``bmm`` with a float32
  output (1) or a bf16 ``bmm`` cast to float32 (0);
- ``sdpa`` (``POSTTRAIN_ROLLOUT_SDPA``): decode attention as one ``scaled_dot_product_attention``
  call (a group's query heads as its queries) instead of bmm, softmax, bmm; or (``flex`` in the
  name, ``POSTTRAIN_ROLLOUT_FLEX``) ``flex_attention``, inductor's flex decoding kernel; or
  (``triton``, ``POSTTRAIN_ROLLOUT_TRITON``) posttrain's Triton kernel (``rollout/triton_decode.py``).

Two workloads per variant, every row to the end (no stop tokens), on one engine of 128 slots x
(256 + 512): (a) GRPO's, 16 rows x (256 + 256); (b) 128 rows x (256 + 512). Per workload: the
rollout's decode ms per step (one warm rollout first: compiles and captures), the step alone per
length bucket it runs (32 graph replays each, CUDA events) and their mean, the kernels one step
launches (CUDA: torch.profiler over one compiled step outside the graph and over one graph
replay; CPU with ``--variants-compile``: kernels and library calls in inductor's generated code,
counted per part), the log-prob gap against a forward (8 rows of (a)). A row per variant and
workload is written to ``--out`` as each finishes; no variant is started after ``--budget-s``.

    python benchmarks/rollout_bench.py --shapes 1b --cases variants --budget-s 200 --out variants.json
    python benchmarks/rollout_bench.py --shapes tiny --cases variants --device cpu --out /tmp/v.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import traceback
from typing import Any

import torch

# fused, split, fp32 scores, attention (0 bmm, 1 SDPA, 2 flex_attention, 3 posttrain's Triton kernel): the
# engine as it was first, then by expected gain (--budget-s cuts the tail); flex (section 19), then Triton last.
VARIANTS = ((0, 1, 1, 0), (1, 1, 1, 0), (0, 0, 1, 0), (1, 0, 1, 0), (1, 0, 1, 1), (1, 0, 0, 0), (0, 1, 1, 1),
            (0, 1, 0, 0), (1, 1, 1, 1), (1, 1, 0, 0), (1, 1, 1, 2), (0, 1, 1, 2), (1, 1, 1, 3))
LAUNCH = re.compile(r"^\s*(?:\w+\.run\(|cpp_fused_\w+\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+)")


def name(variant: tuple[int, int, int, int]) -> str:
    fused, split, fp32, attention = variant
    return f"fused{fused}_split{split}_" + {1: "sdpa", 2: "flex", 3: "triton"}.get(attention, f"fp32{fp32}")


# flag: (module of posttrain.rollout, setting, value)
TRITON_FLAGS = {"s1": ("triton_decode", "SPLITS", 1), "s8": ("triton_decode", "SPLITS", 8),
                "b64": ("triton_decode", "BLOCK_N", 64), "b128": ("triton_decode", "BLOCK_N", 128),
                "st1": ("triton_decode", "NUM_STAGES", 1), "st3": ("triton_decode", "NUM_STAGES", 3),
                "norot": ("triton_decode", "ROTATE", False), "nosampler": ("triton_sample", "ENABLED", False),
                "nopointwise": ("triton_pointwise", "ENABLED", False)}


# flag: (engine option, value)
ENGINE_FLAGS = {"cublas": ("cublaslt", False)}
_TRITON_DEFAULTS: dict[Any, Any] = {}


def parse_variants(text: str) -> list[tuple[tuple[int, int, int, int], list[str]]]:
    """"all" or names like fused1_split0_fp321, comma-separated; a Triton variant may take the
    kernel's settings as flags (``fused1_split1_triton:s8:b64``, :data:`TRITON_FLAGS`); any variant
    engine options (``fused1_split1_sdpa:cublas``, :data:`ENGINE_FLAGS`)."""
    if text == "all":
        return [(v, []) for v in VARIANTS]
    by_name = {name(v): v for v in VARIANTS}
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        base, *flags = part.split(":")
        kernel_flags = set(flags) - set(ENGINE_FLAGS)
        if base not in by_name or (kernel_flags and by_name[base][3] != 3) or kernel_flags - set(TRITON_FLAGS):
            raise SystemExit(f"--variants {part!r}: use 'all' or some of {', '.join(by_name)} (any with flags among "
                             f"{', '.join(ENGINE_FLAGS)}, the Triton one also {', '.join(TRITON_FLAGS)})")
        out.append((by_name[base], flags))
    return out


def set_triton_flags(flags: list[str]) -> None:
    """The Triton kernel's module settings for one variant (its defaults where ``flags`` is empty)."""
    import importlib

    def module(name: str) -> Any:
        return importlib.import_module(f"posttrain.rollout.{name}")

    if not _TRITON_DEFAULTS:  # the modules' own settings, read once before any flag changes them
        _TRITON_DEFAULTS.update({(mod, attr): getattr(module(mod), attr) for mod, attr, _ in TRITON_FLAGS.values()})
    for (mod, attr), value in _TRITON_DEFAULTS.items():
        setattr(module(mod), attr, value)
    for flag in flags:
        if flag in TRITON_FLAGS:
            mod, attr, value = TRITON_FLAGS[flag]
            setattr(module(mod), attr, value)


def launches(code: str) -> int:
    """Kernel launches and library calls in the ``call`` function of inductor's generated module."""
    body = code[code.find("def call(self, args)"):]
    body = body[: body.find("\ndef ", 1)] if "\ndef " in body[1:] else body
    return sum(1 for line in body.splitlines() if LAUNCH.match(line))


def cpu_kernel_count(engine: Any, rows: int, length: int) -> dict[str, int]:
    """One step's launches from the generated code of each part (dynamo reset first, so every part
    compiles here), plus the eager cache writes of the split layer."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    torch._dynamo.reset()
    engine.compile_parts(engine.compile_backend)
    saved = [t.clone() for t in engine._state()]
    old = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        with torch.no_grad():
            engine._step(rows, length)
    finally:
        GraphLowering.save_output_code = old
        for t, s in zip(engine._state(), saved):
            t.copy_(s)
    counts = [launches(c) for c in codes]
    layers = len(engine.weights["layers"])
    parts = 3 if engine.split_layer else 2  # prologue, (qkv, post) or layer, then sampler and epilogue
    if len(counts) != parts + 2:
        return {"error_codes": len(counts)}
    per_layer = sum(counts[1:parts]) + (2 if engine.split_layer else 0)
    return {"per_layer": per_layer, "per_step": counts[0] + layers * per_layer + sum(counts[parts:])}


def cuda_kernel_count(engine: Any, rows: int, length: int) -> dict[str, int]:
    """Device kernels (and memcpy/memset) of one compiled step run outside the graph, and of one
    graph replay of the bucket (0 where the profiler does not see inside graphs); ``top_us``: the
    step's device microseconds and launches by kernel name, largest first (outside the graph)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def count(fn: Any) -> tuple[int, list[list[Any]]]:
        saved = [t.clone() for t in engine._state()]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
            fn()
            torch.cuda.synchronize()
        for t, s in zip(engine._state(), saved):
            t.copy_(s)
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:  # where the step's device time goes: microseconds and launches per kernel name
            entry = by_name.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.device_time
            entry[1] += 1
        top = sorted(([n, round(us, 1), c] for n, (us, c) in by_name.items()), key=lambda x: -x[1])
        return len(kernels), top[:14]

    out: dict[str, Any] = {}
    out["per_step"], out["top_us"] = count(lambda: engine._step(rows, length))
    graph = engine.graphs.get((rows, length))
    if graph is not None:
        out["per_replay"] = count(graph.replay)[0]
    out["per_layer_est"] = round(out["per_step"] / len(engine.weights["layers"]), 1)
    return out


def bench_variants(shape: str, args: argparse.Namespace, device: torch.device, out: list[dict[str, Any]],
                   write: Any, t_start: float, *, build: Any, forward_gap: Any, sync: Any) -> None:
    """One row per (variant, workload) appended to ``out`` (see the module docstring); ``build``,
    ``forward_gap`` and ``sync`` are rollout_bench's (passed in: this module is its part, not its user)."""

    from posttrain.rollout import Rollout, SamplingParams
    from posttrain.rollout.engine import Clock

    p, n_long, n_grpo = args.prompt_len, args.new_tokens, args.new_tokens // 2
    slots = args.chunk or 128
    grpo_rows = min(16, slots)
    model = build(shape, device, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (slots, p), generator=g).to(device)
    mask = torch.ones_like(ids)
    built = SamplingParams(max_new_tokens=n_long, pad_token_id=0, temperature=1.0, min_new_tokens=n_long)
    workloads = (("grpo", grpo_rows, n_grpo), ("long", slots, n_long))
    compile_mode = "layer" if device.type == "cuda" or args.variants_compile else None
    reference: dict[str, torch.Tensor] = {}
    if device.type == "cuda":  # start the profiler's CUDA tracing once before any timing: every variant alike
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            (ids[:2].float() @ ids[:2].float().T).sum().item()
    for variant, flags in parse_variants(args.variants):
        fused, split, fp32, sdpa = variant
        base = {"shape": shape, "case": "variants", "variant": ":".join([name(variant), *flags]), "fused": fused,
                "split": split, "fp32_scores": fp32, "sdpa": sdpa}
        if sdpa == 3:
            set_triton_flags(flags)
        if time.perf_counter() - t_start > args.budget_s:
            out.append({**base, "error": "skipped: --budget-s spent"})
            write()
            continue
        tick = time.perf_counter()
        r = e = None
        try:
            options = dict(fused=bool(fused), split_layer=bool(split), fp32_scores=bool(fp32), sdpa_decode=sdpa == 1,
                           flex_decode=sdpa == 2, triton_decode=sdpa == 3)
            options.update(ENGINE_FLAGS[f] for f in flags if f in ENGINE_FLAGS)
            if compile_mode:
                options["compile_mode"] = compile_mode
            r = Rollout(None, "policy", built, max_batch=slots, max_prompt_len=p, model=model, kv_slots=slots,
                        engine_options=options)
            for work, rows, new in workloads:
                row = dict(base, workload=work, rows=rows, prompt_len=p, new_tokens=new)
                knobs = SamplingParams(max_new_tokens=new, pad_token_id=0, temperature=1.0, min_new_tokens=new)
                x, m = ids[:rows], mask[:rows]
                torch.manual_seed(0)
                r.generate(x, m, knobs)  # compiles (first workload) and captures this workload's buckets
                r.profile = True
                torch.manual_seed(0)
                sync()
                t0 = time.perf_counter()
                o = r.generate(x, m, knobs)
                sync()
                r.profile = False
                e = r.engine
                t = r.timings
                row.update(rollout_s=round(time.perf_counter() - t0, 4), prefill_ms=round(t["prefill_ms"], 2),
                           decode_ms_per_step=round(t["decode_ms"] / max(1, t["decode_steps"]), 4),
                           decode_steps=t["decode_steps"])
                lengths = sorted({e.length_bucket_for(c) for c in range(p + 1, p + new + 1)})
                step_ms = {}
                for length in lengths:
                    e.run(rows, length, 2)  # captured already; one more warm replay
                    clock = Clock(device)
                    e.run(rows, length, args.variant_replays)
                    step_ms[length] = round(clock.lap() / args.variant_replays, 4)
                row["step_ms_by_length"] = step_ms
                row["step_ms_mean"] = round(statistics.mean(step_ms.values()), 4)
                if device.type == "cuda":
                    row["kernels"] = cuda_kernel_count(e, rows, lengths[-1])
                elif compile_mode:
                    row["kernels"] = cpu_kernel_count(e, rows, lengths[-1])
                if work == "grpo":
                    k = min(8, rows)
                    sub = type(o)(sequences=o.sequences[:k], completion_ids=o.completion_ids[:k],
                                  completion_mask=o.completion_mask[:k], logprobs=o.logprobs[:k])
                    row["logprob_gap"] = forward_gap(model, sub)
                    first = reference.setdefault(work, o.completion_ids[:k])
                    # Same seed: which share of tokens equals the first variant's (bf16: kernels round differently).
                    row["tokens_equal_first_variant"] = (o.completion_ids[:k] == first).float().mean().item()
                st = r.stats
                row.update(compile=st.get("compile"), split_layer_ran=st.get("split_layer"),
                           fp32_scores_ran=st.get("fp32_scores"), sdpa_ran=st.get("sdpa_decode"),
                           compile_fallbacks=st.get("compile_fallbacks"),
                           capture_fallbacks=st.get("capture_fallbacks"), split_fallbacks=st.get("split_fallbacks"),
                           sdpa_fallbacks=st.get("sdpa_fallbacks"), flex_ran=st.get("flex_decode"),
                           flex_fallbacks=st.get("flex_fallbacks"), triton_ran=st.get("triton_decode"),
                           triton_fallbacks=st.get("triton_fallbacks"), triton_sampler_ran=st.get("triton_sampler"),
                           triton_pointwise_ran=st.get("triton_pointwise"),
                           blas=st.get("blas"), captures=st.get("captures"), capture_s=st.get("capture_s"),
                           fused_weight_bytes=st.get("fused_weight_bytes"),
                           fallback_reasons=st.get("fallback_reasons"),
                           status="degraded" if r.degraded else "ok",
                           variant_s=round(time.perf_counter() - tick, 1))
                if device.type == "cuda":
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                out.append(row)
                write()
                print(f"[{shape}] {row['variant']} {work}: decode {row['decode_ms_per_step']:.3f} ms/step, step "
                      f"{row['step_ms_mean']:.3f} ms, kernels {row.get('kernels')}, {row['status']}, "
                      f"{row['variant_s']} s", flush=True)
        except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
            out.append({**base, "error": f"{type(err).__name__}: {err}"[:2000]})
            write()
            traceback.print_exc()
        r = e = None
        sync()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | workload | decode ms/step | step ms (mean of buckets) | kernels/step | status |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | - | - | - | {r['error'][:80]} |")
            continue
        k = r.get("kernels") or {}
        lines.append(f"| {r['variant']} | {r['workload']} {r['rows']}x({r['prompt_len']}+{r['new_tokens']}) | "
                     f"{r['decode_ms_per_step']:.3f} | {r['step_ms_mean']:.3f} | {k.get('per_step', '-')} | "
                     f"{r['status']} |")
    return "\n".join(lines)
