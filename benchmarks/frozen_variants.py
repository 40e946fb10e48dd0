"""Where the fast frozen forward's extra time goes on a GPU host: the 1B reference forward timed
replicated and fast, and fast with parts of its gather removed (results of the partial variants
are wrong on purpose; only their time matters). Each rank times its own forwards.

Run with one process before parameters in a rank's own slice became views of it (NOTES.md
section 8), it isolated the cost of copying that slice; since then one process copies nothing, so
run it with two to see the cost of copying the other rank's bytes.

    torchrun --standalone --nproc_per_node 2 benchmarks/frozen_variants.py [--shape 1b] [--out FILE]
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain import Role, Session
from posttrain.placement import frozen as fr
from posttrain.planner import memory

CURRENT = fr._Group.start


def start_no_copies(self, compute=None):  # events and stream switches, no copies
    if self.live:
        return
    self.storage.resize_(self.full_nbytes)
    self.live = True
    compute = compute or torch.cuda.current_stream()
    self.ready.record(compute)
    self.stream.wait_event(self.ready)
    torch.cuda.set_stream(self.stream)
    try:
        self.copied.record(self.stream)
    finally:
        torch.cuda.set_stream(compute)
    self.pending = True


def start_compute_stream(self, compute=None):  # copies on the compute stream: no events
    if self.live:
        return
    self.storage.resize_(self.full_nbytes)
    self.live = True
    for dst, src in self.copies:
        dst.copy_(src, non_blocking=True)


def start_alloc_only(self, compute=None):  # the allocator and the hooks only
    if self.live:
        return
    self.storage.resize_(self.full_nbytes)
    self.live = True


VARIANTS = {"fast": CURRENT, "no_copies": start_no_copies, "compute_stream": start_compute_stream,
            "alloc_only": start_alloc_only}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=6, help="rounds; each times every variant 3 times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = Session([Role("policy", "zero2_train", trains=True), Role("rep", "replicated_inference"),
                 Role("fast", "zero3_inference", fast_frozen=True)],
                micro_batch_size=1, mixed_precision="bf16")
    cfg = memory.model_config(args.shape)
    for name in ("rep", "fast"):
        torch.manual_seed(0)
        with torch.device(s.device) if name == "rep" else contextlib.nullcontext():
            model = s.load(name, config=cfg, dtype=torch.bfloat16)
        s.prepare(name, model)
    ids = torch.randint(3, cfg.vocab_size, (args.rows, args.seq_len), device=s.device)
    times: dict[str, list[float]] = {"rep": [], **{k: [] for k in VARIANTS}}

    def forward(name: str) -> float:
        engine = s.engines["rep" if name == "rep" else "fast"]
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            engine(input_ids=ids)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    for k in range(args.repeat + 1):
        for name in times:
            fr._Group.start = VARIANTS.get(name, CURRENT)
            got = [forward(name) for _ in range(3)]
            if k:  # round 0 warms up (and records the fast path's unit order)
                times[name] += got
    fr._Group.start = CURRENT
    units = len(s.fast_frozen["fast"].units)
    res = {"units": units, "median_ms": {k: statistics.median(v) for k, v in times.items()},
           "min_ms": {k: min(v) for k, v in times.items()}, "all_ms": times}
    res["us_per_unit_over_rep_by_min"] = {k: 1e3 * (res["min_ms"][k] - res["min_ms"]["rep"]) / units for k in times}
    print(json.dumps({k: res[k] for k in ("median_ms", "min_ms", "us_per_unit_over_rep_by_min")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
