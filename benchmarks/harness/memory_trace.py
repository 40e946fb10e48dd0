"""Where a stretch of a run's memory goes: every allocation made while tracing, replayed to find the peak, and
the allocations live at that peak grouped by the line that made them.

On CUDA the trace is the caching allocator's own history (``torch.cuda.memory._record_memory_history``, Python
stacks); on a CPU it is the profiler's memory events turned into the same snapshot format
(``torch.cuda._memory_viz._profile_to_snapshot``), so one analysis serves both. The planner's terms are checked
against what this reports (benchmarks/NOTES.md), not against a single peak figure.

    with traced() as trace:
        ...                                  # the stretch to explain
    print(peak(trace.snapshot, trace.device))
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
# Frames that say how, not where: the innermost frame outside them names an allocation.
_PLUMBING = ("torch/nn/modules/", "torch/nn/functional.py", "torch/autograd/", "torch/utils/checkpoint.py",
             "torch/_tensor.py", "torch/utils/_contextlib.py", "torch/_compile.py", "torch/_dynamo/",
             "accelerate/hooks.py", "harness/memory_trace.py", "<")
_PROFILED_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<name>.+)$")


@dataclass
class Trace:
    device: int = 0
    start_bytes: int = 0  # allocated when tracing began (CUDA; 0 on a CPU)
    snapshot: dict[str, Any] = field(default_factory=dict)


@contextmanager
def traced(max_entries: int = 2_000_000) -> Iterator[Trace]:
    """Record every allocation and free of the block (CUDA: the current device's allocator; else the CPU's
    through the profiler); ``trace.snapshot`` is filled on exit."""
    import torch

    trace = Trace()
    if torch.cuda.is_available():
        trace.device = torch.cuda.current_device()
        trace.start_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=max_entries)
        try:
            yield trace
        finally:
            trace.snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        yield trace
    trace.snapshot = {"device_traces": [_profiled_events(prof)]}


def _profiled_events(prof: Any) -> list[dict[str, Any]]:
    """The profiler's CPU allocations and frees as allocator-history events, each with its Python stack.
    Written here because torch's own conversion (``_memory_viz._profile_to_snapshot``) keeps only the blocks
    its memory profile proves are tensors, and drops the rest."""
    from torch._C._profiler import _EventType

    def name(node: Any) -> str:
        try:
            return node.name
        except UnicodeDecodeError:  # a few event names are not valid UTF-8
            return "?"

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    allocations = []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append(node)
    # A free and the allocation that reuses its address can share a timestamp: the free goes first.
    for node in sorted(allocations, key=lambda n: (n.start_time_ns, n.extra_fields.alloc_size > 0)):
        f = node.extra_fields
        frames, parent = [], node.parent
        while parent is not None:
            if parent.tag in (_EventType.PyCall, _EventType.PyCCall):
                frames.append({"filename": "none", "line": 0, "name": name(parent)})
            parent = parent.parent
        size = int(f.alloc_size)
        events.append({"action": "alloc" if size > 0 else "free_completed", "addr": int(f.ptr), "size": abs(size),
                       "frames": frames, "time_ns": node.start_time_ns})
    return events


def _frames(frames: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """(file, line, function) innermost first; the profiler's frames carry them in their name."""
    out = []
    for f in frames:
        if f.get("filename", "none") != "none":
            out.append((f["filename"], int(f.get("line", 0)), f.get("name", "?")))
        elif m := _PROFILED_FRAME.match(f.get("name", "")):
            out.append((m["file"], int(m["line"]), m["name"]))
    return out


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for package in ("posttrain/", "benchmarks/", "trl/", "torch/"):
        if f"/{package}" in path:
            return package + path.split(f"/{package}", 1)[1]
    return path


def where(frames: list[dict[str, Any]]) -> str:
    """An allocation's label: the innermost frame that is not plumbing, and the innermost posttrain frame
    around it (the trainer's step that led there). Allocations autograd makes in backward have no Python frame
    of their own: they are labelled by the ``backward()`` call."""
    parsed = [(_short(file), line, name) for file, line, name in _frames(frames)]
    own = next((f for f in parsed if not any(p in f[0] for p in _PLUMBING)), None)
    if own is None:
        return "(no Python frame)"
    ours = next((f for f in parsed if f[0].startswith("posttrain/") and f is not own), None)
    label = f"{own[0]}:{own[1]} {own[2]}"
    return label + (f" <- {ours[0]}:{ours[1]} {ours[2]}" if ours else "")


def peak(snapshot: dict[str, Any], device: int = 0, top: int = 25, start_bytes: int = 0,
         ignore: str | None = None) -> dict[str, Any]:
    """Replay ``device``'s allocation events: the peak of the bytes allocated during the trace (frees of blocks
    made before it count against it), and the blocks live at that peak grouped by :func:`where`; ``ignore``:
    leave out the blocks whose label contains it (the peak as if they were never made)."""
    events = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    if ignore:
        events = _without(events, ignore)
    live: dict[int, tuple[int, list]] = {}
    total = best = 0
    best_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            # A live address taken again was freed unrecorded (the profiler can drop or misorder a free).
            total += e["size"] - live.get(e["addr"], (0, None))[0]
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            total -= e["size"]
        if total > best:
            best, best_at = total, i
    # Replayed again to the peak: the blocks live there.
    live.clear()
    freed_before = 0
    for e in events[: best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is None:
            freed_before += e["size"]
    groups: dict[str, list[int]] = {}
    for size, frames in live.values():
        g = groups.setdefault(where(frames), [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"events": len(events), "peak_event": best_at, "start_gib": start_bytes / GiB,
            "peak_above_start_gib": best / GiB, "peak_gib": (start_bytes + best) / GiB,
            "freed_from_before_gib": freed_before / GiB, "live_blocks": len(live),
            "live_gib": sum(size for size, _ in live.values()) / GiB,
            "groups": [{"where": k, "gib": round(v[0] / GiB, 6), "blocks": v[1]} for k, v in ranked[:top]],
            "rest_gib": sum(v[0] for _, v in ranked[top:]) / GiB}


def _without(events: list[dict[str, Any]], ignore: str) -> list[dict[str, Any]]:
    """``events`` less the blocks whose label contains ``ignore``, and their frees."""
    kept, skipped = [], set()
    for e in events:
        if e["action"] == "alloc" and ignore in where(e.get("frames", [])):
            skipped.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] in skipped:
            skipped.discard(e["addr"])
        elif e["addr"] not in skipped or e["action"] == "alloc":
            kept.append(e)
    return kept


def format_peak(summary: dict[str, Any]) -> str:
    lines = [f"peak {summary['peak_gib']:.3f} GiB ({summary['peak_above_start_gib']:.3f} above the trace's start, "
             f"{summary['freed_from_before_gib']:.3f} of earlier blocks freed by then), {summary['live_blocks']} "
             f"blocks live, event {summary['peak_event']} of {summary['events']}:"]
    lines += [f"  {g['gib']:8.3f} GiB {g['blocks']:5d}  {g['where']}" for g in summary["groups"]]
    if summary["rest_gib"]:
        lines.append(f"  {summary['rest_gib']:8.3f} GiB        (the rest)")
    return "\n".join(lines)
