"""CPU cost of the fast frozen path's hooks per unit: a 22-layer model too small for its compute to
matter, one process, forwards timed with DeepSpeed's stock ZeRO-3, posttrain's fast path and a
replicated copy. What the fast path adds over replicated, divided by its units, is the Python and
dispatch work each layer's gather costs on the CPU (which is what a CPU-bound forward pays).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 1 benchmarks/frozen_hooks.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig  # noqa: E402

from posttrain import Role, Session  # noqa: E402


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

    def median_ms(name: str, n: int = 60) -> float:
        engine, out = s.engines[name], []
        with torch.no_grad():
            for _ in range(5):
                engine(input_ids=ids)
            for _ in range(n):
                t = time.perf_counter()
                engine(input_ids=ids)
                out.append(time.perf_counter() - t)
        return 1e3 * statistics.median(out)

    units = len(s.fast_frozen["fast"].units)
    for _ in range(3):
        ms = {name: median_ms(name) for name in ("rep", "fast", "stock")}
        print(f"forward ms: replicated {ms['rep']:.2f}, fast {ms['fast']:.2f}, stock {ms['stock']:.2f}; "
              f"fast adds {1e3 * (ms['fast'] - ms['rep']) / units:.0f} us per unit ({units} units)")


if __name__ == "__main__":
    main()
