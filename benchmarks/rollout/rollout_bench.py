"""Rollout engine benchmark on ONE GPU (issues 13, 20): posttrain.rollout against the static engine
it replaced (``--baseline``: the old ``posttrain/rollout.py`` loaded from a file) and transformers'
``generate``, side by side in one process.

Random weights from the harness's shape presets (posttrain/memory.py SHAPES), bf16, no DeepSpeed,
random prompts (all real tokens), sampling at temperature 1, top-k off. Cases (``--cases``):

- ``varlen``: ``--prompts`` prompts x ``--generations`` generations (GRPO's layout: a group's rows
  side by side), prompt ``--prompt-len``, up to ``--new-tokens`` new, rows ending on a stop set of
  ``--stop-fraction`` of the vocabulary (random weights' near-flat distributions: about that
  chance per token, so lengths are geometric with a long tail). The baseline decodes chunks of
  ``--chunk`` rows (its max_batch) to each chunk's longest row; the engine streams every sequence
  through ``--kv-slots`` slots (each value a variant). ``generate`` eager decodes one chunk once
  (``--hf``; it costs ~35 s at 1.1B). Figure: useful (kept) tokens per second.
- ``full``: ``--chunk`` rows x (prompt + new), every row to the end (no stop tokens).
- ``step``: the decode step of the bucket (chunk rows, prompt + new columns) alone: ms per step
  against its memory floor (weight bytes + the bucket's KV bytes, at 4.8 TB/s).
- ``prefix``: prefilling prompts x generations sequences (rows of a group share their prompt)
  against prefilling the unique prompts alone.
- ``logprobs``: mean and max |returned log-prob - a forward pass's| over sampled tokens, for the
  engine, the baseline and ``generate`` (our keyed sampler on transformers' generate), 32 rows.
- ``prepared``: the model prepared as GRPO prepares its policy (gradient checkpointing, TRL's fused
  LM head, train mode): does the engine keep its compiled step (and the baseline?).

- ``deepspeed`` (issue 39; ``deepspeed_rollout.py``): DeepSpeed's own rollout engine
  (``deepspeed.runtime.rollout.HybridEngineRollout`` on a ``deepspeed.initialize`` engine) beside
  posttrain's engine on one greedy workload: ``--chunk`` rows of unique random prompts x (prompt +
  new), every row to the end (the ``full`` case's shape, greedy on both sides). Rows: posttrain's
  engine (``do_sample=False``), then per ``--ds-paths`` DeepSpeed's ``generate`` path, its CUDA-graph
  path, continuous batching (all rows' slots), continuous batching with its CUDA graph, and
  generate under DeepSpeedHybridEngine's injected kernels: seconds (one untimed call, then
  ``--repeats``), tokens per second, and the share of rows whose token ids equal posttrain's. A
  path that cannot run records its error.

- ``lora`` (issue 21; run alone, it builds its own models): decode time per token of a policy
  with peft LoRA adapters (r ``--lora-r``, alpha 2r, every linear layer but the LM head, random
  non-zero B) in the engine's two modes, side by side with the same model merged into a plain one
  (``merge_and_unload``: the target is at most 1.15x its time): ``merged`` (persistent W + sBA
  buffers, refreshed per rollout; its refresh is timed too), ``live`` and ``grouped`` (q|k|v and
  gate|up share one low-rank product) each with float32 adapters (peft's default beside a bf16
  base) and with bf16 adapters (as DeepSpeed's bf16 engine casts them). Per variant: ms per token of the decode step alone (64 replays of the bucket
  ``--chunk`` rows x prompt + new columns, CUDA events), the whole rollout (every row to the end)
  and its decode ms per step, compile/capture status, extra bytes, and the log-prob gap against
  a forward of the adapted peft model (8 rows). Rows are written to ``--out`` as each finishes.

A row whose engine compile or capture fell back is marked ``degraded``, not ``ok``. JSON is written
after every stage; stages stop being started after ``--budget-s`` seconds.

    git show 2c7536f:posttrain/rollout.py > /tmp/rollout_2c7536f.py
    python benchmarks/rollout/rollout_bench.py --shapes 1b --baseline /tmp/rollout_2c7536f.py --hf --out r.json

DeepSpeed's rollout engine beside posttrain's on one H200 (1.1B, greedy, 128 rows x (256 + 512);
the eager paths decode with transformers' eager forward, as ``--hf`` does; rows are saved to
``--out``.partial as each finishes):

    python benchmarks/rollout/rollout_bench.py --shapes 1b --cases deepspeed --repeats 2 --budget-s 420 --out ds_rollout_1b.json

LoRA decode on one H200 (bf16; six variants per shape side by side, one invocation per shape,
each a few minutes; no variant is started after --budget-s):

    python benchmarks/rollout/rollout_bench.py --shapes 1b --cases lora --budget-s 420 --out lora_1b.json
    python benchmarks/rollout/rollout_bench.py --shapes 8b --cases lora --budget-s 420 --out lora_8b.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BANDWIDTH = 4.8e12  # H200 HBM3e bytes/s
CHUNK = {"tiny": 8, "125m": 64, "1b": 128, "3b": 128, "8b": 64}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, repeats: int) -> tuple[float, list[float], Any]:
    """Median seconds of ``repeats`` calls (each synchronised), all times, the last result."""
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(round(time.perf_counter() - t0, 4))
    return statistics.median(times), times, out


def profiled_rollouts(r: Any, x: torch.Tensor, m: torch.Tensor, repeats: int
                      ) -> tuple[float, float, list[float], Any, list[dict[str, float]]]:
    """A Rollout's first rollout (compiles, captures), one more (buckets the first did not reach),
    then ``repeats`` timed ones with their prefill/decode timings: (first s, median s, every s, the
    last output, each timed rollout's timings)."""
    torch.manual_seed(0)
    first, _, _ = timed(lambda: r.generate(x, m), 1)
    timed(lambda: r.generate(x, m), 1)
    r.profile = True
    prof: list[dict[str, float]] = []

    def one() -> Any:
        out = r.generate(x, m)
        prof.append(dict(r.timings))
        return out

    s, times, out = timed(one, repeats)
    return first, s, times, out, prof


def load_baseline(path: str) -> Any:
    """The old single-file engine as module ``posttrain._rollout_baseline`` (its relative imports
    resolve inside the package)."""
    spec = importlib.util.spec_from_file_location("posttrain._rollout_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from posttrain.planner.memory import model_config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape), dtype=dtype)
    return model.eval()


@torch.no_grad()
def forward_gap(model: Any, out: Any, rows: int = 8) -> dict[str, float]:
    """Mean and max |returned log-prob - log-prob of a forward over the produced sequences| over
    the kept completion tokens, and the share of tokens equal to the forward's argmax."""
    n = out.completion_ids.shape[1]
    gaps, agree = [], []
    for i in range(0, out.sequences.shape[0], rows):
        seq = out.sequences[i : i + rows]
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), logits_to_keep=n + 1).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1)
        comp, keep = out.completion_ids[i : i + rows], out.completion_mask[i : i + rows].bool()
        lp = logp.gather(-1, comp.unsqueeze(-1))[..., 0]
        gaps.append((lp - out.logprobs[i : i + rows]).abs()[keep])
        agree.append((logp.argmax(-1) == comp)[keep])
    g = torch.cat(gaps)
    return {"mean": g.mean().item(), "max": g.max().item(), "argmax_agreement": torch.cat(agree).float().mean().item()}


