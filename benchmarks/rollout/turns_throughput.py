"""Multi-turn decode throughput of the rollout engine alone (issue 38's second target): the same model tokens
decoded across turns with tool results appended in the slot (``Rollout.generate_turns``) against decoded in
one turn (``Rollout.generate``). Target: one turn at most 1.3x the multi-turn tokens per second.

The model is the random-weight preset (default the 1.1B Llama shape, bf16) with scripted turns
(benchmarks/harness/scripted_turns.py): every turn is exactly ``--turn-tokens`` sampled tokens ending in
EOS. ``--prompts`` x ``--num-generations`` sequences, prompts of ``--prompt-len`` tokens ending in the
generation prompt, temperature 1, every sequence in its own slot.

- ``multi``: ``generate_turns``, EOS a stop token; after each of a sequence's first ``--calls`` turns the
  host appends the rendered result of the benchmark's tool (``--result-tokens`` tokens, TRL's
  ``_get_tool_suffix_ids`` rendering); ``--calls`` + 1 turns, so ``(calls + 1) x turn_tokens`` model tokens
  per sequence (checked on the output: a run with any other structure fails);
- ``single``: ``generate`` with no stop token and ``max_new_tokens = (calls + 1) x turn_tokens``: the same
  model tokens in one turn.

Each is run ``--warmup`` times (compile, graph capture) then ``--repeats`` times, device synchronised;
the figure is model tokens per second of the median run (tool tokens are not counted). Then one more run of
each, profiled (device synchronised between phases, so slower): milliseconds of prefill, decode, and the
appended tool tokens' prefill with the tools' host time.

    python benchmarks/rollout/turns_throughput.py --out turns_1b.json                     # one GPU
    python benchmarks/rollout/turns_throughput.py --shape tiny --repeats 1 --warmup 1    # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import scripted_turns  # noqa: E402
from benchmarks.harness.bench_models import prompt_rows  # noqa: E402

TINY = {"prompts": 2, "num_generations": 2, "prompt_len": 8, "turn_tokens": 4, "result_tokens": 12, "width": 2}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int, prompt_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` prompts of exactly ``prompt_len`` tokens (corpus text), each ending in ``<|assistant|>``."""
    tok = scripted_turns.tokenizer()
    ids = [tok(r["prompt"])["input_ids"][: prompt_len - 1] + [scripted_turns.ASSISTANT] for r in prompt_rows(n, prompt_len)]
    width = max(len(x) for x in ids)
    rows = [[tok.pad_token_id] * (width - len(x)) + x for x in ids]
    mask = [[0] * (width - len(x)) + [1] * len(x) for x in ids]
    return torch.tensor(rows, device=device), torch.tensor(mask, device=device)


class Tool:
    """Appends the tool's rendered result after each of a sequence's first ``calls`` turns."""

    def __init__(self, calls: int, suffix: list[int]) -> None:
        self.calls, self.suffix, self.seen = calls, suffix, {}

    def __call__(self, seq: int, ids: list[int], room: int) -> list[int] | None:
        turn = self.seen.get(seq, 0)
        self.seen[seq] = turn + 1
        return list(self.suffix) if turn < self.calls and len(self.suffix) <= room else None


def run(fn: Any, warmup: int, repeats: int) -> tuple[list[float], Any]:
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times, out


