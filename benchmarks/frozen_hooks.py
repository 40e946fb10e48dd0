"""CPU cost of the fast frozen path per unit: a 22-layer model too small for its compute to
matter, forwards timed with DeepSpeed's stock ZeRO-3, posttrain's fast path and a replicated copy,
and the operator calls each makes (a count the host's speed does not change). What the fast path
adds over replicated, divided by its units, is the work each layer costs the CPU. With one process
every parameter lies in the rank's own slice and nothing is gathered (the hooks alone); with two,
gloo's all-gather is included.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 1 benchmarks/frozen_hooks.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig  # noqa: E402

from posttrain import Role, Session


def main() -> None:
    roles = [Role("policy", "zero2_train", trains=True), Role("fast", "zero3_inference"),
             Role("stock", "zero3_inference", fast_frozen=False), Role("rep", "replicated_inference")]
    s = Session(roles, micro_batch_size=1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=22, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    for name in ("fast", "stock", "rep"):
        torch.manual_seed(0)
        s.prepare(name, s.load(name, config=cfg))
    ids = torch.randint(3, 1000, (1, 16))

    def times_ms(name: str, n: int = 60) -> list[float]:
        engine, out = s.engines[name], []
        with torch.no_grad():
            for _ in range(5):
                engine(input_ids=ids)
            for _ in range(n):
                t = time.perf_counter()
                engine(input_ids=ids)
                out.append(1e3 * (time.perf_counter() - t))
        return out

    def operator_calls(name: str) -> int:
        """Operator calls one forward makes (the profiler's count: independent of the host's speed)."""
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            s.engines[name](input_ids=ids)
        return sum(e.count for e in prof.key_averages())

    units = len(s.fast_frozen["fast"].units)
    calls = {name: operator_calls(name) for name in ("rep", "fast")}
    print(f"operator calls per forward: replicated {calls['rep']}, fast {calls['fast']}; "
          f"fast adds {(calls['fast'] - calls['rep']) / units:.1f} per unit")
    for _ in range(3):
        t = {name: times_ms(name) for name in ("rep", "fast", "stock")}
        ms = {k: statistics.median(v) for k, v in t.items()}
        low = {k: min(v) for k, v in t.items()}  # the fastest sample: least disturbed by other load
        print(f"forward ms (median): replicated {ms['rep']:.2f}, fast {ms['fast']:.2f}, stock {ms['stock']:.2f}; "
              f"fast adds {1e3 * (ms['fast'] - ms['rep']) / units:.0f} us per unit by medians, "
              f"{1e3 * (low['fast'] - low['rep']) / units:.0f} by fastest samples ({units} units)")


if __name__ == "__main__":
    main()
