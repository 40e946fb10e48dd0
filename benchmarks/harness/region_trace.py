"""Where a named stretch of host code spends its time: the host's wall time inside it against the device
kernels it launched (their summed time, their span on the device, the heaviest by name).

Functions are wrapped in ``torch.profiler.record_function`` for the profiled block only, so the code under
study is unchanged; kernels are matched to a region through the launch that made them (the trace's
correlation ids), so kernels queued earlier and running meanwhile are not counted in it.

    with regions({"append": (posttrain.rollout.turns, "extend")}) as report:
        ...                                   # the run to explain
    print(report.summary)
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Report:
    summary: dict[str, Any] = field(default_factory=dict)


def _wrap(name: str, fn: Any) -> Any:
    from torch.profiler import record_function

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


@contextmanager
def regions(targets: dict[str, tuple[Any, str]], top: int = 8) -> Iterator[Report]:
    """Profile the block with each ``targets[name] = (owner, attribute)`` callable marked as region ``name``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    saved = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}
    report = Report()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, _wrap(name, saved[name]))
        with profile(activities=activities) as prof:
            yield report
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, saved[name])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    report.summary = summarise(events, set(targets), top)


def summarise(events: list[dict[str, Any]], names: set[str], top: int) -> dict[str, Any]:
    """Per region: calls, host ms, kernel ms (summed), device span ms (each call's first kernel start to its
    last end, summed), the heaviest kernels; a launch belongs to the innermost region around it on its thread."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] in names]
    # cuBLAS and SDPA launch through the driver API, the rest through the runtime's
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})]
    kernels = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
               and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}
    out: dict[str, Any] = {}
    for name in sorted(names):
        mine = [s for s in spans if s["name"] == name]
        others = [s for s in spans if s["name"] != name]
        by_kernel: dict[str, list[float]] = defaultdict(list)
        span_us, launched = 0.0, 0
        for s in mine:
            a, b = s["ts"], s["ts"] + s["dur"]
            starts, ends = [], []
            for launch in launches:
                if launch.get("tid") != s.get("tid") or not a <= launch["ts"] <= b:
                    continue
                inner = [o for o in others if o.get("tid") == s.get("tid") and a <= o["ts"]
                         and o["ts"] + o["dur"] <= b and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
                if inner:  # a nested region owns it
                    continue
                launched += 1
                k = kernels.get(launch["args"]["correlation"])
                if k is not None:
                    by_kernel[k["name"]].append(k["dur"])
                    starts.append(k["ts"])
                    ends.append(k["ts"] + k["dur"])
            span_us += (max(ends) - min(starts)) if starts else 0.0
        heavy = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
        out[name] = {
            "calls": len(mine),
            "host_ms": round(sum(s["dur"] for s in mine) / 1e3, 3),
            "launches": launched,
            "kernel_ms": round(sum(sum(v) for v in by_kernel.values()) / 1e3, 3),
            "device_span_ms": round(span_us / 1e3, 3),
            "kernels": [{"name": n[:120], "count": len(v), "ms": round(sum(v) / 1e3, 3)} for n, v in heavy],
        }
    return out