def check_multi(out: Any, args: argparse.Namespace, suffix: list[int]) -> dict[str, Any]:
    """Every sequence: (calls + 1) turns of turn_tokens model tokens, calls tool results of the suffix."""
    model_tokens = (out.completion_mask * out.tool_mask).sum(1).tolist()
    tool_tokens = (out.completion_mask * (1 - out.tool_mask)).sum(1).tolist()
    want_model, want_tool = (args.calls + 1) * args.turn_tokens, args.calls * len(suffix)
    bad = [i for i, (m, t) in enumerate(zip(model_tokens, tool_tokens)) if m != want_model or t != want_tool]
    own = (out.completion_mask * out.tool_mask).bool()  # the model's tokens (a tool result holds EOS too)
    eos = (out.completion_ids == scripted_turns.EOS).logical_and(own).sum(1).tolist()
    if bad or any(e != args.calls + 1 for e in eos):
        raise RuntimeError(f"multi-turn structure wrong in sequences {bad[:8]}: model tokens {model_tokens[:8]} "
                           f"(want {want_model}), tool tokens {tool_tokens[:8]} (want {want_tool}), turn ends "
                           f"{eos[:8]} (want {args.calls + 1})")
    return {"model_tokens_per_sequence": want_model, "tool_tokens_per_sequence": want_tool,
            "turns_per_sequence": args.calls + 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1b", help="a preset of posttrain.planner.memory.SHAPES (tiny: a CPU run)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--calls", type=int, default=3, help="tool calls per sequence")
    ap.add_argument("--turn-tokens", type=int, default=64, help="sampled tokens per turn (the last one EOS)")
    ap.add_argument("--result-tokens", type=int, default=64, help="tokens of each rendered tool result")
    ap.add_argument("--width", type=int, default=4, help="choices of token at each position of a turn")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", action="store_true",
                    help="one more multi-turn run under torch.profiler: host and kernel time of the prompt prefill, "
                         "the turns' collection, the tools with their appends, and the append's prefill alone "
                         "(benchmarks/harness/region_trace.py)")
    ap.add_argument("--out", default=None, help="a JSON file for the result")
    args = ap.parse_args()
    if args.shape == "tiny":
        defaults = ap.parse_args([])
        for k, v in TINY.items():
            if getattr(args, k) == getattr(defaults, k):
                setattr(args, k, v)
    from transformers import AutoModelForCausalLM

    from posttrain.rollout import Rollout, SamplingParams

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = scripted_turns.model_dir(args.shape, torch.bfloat16, args.turn_tokens, args.width)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(dev).eval()
    tok = scripted_turns.tokenizer()
    suffix = scripted_turns.suffix_ids(tok, scripted_turns.probe_text(tok, args.result_tokens))
    ids, mask = prompts(args.prompts * args.num_generations, args.prompt_len, dev)
    n, pad = ids.shape[0], tok.pad_token_id
    model_tokens = (args.calls + 1) * args.turn_tokens

    def rollout(max_new: int, stops: list[int]) -> Rollout:
        sampling = SamplingParams(max_new_tokens=max_new, pad_token_id=pad, temperature=1.0, stop_token_ids=stops)
        return Rollout(None, "policy", sampling, max_batch=n, max_prompt_len=ids.shape[1], model=model)

    multi = rollout(model_tokens + args.calls * len(suffix), [scripted_turns.EOS])
    single = rollout(model_tokens, [])
    result: dict[str, Any] = {"shape": args.shape, "sequences": n, "prompt_tokens": ids.shape[1], "calls": args.calls,
                              "turn_tokens": args.turn_tokens, "result_tokens": len(suffix),
                              "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    torch.manual_seed(0)
    times, out = run(lambda: multi.generate_turns(ids, mask, Tool(args.calls, suffix)), args.warmup, args.repeats)
    result["multi"] = {**check_multi(out, args, suffix), "times_s": times, "s": statistics.median(times),
                       "tokens_per_s": n * model_tokens / statistics.median(times),
                       "engine": {k: multi.stats.get(k) for k in ("backend", "fallback", "captures", "compile_fallbacks",
                                                                  "capture_fallbacks", "kv_cache_bytes")},
                       "degraded": multi.degraded}
    times, out = run(lambda: single.generate(ids, mask), args.warmup, args.repeats)
    decoded = out.completion_mask.sum(1)
    if not bool((decoded == model_tokens).all()):
        raise RuntimeError(f"single turn decoded {decoded.tolist()[:8]} tokens per sequence, want {model_tokens}")
    result["single"] = {"times_s": times, "s": statistics.median(times),
                        "tokens_per_s": n * model_tokens / statistics.median(times),
                        "engine": {k: single.stats.get(k) for k in ("backend", "fallback", "captures",
                                                                    "compile_fallbacks", "capture_fallbacks",
                                                                    "kv_cache_bytes")},
                        "degraded": single.degraded}
    for name, side, fn in (("multi", multi, lambda: multi.generate_turns(ids, mask, Tool(args.calls, suffix))),
                           ("single", single, lambda: single.generate(ids, mask))):
        side.profile = True
        fn()
        sync()
        side.profile = False
        result[name]["profile_ms"] = {k: round(v, 2) for k, v in side.timings.items()}
    if args.trace:
        from benchmarks.harness.region_trace import regions
        from posttrain.rollout import prefill, turns

        marks = {"prompt_prefill": (prefill, "into_rows"), "collect": (turns.Turns, "collect"),
                 "resolve": (turns.Turns, "resolve"), "append_prefill": (turns, "extend")}
        with regions(marks) as report:
            multi.generate_turns(ids, mask, Tool(args.calls, suffix))
        result["multi"]["trace"] = report.summary
    ratio = result["single"]["tokens_per_s"] / result["multi"]["tokens_per_s"]
    result["ratio"] = ratio
    result["target"] = (f"multi-turn {result['multi']['tokens_per_s']:.0f} model tokens/s against one turn's "
                        f"{result['single']['tokens_per_s']:.0f}: one turn {ratio:.2f}x (target <= 1.3x: "
                        f"{'met' if ratio <= 1.3 else 'missed'})")
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
