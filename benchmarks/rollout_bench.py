"""Rollout engine benchmark on ONE GPU (issue 13): transformers' generate against posttrain.rollout.

Random weights from the harness's shape presets (posttrain/memory.py SHAPES), bf16, no DeepSpeed,
left-padded random prompts of ``--prompt-len`` tokens (all real), ``--new-tokens`` new tokens,
sampling at temperature 1 with top_k 0 (PPO's), per shape (1b: batch 8, 8b: batch 11):

- ``generate`` eager (and with ``cache_implementation="static"`` under ``--hf-static``: transformers
  compiles the forward, 30-50 s on first use): seconds per rollout, median;
- the engine: first rollout (compile + capture), capture seconds, graph pool bytes
  (``torch.cuda.memory_reserved`` growth across capture), prefill ms and decode ms per token
  (CUDA events, median over rollouts after warm-up), the bandwidth floor (parameter bytes /
  4.8 TB/s per token) and the ratio to it;
- correctness: max |engine log-prob - forward log-prob| over the sampled tokens (bf16); greedy
  first-divergence position per row against ``generate`` eager (greedy shares the sampled
  rollouts' graph: no new capture); after every weight is changed in place, outputs change, the
  log-probs still match a forward of the new weights, and nothing is recaptured.

Runtime on one H200, estimated: ``--shapes 1b,8b --quick`` about 3 minutes (model init 5-20 s,
generate eager ~5-8 s per shape, engine compile of one layer + sampler ~10-20 s per shape, rollouts
and checks ~10 s); each extra ``--compile`` variant adds ~15 s (``layer+fuse``) or ~30-60 s
(``step``: the whole depth compiled) per shape; ``--hf-static`` adds ~40 s (1b) and ~60 s (8b).
Writes JSON to ``--out`` after each shape and prints a table; exit status 1 if any stage failed
(its error is in the JSON, the other stages still ran).

    python benchmarks/rollout_bench.py --shapes 1b,8b --quick --compile layer,layer+fuse,step \
        --out rollout_bench.json                                            # ~5-6 min
    python benchmarks/rollout_bench.py --shapes 1b,8b --quick --hf-static --out rollout_bench_static.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BATCH = {"125m": 8, "1b": 8, "3b": 8, "8b": 11}
BANDWIDTH = 4.8e12  # H200 HBM3e bytes/s


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
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def build(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from posttrain.memory import model_config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape), dtype=dtype)
    return model.eval()


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per row, the first position where the token rows differ (the length if none)."""
    diff = a != b
    n = a.shape[1]
    return [int(row.nonzero()[0]) if row.any() else n for row in diff]


@torch.no_grad()
def forward_check(model: Any, out: Any) -> tuple[float, float]:
    """Over the kept completion tokens: max |returned log-prob - log-prob of a forward over the
    produced sequences|, and the fraction of tokens equal to the forward's argmax (for greedy
    output: agreement given the same prefix, which random weights' near-ties do not cascade)."""
    n = out.completion_ids.shape[1]
    seq = out.sequences
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), logits_to_keep=n + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp.gather(-1, out.completion_ids.unsqueeze(-1))[..., 0]
    keep = out.completion_mask.bool()
    agree = (logp.argmax(-1) == out.completion_ids)[keep].float().mean().item()
    return (lp - out.logprobs).abs()[keep].max().item(), agree


def forward_logprob_diff(model: Any, out: Any, prompt_len: int) -> float:
    return forward_check(model, out)[0]


