"""Where a profiled step's device time goes, phase by phase: reads the harness's torch.profiler trace
(``--profile-steps``; the trainers mark each phase with ``record_function("phase/NAME")``) and
prints, for each phase, its wall time, the device time of the kernels and copies launched inside
it, and its heaviest kernels.

    python benchmarks/trace_phases.py runs/CASE/trace-rank0.json.gz [--top 15] [--out phases.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def phases(trace: dict[str, Any], top: int) -> list[dict[str, Any]]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e["name"]).startswith("phase/")),
                   key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    out = []
    for m in marks:
        lo, hi = m["ts"], m["ts"] + m["dur"]
        inside = [e for e in device if lo <= e["ts"] < hi]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in inside:
            row = by_name[str(e["name"])[:110]]
            row[0] += 1
            row[1] += e["dur"]
        busy = sum(e["dur"] for e in inside)
        heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        out.append({"phase": m["name"][len("phase/"):], "wall_ms": round(m["dur"] / 1e3, 3),
                    "device_ms": round(busy / 1e3, 3), "launches": len(inside),
                    "top": [{"name": n, "count": c, "ms": round(t / 1e3, 3)} for n, (c, t) in heaviest]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        rows = phases(json.load(f), args.top)
    for r in rows:
        print(f"{r['phase']}: wall {r['wall_ms']} ms, device {r['device_ms']} ms, {r['launches']} launches")
        for k in r["top"]:
            print(f"    {k['ms']:9.3f} ms {k['count']:6d}x  {k['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