def engine_summary(r: Any) -> dict[str, Any]:
    """A Rollout's engine stats for a row, and its status: "degraded" where the engine lost speed
    to a fallback (``Rollout.degraded``), else "ok"."""
    stats = r.stats
    keys = ("compiled", "captures", "recaptures", "capture_s", "compile_fallbacks", "capture_fallbacks",
            "kv_cache_bytes", "prefill_rows", "prefill_sequences", "admissions", "compactions",
            "decode_steps", "row_steps", "cache_cells_read", "graphs", "fallback_reasons", "shared_prompt_kv",
            "prompt_kv_bytes", "prompt_joins", "prompt_compactions", "triton_decode", "triton_fallbacks",
            "fused_projections")
    out = {k: stats[k] for k in keys if k in stats}
    out["status"] = "degraded" if r.degraded else "ok"
    return out


def bench_shape(shape: str, args: argparse.Namespace, device: torch.device, baseline: Any, t_start: float
                ) -> dict[str, Any]:
    from posttrain.rollout import Rollout, SamplingParams
    from posttrain.rollout.engine import Clock

    chunk = args.chunk or CHUNK.get(shape, 64)
    p, n = args.prompt_len, args.new_tokens
    res: dict[str, Any] = {"shape": shape, "chunk": chunk, "prompt_len": p, "new_tokens": n, "errors": {}}
    t0 = time.perf_counter()
    model = build(shape, device, torch.bfloat16)
    sync()
    res["init_s"] = round(time.perf_counter() - t0, 1)
    vocab = model.config.vocab_size
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    res["param_bytes"] = param_bytes
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = torch.randint(3, vocab, (args.prompts, p), generator=g)
    ids = prompts.repeat_interleave(args.generations, 0).to(device)
    mask = torch.ones_like(ids)
    stops = torch.randperm(vocab - 3, generator=g)[: max(1, int(vocab * args.stop_fraction))] + 3
    stop_ids = stops.tolist()
    free = SamplingParams(max_new_tokens=n, pad_token_id=0, temperature=1.0, min_new_tokens=n)
    stopping = SamplingParams(max_new_tokens=n, pad_token_id=0, temperature=1.0, stop_token_ids=stop_ids)
    repeats = args.repeats
    holder: dict[str, Any] = {}
    # ``--shared-prompt``: the engine as it is by default ("off"), with shared prompt slots (groups
    # of ``--generations`` rows hold their prompt once: "on"); "triton" and "shared-triton": the
    # first two asking for posttrain's Triton kernels (the default on CUDA); "sdpa": the default
    # with SDPA's kernel instead (the kernels' fallback); side by side.
    shared_modes = [m for m in args.shared_prompt.split(",") if m]
    suffix = {"off": "", "on": "-shared", "triton": "-triton", "shared-triton": "-shared-triton", "sdpa": "-sdpa"}
    if set(shared_modes) - set(suffix):
        raise SystemExit(f"--shared-prompt {args.shared_prompt!r}: use some of {', '.join(suffix)}")

    def shared_options(mode: str) -> dict[str, Any]:
        shared = dict(shared_prompt_kv=True, group_size=args.generations) if is_shared(mode) else {}
        kernel = {"triton": {"triton_decode": True}, "shared-triton": {"triton_decode": True},
                  "sdpa": {"triton_decode": False}}.get(mode, {})
        return {**shared, **kernel, **({"fused": True} if args.fused else {})}

    def is_shared(mode: str) -> bool:
        return mode in ("on", "shared-triton")

    def kv_bytes(e: Any, rows: int, columns: int) -> int:
        return 2 * len(e.slots.keys) * rows * columns * e.spec.kv_heads * e.spec.head_dim * 2
    baseline_all = baseline

    def base_for(case: str) -> Any:
        return baseline_all if case in args.baseline_cases.split(",") else None

    def stage(name: str, fn: Any) -> None:
        if time.perf_counter() - t_start > args.budget_s:
            res["errors"][name] = "skipped: --budget-s spent"
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            res["errors"][name] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
        holder.clear()
        sync()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{shape}] {name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        Path(args.out + ".partial").write_text(json.dumps(res, indent=1, default=str))

    def chunked(r: Any, x: torch.Tensor, m: torch.Tensor) -> list[Any]:
        return [r.generate(x[i : i + chunk], m[i : i + chunk]) for i in range(0, x.shape[0], chunk)]

    def useful(outs: list[Any]) -> int:
        return int(sum(o.completion_mask.sum().item() for o in outs))

    def run_baseline(key: str, x: torch.Tensor, m: torch.Tensor, sampling: Any) -> None:
        r = holder["base"] = baseline.Rollout(None, "policy", sampling, max_batch=chunk, max_prompt_len=p, model=model)
        torch.manual_seed(0)
        first, _, _ = timed(lambda: chunked(r, x, m), 1)
        s, times, outs = timed(lambda: chunked(r, x, m), repeats)
        tok = useful(outs)
        res[key]["baseline"] = {"s": s, "all_s": times, "first_s": first, "useful_tokens": tok,
                                "useful_tokens_per_s": tok / s, "compile": r.stats.get("compile"),
                                "captures": r.stats["captures"]}
        holder.pop("base")

    def run_engine(key: str, name: str, x: torch.Tensor, m: torch.Tensor, sampling: Any, slots: int,
                   **options: Any) -> Any:
        r = holder["engine"] = Rollout(None, "policy", sampling, max_batch=slots, max_prompt_len=p, model=model,
                                       kv_slots=slots, engine_options=options or None)
        first, s, times, out, prof = profiled_rollouts(r, x, m, repeats)
        tok = int(out.completion_mask.sum().item())
        v = {"s": s, "all_s": times, "first_s": first, "useful_tokens": tok, "useful_tokens_per_s": tok / s,
             "prefill_ms": statistics.median(t["prefill_ms"] for t in prof),
             "decode_ms": statistics.median(t["decode_ms"] for t in prof),
             "decode_steps": prof[-1]["decode_steps"], "row_steps": prof[-1]["row_steps"],
             **engine_summary(r)}
        res[key][name] = v
        return r

    def varlen() -> None:
        res["varlen"] = {"sequences": ids.shape[0], "prompts": args.prompts, "generations": args.generations,
                         "stop_tokens": len(stop_ids)}
        if base_for("varlen") is not None:
            run_baseline("varlen", ids, mask, stopping)
        for slots in [int(s) for s in args.kv_slots.split(",") if s]:
            for mode in shared_modes:
                run_engine("varlen", f"slots{slots}{suffix[mode]}", ids, mask, stopping, min(slots, ids.shape[0]),
                           **shared_options(mode))
                holder.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if args.hf:  # transformers' own sampling, no logits kept (they would be 34 GB at 1.1B x 128 x 512)
            from posttrain.rollout import finish

            def hf() -> Any:
                out = model.generate(input_ids=ids[:chunk], attention_mask=mask[:chunk], do_sample=True, top_k=0,
                                     top_p=1.0, temperature=1.0, max_new_tokens=n, eos_token_id=stop_ids,
                                     pad_token_id=0)
                return out[:, p:]

            torch.manual_seed(0)
            s, _, comp = timed(hf, 1)
            comp = torch.nn.functional.pad(comp, (0, n - comp.shape[1]), value=0)
            tok = int(finish(comp, torch.zeros(comp.shape, device=comp.device), stopping)[1].sum().item())
            res["varlen"]["generate_one_chunk"] = {"s": s, "rows": chunk, "useful_tokens": tok,
                                                   "useful_tokens_per_s": tok / s}

    def full() -> None:
        x, m = ids[:chunk], mask[:chunk]
        res["full"] = {"rows": chunk}
        if base_for("full") is not None:
            run_baseline("full", x, m, free)
        groups = [i // args.generations for i in range(chunk)]
        for mode in shared_modes:
            shared = is_shared(mode)
            r = run_engine("full", f"engine{suffix[mode]}", x, m, free, chunk, **shared_options(mode))
            e = r.engine
            # The step alone, at the bucket (chunk rows, whole cache; the chunk's prompt slots):
            # CUDA events around 64 replays, the chunk admitted (its prompts in their slots).
            e.begin(1, n, p)
            e.admit(list(range(chunk)), list(range(chunk)), x, m, groups)
            length = e.length_bucket_for(e.columns(n))
            steps = 64
            clock = Clock(device)
            e.run(chunk, length, steps)
            ms = clock.lap() / steps
            kv = kv_bytes(e, chunk, length) + (kv_bytes(e, e.prompt_rows, e.prompt_width) if shared else 0)
            floor = (param_bytes + kv) / BANDWIDTH * 1e3
            # The same work's floor with every row holding its prompt (the default engine's bytes).
            unshared = (param_bytes + kv_bytes(e, chunk, p + n)) / BANDWIDTH * 1e3
            row = {"rows": chunk, "columns": length, "ms": ms, "floor_ms": floor, "ratio_to_floor": ms / floor,
                   "weight_bytes": param_bytes, "kv_bytes": kv, "ratio_to_unshared_floor": ms / unshared}
            if shared:
                row.update(prompt_rows=e.prompt_rows, prompt_columns=e.prompt_width)
            res[f"step{suffix[mode]}"] = row
            holder.clear()

    def prefix() -> None:
        from posttrain.rollout import DecodeEngine

        total = ids.shape[0]
        e = holder["prefix"] = DecodeEngine(model, stopping, total, p)
        res["prefix"] = {"sequences": total, "unique": args.prompts}

        def admit(x: torch.Tensor) -> None:
            e.begin(1, n, p)
            e.admit(list(range(x.shape[0])), list(range(x.shape[0])), x, torch.ones_like(x))

        for name, x in (("unique", prompts.to(device)), ("shared", ids)):
            admit(x)  # warm-up
            s, times, _ = timed(lambda x=x: admit(x), repeats)
            res["prefix"][f"{name}_s"], res["prefix"][f"{name}_all_s"] = s, times
        res["prefix"]["shared_over_unique"] = res["prefix"]["shared_s"] / res["prefix"]["unique_s"]
        res["prefix"]["prompt_kv_bytes_per_sequence"] = e.cache_nbytes // total * p // e.length
        if set(shared_modes) - {"off"}:  # prompt slots: each prompt prefilled and held once
            holder.clear()
            e = holder["prefix"] = DecodeEngine(model, stopping, total, p, shared_prompt_kv=True,
                                                group_size=args.generations)
            groups = [i // args.generations for i in range(total)]

            def slots() -> None:
                e.begin(1, n, p)
                e.admit(list(range(total)), list(range(total)), ids, torch.ones_like(ids), groups)

            slots()
            s, times, _ = timed(slots, repeats)
            every_row = total * p * e.prompts.nbytes // (e.prompts.capacity * p)
            res["prefix"].update(slots_s=s, slots_all_s=times, slots_over_unique=s / res["prefix"]["unique_s"],
                                 prompt_slots=e.prompts.capacity, prompt_kv_bytes=e.prompts.nbytes,
                                 prompt_kv_bytes_every_row=every_row,
                                 prompt_kv_ratio=every_row / e.prompts.nbytes)

    def logprobs() -> None:
        rows, new = 32, 128
        x, m = ids[:rows], mask[:rows]
        sampling = SamplingParams(max_new_tokens=new, pad_token_id=0, temperature=1.0, min_new_tokens=new)
        out: dict[str, Any] = {}
        r = Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=model,
                    engine_options=shared_options("off"))
        torch.manual_seed(3)
        out["engine"] = forward_gap(model, r.generate(x, m))
        out["engine"]["status"] = engine_summary(r)["status"]
        del r
        for mode in set(shared_modes) - {"off"}:  # shared prompt slots' two-part attention
            r = Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=model,
                        engine_options=shared_options(mode))
            torch.manual_seed(3)
            key = f"engine{suffix[mode]}".replace("-", "_")
            out[key] = forward_gap(model, r.generate(x, m))
            out[key]["status"] = engine_summary(r)["status"]
            del r
        if base_for("logprobs") is not None:
            b = baseline.Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=model)
            torch.manual_seed(3)
            out["baseline"] = forward_gap(model, b.generate(x, m))
            del b
        hf = Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=model, backend="hf")
        torch.manual_seed(3)
        out["generate"] = forward_gap(model, hf.generate(x, m))
        for key in [k for k in out if k.startswith("engine") and not k.endswith("_mean")]:
            out[f"{key}_over_generate_mean"] = out[key]["mean"] / out["generate"]["mean"]
        res["logprobs"] = {"rows": rows, "new_tokens": new, **out}

    def prepared() -> None:
        from trl.trainer.utils import add_fused_lm_head

        from posttrain.models.setup import enable_gradient_checkpointing

        policy = holder["policy"] = build(shape, device, torch.bfloat16)  # its own copy: the others stay plain
        enable_gradient_checkpointing(policy)
        add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))
        policy.train()
        rows, new = 32, 128
        sampling = SamplingParams(max_new_tokens=new, pad_token_id=0, temperature=1.0, min_new_tokens=new)
        out: dict[str, Any] = {"hooks_on_embeddings": len(policy.get_input_embeddings()._forward_hooks)}
        r = Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=policy)
        r.generate(ids[:rows], mask[:rows])
        s, _, _ = timed(lambda: r.generate(ids[:rows], mask[:rows]), repeats)
        out["engine"] = {"s": s, **engine_summary(r)}
        if base_for("prepared") is not None:
            b = baseline.Rollout(None, "policy", sampling, max_batch=rows, max_prompt_len=p, model=policy)
            b.generate(ids[:rows], mask[:rows])
            s, _, _ = timed(lambda: b.generate(ids[:rows], mask[:rows]), repeats)
            out["baseline"] = {"s": s, "compile": b.stats.get("compile")}
        res["prepared"] = out

    def deepspeed_case() -> None:
        import deepspeed_rollout

        # The full case's rows and lengths, greedy; unique prompts (a group's copies decode alike).
        x = torch.randint(3, vocab, (chunk, p), generator=torch.Generator(device="cpu").manual_seed(2)).to(device)
        deepspeed_rollout.bench_deepspeed(
            res.setdefault("deepspeed", {}), model, x, torch.ones_like(x), n,
            paths=[q for q in args.ds_paths.split(",") if q], repeats=repeats,
            build_copy=lambda: build(shape, device, torch.bfloat16), timed=timed,
            profiled_rollouts=profiled_rollouts, engine_summary=engine_summary,
            budget_left=lambda: args.budget_s - (time.perf_counter() - t_start),
            save=lambda: Path(args.out + ".partial").write_text(json.dumps(res, indent=1, default=str)))

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for name, fn in (("prepared", prepared), ("varlen", varlen), ("full", full), ("prefix", prefix),
                     ("logprobs", logprobs), ("deepspeed", deepspeed_case)):
        if name in cases or (name == "full" and "step" in cases):
            stage(name, fn)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        lines.append(f"## {r['shape']} (chunk {r['chunk']}, prompt {r['prompt_len']}, up to {r['new_tokens']} new)")
        for case in ("varlen", "full"):
            c = r.get(case)
            if not c:
                continue
            for name, v in c.items():
                if isinstance(v, dict) and "s" in v:
                    lines.append(f"| {case} | {name} | {v['s']:.3f} s | {v.get('useful_tokens', '-')} tokens | "
                                 f"{v.get('useful_tokens_per_s', 0):.0f} tok/s | {v.get('status', v.get('compile'))} |")
        for key in ("step", "step-shared", "step-shared-flex", "step-triton", "step-shared-triton"):
            if r.get(key):
                s = r[key]
                lines.append(f"| {key} {s['rows']}x{s['columns']} | {s['ms']:.3f} ms | floor {s['floor_ms']:.3f} ms | "
                             f"{s['ratio_to_floor']:.2f}x | {s['ratio_to_unshared_floor']:.2f}x the unshared floor |")
        if r.get("prefix"):
            x = r["prefix"]
            lines.append(f"| prefill | unique {x['unique_s']:.3f} s | shared {x['shared_s']:.3f} s | "
                         f"shared/unique {x['shared_over_unique']:.2f} |")
            if "slots_s" in x:
                lines.append(f"| prefill into prompt slots | {x['slots_s']:.3f} s | "
                             f"/unique {x['slots_over_unique']:.2f} | "
                             f"prompt KV {x['prompt_kv_bytes'] / 2**20:.1f} MiB, every row "
                             f"{x['prompt_kv_bytes_every_row'] / 2**20:.1f} MiB: / {x['prompt_kv_ratio']:.2f} |")
        if r.get("logprobs"):
            x = r["logprobs"]
            lines.append("| logprob gap mean/max | " + " | ".join(
                f"{k} {x[k]['mean']:.4f}/{x[k]['max']:.3f}" for k in ("engine", "engine_shared", "engine_shared_flex", "engine_triton",
                                                          "engine_shared_triton",
                                                          "baseline", "generate") if k in x) + " |")
        if r.get("deepspeed"):
            d = r["deepspeed"]
            lines.append(f"### greedy, {d.get('rows')} rows x ({d.get('prompt_len')} + {d.get('new_tokens')}): "
                         f"DeepSpeed {d.get('deepspeed')}'s HybridEngineRollout beside posttrain's engine")
            if d.get("compat"):
                lines.append(f"| deepspeed | added {d['compat']['added']} | because {d['compat']['because'][:200]} |")
            for name, v in d.items():
                if not isinstance(v, dict) or name == "compat":
                    continue
                if "s" not in v:
                    lines.append(f"| deepspeed | {name} | {v.get('status')}: {v.get('error')} ({v.get('at', '')}) |")
                    continue
                agree = (f"{v['equal_sequences']:.0%} rows equal posttrain's, common prefix "
                         f"{v['mean_common_prefix']:.1f}" if "equal_sequences" in v else "reference")
                lines.append(f"| deepspeed | {name} | {v['s']:.3f} s | {v['tokens']} tokens | "
                             f"{v['tokens_per_s']:.0f} tok/s | {agree} | {v.get('status')} |")
        if r.get("prepared"):
            lines.append(f"| GRPO-prepared policy | {json.dumps(r['prepared'], default=str)[:300]} |")
        if r["errors"]:
            lines.append(f"errors: {r['errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1b", help="comma-separated presets of posttrain/memory.py SHAPES")
    ap.add_argument("--cases", default="varlen,full,step,prefix,logprobs,prepared")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--stop-fraction", type=float, default=0.01)
    ap.add_argument("--chunk", type=int, default=0, help="the baseline's max_batch (default per shape: 128 at 1b)")
    ap.add_argument("--kv-slots", default="128,512", help="the engine's KV budget(s), in sequences")
    ap.add_argument("--shared-prompt", default="off,on", help="the engine's shared prompt slots, side by side in "
                    "varlen, full, step, prefix and logprobs: off, on, triton and shared-triton (off and on asking for "
                    "posttrain's Triton kernels), sdpa (off with SDPA instead), comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 timed rollouts per measure (older scripts' flag)")
    ap.add_argument("--baseline", default=None, help="path of the old single-file posttrain/rollout.py")
    ap.add_argument("--baseline-cases", default="varlen,full,logprobs,prepared",
                    help="the cases that also run the baseline")
    ap.add_argument("--hf", action="store_true", help="also time generate eager on one chunk (varlen)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no stage after this many seconds")
    ap.add_argument("--compile", default="layer", help="layer (the engine's compiled step), optionally +fuse (fused "
                    "q|k|v and gate|up copies: the engine's fused option)")
    ap.add_argument("--ds-paths", default="ds-generate,ds-graph,ds-continuous,ds-continuous-graph,ds-hybrid-kernels",
                    help="the deepspeed case's DeepSpeed rollout paths (rows), comma-separated")
    ap.add_argument("--lora-r", type=int, default=16, help="the lora case's adapter rank (alpha 2r)")
    ap.add_argument("--out", default="rollout_bench.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no graphs, eager step)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("rollout_bench needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    if args.quick:
        args.repeats = 2
    first, *ignored = args.compile.split(",")  # older scripts pass a list; the variants are no longer timed
    if ignored:
        print(f"--compile: timing {first} only (ignored: {', '.join(ignored)})", file=sys.stderr)
    compile_mode, _, fuse = first.partition("+")
    if compile_mode != "layer" or fuse not in ("", "fuse"):
        ap.error(f"--compile {args.compile!r}: use layer, optionally +fuse")
    args.fused = bool(fuse)
    import transformers

    baseline = load_baseline(args.baseline) if args.baseline else None
    device = torch.device(args.device)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "none",
           "command": " ".join(["python", "benchmarks/rollout/rollout_bench.py", *(argv if argv is not None else sys.argv[1:])])}
    rows: list[dict[str, Any]] = []
    lora_rows: list[dict[str, Any]] = []

    def write() -> None:
        Path(args.out).write_text(json.dumps({"env": env, "rows": rows, "lora": lora_rows}, indent=1, default=str))

    start = time.perf_counter()
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if cases - {"lora"}:
            rows.append(bench_shape(shape, args, device, baseline, start))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write()
        if "lora" in cases:
            import rollout_lora_case

            rollout_lora_case.bench_lora(shape, args, device, lora_rows, write, start, build=build,
                                         profiled_rollouts=profiled_rollouts,
                                         forward_gap=forward_gap, engine_summary=engine_summary, sync=sync,
                                         chunk=args.chunk or CHUNK.get(shape, 64))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(table(rows))
    for r in lora_rows:
        print(f"| {r['shape']} | lora {r['variant']} | step {r.get('step_ms', float('nan')):.3f} ms | "
              f"{r.get('step_over_merged_plain', float('nan')):.3f}x merged plain | rollout "
              f"{r.get('rollout_s', float('nan')):.3f} s | {r.get('status', r.get('error'))} |")
    failed = any(r["errors"] for r in rows) or any("error" in r for r in lora_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