def bench_shape(shape: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from posttrain.rollout import Rollout, SamplingParams

    res: dict[str, Any] = {"shape": shape, "batch": BATCH.get(shape, 8), "prompt_len": args.prompt_len,
                           "new_tokens": args.new_tokens, "errors": {}}
    b, p, n = res["batch"], args.prompt_len, args.new_tokens
    t0 = time.perf_counter()
    model = build(shape, device, torch.bfloat16)
    sync()
    res["init_s"] = round(time.perf_counter() - t0, 1)
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    res["param_bytes"] = param_bytes
    res["floor_ms_per_token"] = param_bytes / BANDWIDTH * 1e3
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (b, p), generator=g).to(device)
    mask = torch.ones_like(ids)
    hf_kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    repeats = 3 if args.quick else 5

    def stage(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            res["errors"][name] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
        sync()
        print(f"[{shape}] {name} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    def hf_eager() -> None:
        run = lambda: model.generate(**hf_kw, do_sample=True, top_k=0, top_p=1.0, temperature=1.0)  # noqa: E731
        run()  # warm-up
        res["hf_eager_s"], res["hf_eager_all_s"], _ = timed(run, repeats)

    def hf_static() -> None:
        run = lambda: model.generate(**hf_kw, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,  # noqa: E731
                                     cache_implementation="static")
        res["hf_static_first_s"], _, _ = timed(run, 1)
        res["hf_static_s"], res["hf_static_all_s"], _ = timed(run, repeats)

    sampling = SamplingParams(max_new_tokens=n, pad_token_id=0, temperature=1.0, top_k=0, top_p=1.0)
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    outs: dict[str, Any] = {}
    holder: dict[str, Any] = {}
    res["variants"] = {}

    def engine(mode: str) -> None:
        """Build, compile and capture an engine with POSTTRAIN_ROLLOUT_COMPILE=mode; time it."""
        holder.pop("rollout", None)  # the previous variant's cache and graph pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
        compile_mode, _, fuse = mode.partition("+")
        os.environ["POSTTRAIN_ROLLOUT_COMPILE"] = compile_mode
        os.environ["POSTTRAIN_ROLLOUT_FUSE"] = "1" if fuse == "fuse" else "0"
        rollout = holder["rollout"] = Rollout(None, "policy", sampling, max_batch=b, max_prompt_len=p, model=model)
        v: dict[str, Any] = {"backend": rollout.stats["backend"], "fallback": rollout.stats["fallback"]}
        res["variants"][mode] = v
        torch.manual_seed(0)
        v["engine_first_s"], _, outs["first"] = timed(lambda: rollout.generate(ids, mask), 1)
        v["compile"] = rollout.stats.get("compile")  # "none" if compiling failed (then logged)
        v["capture_s"] = rollout.stats["capture_s"]
        v["graph_pool_bytes"] = rollout.stats.get("graph_pool_bytes", 0)
        v["kv_cache_bytes"] = rollout.stats["kv_cache_bytes"]
        v["fused_weight_bytes"] = rollout.stats.get("fused_weight_bytes", 0)
        timed(lambda: rollout.generate(ids, mask), 1)  # warm-up after capture
        eng = rollout.engine
        eng.profile = True
        prefill, decode = [], []

        def one() -> Any:
            out = rollout.generate(ids, mask)
            prefill.append(eng.timings["prefill_ms"])
            decode.append(eng.timings["decode_ms"] / max(1, eng.timings["decode_tokens"]))
            return out

        v["engine_s"], v["engine_all_s"], outs["sampled"] = timed(one, repeats + 2)
        eng.profile = False
        v["prefill_ms"] = statistics.median(prefill)
        v["decode_ms_per_token"] = statistics.median(decode)
        v["decode_ms_per_token_all"] = [round(x, 3) for x in decode]
        v["ratio_to_floor"] = v["decode_ms_per_token"] / res["floor_ms_per_token"]
        v["captures"], v["recaptures"] = rollout.stats["captures"], rollout.stats["recaptures"]
        if mode == modes[0]:
            res.update(v)  # the first variant's figures are the row's; the checks below use it

    def logprobs() -> None:
        res["logprob_max_abs_diff"] = forward_logprob_diff(model, outs["sampled"], p)

    def greedy() -> None:
        rollout = holder["rollout"]
        captures = rollout.stats["captures"]
        out = rollout.generate(ids, mask, replace(sampling, do_sample=False))
        res["greedy_new_captures"] = rollout.stats["captures"] - captures
        ref = model.generate(**hf_kw, do_sample=False)[:, p:]
        div = first_divergence(out.completion_ids, ref)
        res["greedy_first_divergence"] = div
        res["greedy_rows_identical"] = sum(d == n for d in div)
        res["greedy_logprob_max_abs_diff"], res["greedy_argmax_agreement"] = forward_check(model, out)
        outs["greedy"] = out

    def live_weights() -> None:
        rollout = holder["rollout"]
        captures = rollout.stats["captures"]
        with torch.no_grad():
            for q in model.parameters():
                q.mul_(1.25)  # in place, as an optimizer step writes
        out = rollout.generate(ids, mask, replace(sampling, do_sample=False))
        res["after_change_outputs_changed"] = bool(
            not torch.equal(out.completion_ids, outs["greedy"].completion_ids)
            or (out.logprobs - outs["greedy"].logprobs).abs().max().item() > 1e-3)
        res["after_change_logprob_max_abs_diff"] = forward_logprob_diff(model, out, p)
        res["after_change_new_captures"] = rollout.stats["captures"] - captures
        res["after_change_recaptures"] = rollout.stats["recaptures"]

    stage("hf_eager", hf_eager)
    if args.hf_static:
        stage("hf_static", hf_static)
    stage(f"engine_{modes[0]}", lambda: engine(modes[0]))
    if f"engine_{modes[0]}" not in res["errors"]:
        stage("logprobs", logprobs)
        stage("greedy", greedy)
        if "greedy" not in res["errors"]:
            stage("live_weights", live_weights)
    for mode in modes[1:]:  # timing only (the weights were scaled by live_weights: no matter for speed)
        stage(f"engine_{mode}", lambda mode=mode: engine(mode))
    holder.clear()
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res  # the model and engine are freed with this frame


def table(rows: list[dict[str, Any]]) -> str:
    def f(row: dict[str, Any], key: str, fmt: str = "{:.3f}") -> str:
        v = row.get(key)
        return "-" if v is None else fmt.format(v)

    lines = ["| | " + " | ".join(f"{r['shape']}, batch {r['batch']}" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    spec = [("generate eager, s", "hf_eager_s", "{:.3f}"), ("generate static, s", "hf_static_s", "{:.3f}"),
            ("generate static first call, s", "hf_static_first_s", "{:.1f}"),
            ("engine rollout, s", "engine_s", "{:.3f}"), ("engine first rollout (compile+capture), s",
                                                          "engine_first_s", "{:.1f}"),
            ("capture+compile, s", "capture_s", "{:.1f}"), ("prefill, ms", "prefill_ms", "{:.1f}"),
            ("decode, ms/token", "decode_ms_per_token", "{:.3f}"), ("floor, ms/token", "floor_ms_per_token", "{:.3f}"),
            ("ratio to floor", "ratio_to_floor", "{:.2f}"), ("graph pool, MiB", "graph_pool_bytes", None),
            ("KV cache, MiB", "kv_cache_bytes", None), ("captures / recaptures", None, None),
            ("max |logprob - forward|", "logprob_max_abs_diff", "{:.4f}"),
            ("greedy rows identical to generate", "greedy_rows_identical", "{}"),
            ("greedy first divergence (per row)", "greedy_first_divergence", "{}"),
            ("greedy tokens = forward argmax (same prefix)", "greedy_argmax_agreement", "{:.4f}"),
            ("after in-place change: outputs changed / new captures / logprob diff", None, None)]
    for mode in dict.fromkeys(m for r in rows for m in r.get("variants", {})):
        spec += [(f"[{mode}] decode ms/token, x floor", f"variant:{mode}", None),
                 (f"[{mode}] first rollout s / capture s", f"variant-first:{mode}", None)]
    for label, key, fmt in spec:
        cells = []
        for r in rows:
            if key and key.startswith("variant"):
                v = r.get("variants", {}).get(key.split(":", 1)[1])
                if not v or "decode_ms_per_token" not in v:
                    cells.append("-")
                elif key.startswith("variant:"):
                    cells.append(f"{v['decode_ms_per_token']:.3f}, {v['ratio_to_floor']:.2f}x")
                else:
                    cells.append(f"{v['engine_first_s']:.1f} / {v['capture_s']:.1f} ({v['compile']})")
            elif label.startswith("captures"):
                cells.append(f"{r.get('captures', '-')} / {r.get('recaptures', '-')}")
            elif label.startswith("after"):
                cells.append(f"{r.get('after_change_outputs_changed', '-')} / {r.get('after_change_new_captures', '-')}"
                             f" / {f(r, 'after_change_logprob_max_abs_diff', '{:.4f}')}")
            elif fmt is None:
                cells.append("-" if r.get(key) is None else f"{r[key] / 2**20:.1f}")
            else:
                cells.append(f(r, key, fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated presets of posttrain/memory.py SHAPES")
    ap.add_argument("--prompt-len", type=int, default=448)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="3 timed calls per measure instead of 5")
    ap.add_argument("--hf-static", action="store_true", help="also time generate(cache_implementation='static')")
    ap.add_argument("--out", default="rollout_bench.json")
    ap.add_argument("--compile", default="layer",
                    help="what torch.compile covers before capture (POSTTRAIN_ROLLOUT_COMPILE): layer, step or none, "
                         "each optionally +fuse (POSTTRAIN_ROLLOUT_FUSE=1: fused q|k|v and gate|up weights); a "
                         "comma-separated list times each (the first also gets the correctness checks)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no graphs, eager step)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("rollout_bench needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    import transformers

    known = [f"{m}{f}" for m in ("layer", "step", "none") for f in ("", "+fuse")]
    bad = [m for m in args.compile.split(",") if m.strip() not in known]
    if bad:
        ap.error(f"--compile: unknown {bad}; use {', '.join(known)}")
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "none"
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "gpu": gpu, "command": " ".join(["python", "benchmarks/rollout_bench.py",
                                                                      *(argv if argv is not None else sys.argv[1:])])}
    rows = []
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        rows.append(bench_shape(shape, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1))  # after each shape
    print(table(rows))
    for r in rows:
        if r["errors"]:
            print(f"{r['shape']}: errors in {list(r['errors'])}: {r['errors']}")
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
