"""The ``lora`` case of ``rollout_bench.py`` (issue 21; see its docstring): decode time per token of
a policy with peft LoRA adapters in the engine's modes, side by side with the same model merged
into a plain one. ``rollout_bench.py`` passes its helpers (model building, timing, the log-prob
gap, the engine summary).

    python benchmarks/rollout/rollout_bench.py --shapes 1b --cases lora --budget-s 420 --out lora_1b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from typing import Any

import torch


def bench_lora(shape: str, args: argparse.Namespace, device: torch.device, out: list[dict[str, Any]],
               write: Any, t_start: float, *, build: Any, profiled_rollouts: Any, forward_gap: Any,
               engine_summary: Any, sync: Any, chunk: int) -> None:
    """The ``lora`` case (see the module docstring): one row per variant appended to ``out``."""
    from peft import LoraConfig, get_peft_model

    from posttrain.rollout import Rollout, SamplingParams
    from posttrain.rollout.engine import Clock

    p, n = args.prompt_len, args.new_tokens
    policy = build(shape, device, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, policy.config.vocab_size, (chunk, p), generator=g).to(device)
    mask = torch.ones_like(ids)
    sampling = SamplingParams(max_new_tokens=n, pad_token_id=0, temperature=1.0, min_new_tokens=n)

    def adapted(dtype: torch.dtype) -> Any:
        cfg = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05, target_modules="all-linear")
        model = get_peft_model(policy, cfg, autocast_adapter_dtype=dtype == torch.float32)
        with torch.no_grad():
            for name, q in model.named_parameters():
                if "lora_" in name:
                    q.data = q.data.to(dtype)
                    if "lora_B" in name:
                        q.normal_(0.0, 0.01, generator=torch.Generator(device=q.device).manual_seed(2))
        return model.eval()

    def measure(variant: str, model: Any, gap_model: Any, **options: Any) -> None:
        row: dict[str, Any] = {"shape": shape, "case": "lora", "variant": variant, "rows": chunk, "prompt_len": p,
                               "new_tokens": n, "lora_r": args.lora_r}
        if time.perf_counter() - t_start > args.budget_s:
            row["error"] = "skipped: --budget-s spent"
            out.append(row)
            write()
            return
        try:
            r = Rollout(None, "policy", sampling, max_batch=chunk, max_prompt_len=p, model=model,
                        engine_options=options or None)
            first, s, times, o, prof = profiled_rollouts(r, ids, mask, args.repeats)
            e = r.engine
            length = e.length_bucket_for(p + n)
            e.run(chunk, length, 4)  # the bucket captured, outside the timing
            clock = Clock(device)
            e.run(chunk, length, 64)
            step_ms = clock.lap() / 64
            refresh = []
            for _ in range(3):
                clock.lap()
                e.adapters.refresh()
                refresh.append(clock.lap())
            decode = statistics.median(t["decode_ms"] / max(1, t["decode_steps"]) for t in prof)
            row.update(step_ms=step_ms, rollout_s=s, rollout_all_s=times, first_s=first, decode_ms_per_step=decode,
                       prefill_ms=statistics.median(t["prefill_ms"] for t in prof),
                       refresh_ms=statistics.median(refresh), lora_mode=r.stats.get("lora_mode"),
                       lora_merged_bytes=r.stats.get("lora_merged_bytes", 0), **engine_summary(r))
            row["logprob_gap"] = forward_gap(gap_model, o if o.sequences.shape[0] <= 8 else type(o)(
                sequences=o.sequences[:8], completion_ids=o.completion_ids[:8], completion_mask=o.completion_mask[:8],
                logprobs=o.logprobs[:8]))
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            r = e = None  # free the engine (its cache and buffers) before the next variant
        except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
        sync()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        out.append(row)
        write()
        print(f"[{shape}] lora {variant}: {json.dumps({k: row.get(k) for k in ('step_ms', 'rollout_s', 'status', 'error')})}",
              flush=True)

    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = adapted(dtype)
        if dtype == torch.float32:
            measure("merged", model, model, lora_mode="merged")
        measure(f"live_{tag}_adapters", model, model, lora_mode="live")
        measure(f"grouped_{tag}_adapters", model, model, lora_mode="grouped")
        policy = model.unload()  # the base again, without adapters, for the next variant
    model = adapted(torch.bfloat16)
    plain = model.merge_and_unload()
    measure("merged_plain_model", plain, plain)
    rows = {r["variant"]: r for r in out if r.get("shape") == shape and "step_ms" in r}
    ref = rows.get("merged_plain_model")
    if ref:
        for r in rows.values():
            r["step_over_merged_plain"] = r["step_ms"] / ref["step_ms"]
            r["rollout_over_merged_plain"] = r["rollout_s"] / ref["rollout_s"]
        write()
