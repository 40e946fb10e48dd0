"""The runner every one-GPU race of posttrain's trainers against TRL's uses (dpo_race, distill_race,
sft_race, reward_race, grpo_lora_race).

A race module describes itself as a :class:`Race` (its sides, its knobs with their GPU and tiny
defaults, and ``run_side``, which runs one side's trainer in the current process and returns what
it recorded) and calls :func:`main`. The runner then:

- runs every side once per ``--rounds``, alternating, each in a fresh process (``script --child
  SIDE --spec JSON``: a clean allocator peak and no accelerate state left from another side);
- times each optimizer step as the wall time between two consecutive steps, device synchronised
  (:class:`Stamps`: a TRL callback or a wrapper of posttrain's ``Session.step``), so data,
  loss and logging count on both sides; the median and lower quartile leave out the ``--warmup``
  first steps; tokens/s where a side reports its tokens per step;
- records ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the whole child;
- makes a CUDA out-of-memory a row with status ``oom`` (raised in Python or seen in a crashed
  child's output), a crash ``error`` and a child past ``--timeout`` ``timeout``;
- appends each row to ``<out>/<race>.jsonl`` as it finishes, re-renders ``<out>/results.md``
  (every race in the folder, ratios to each row's baseline, normally the ``trl`` row), appends the
  command to ``<out>/commands.txt`` and keeps each child's output in ``<out>/logs/``.

``--shape tiny`` (or ``--tiny``) takes every knob's tiny default: a run that a CPU finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2**30
OK_STATUSES = ("ok", "oom")  # an out-of-memory row is a result (the full fine-tune at 8B is expected to be one)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def q1(values: list[float]) -> float:
    """The lower quartile (benchmarks/harness/harness.py's reason: a shared host only adds time)."""
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


class Stamps(list):
    """Wall-clock stamps: one at the start, then one after every optimizer step (device synchronised)."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, Any]] = []  # TRL's logged rows, one per step at logging_steps 1

    def mark(self) -> None:
        sync()
        self.append(time.perf_counter())

    def callback(self) -> Any:
        """A ``TrainerCallback`` for TRL's trainers: a stamp at each step's end, and its logged row."""
        from transformers import TrainerCallback

        stamps = self

        class Stamp(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                stamps.mark()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    stamps.logs.append(dict(logs))

        return Stamp()

    def train(self, trainer: Any) -> list[dict[str, Any]]:
        """Train a posttrain trainer with its optimizer steps stamped; its logged rows that have a loss."""
        self.wrap_session(trainer.session)
        self.mark()
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h]

    def wrap_session(self, target: Any) -> None:
        """Stamp after every ``step`` of posttrain's ``Session`` that stepped the optimizer; ``target``
        is a session, or the Session class itself when the trainer makes its session (in ``__init__``)."""
        step = target.step
        if isinstance(target, type):
            def stamped(session: Any, name: str) -> bool:
                stepped = step(session, name)
                if stepped:
                    self.mark()
                return stepped
        else:
            def stamped(name: str) -> bool:
                stepped = step(name)
                if stepped:
                    self.mark()
                return stepped
        target.step = stamped


def per_step_tokens(cumulative: list[float]) -> list[float]:
    """Tokens of each step from a running ``num_tokens`` count (TRL's and posttrain's logged value)."""
    return [b - a for a, b in zip([0.0, *cumulative], cumulative)]


def phase_medians(history: list[dict[str, Any]]) -> dict[str, float]:
    """posttrain's own phase times (``time/<phase>``), medians over the given logged rows."""
    phases = sorted({k for h in history for k in h if k.startswith("time/")})
    return {k.removeprefix("time/"): statistics.median(h.get(k, 0.0) for h in history) for k in phases}


@dataclass
class Race:
    """One race: ``run_side(side, spec, workdir, stamps) -> dict`` runs a side here and returns its
    row's fields (``tokens_per_step``: a list, one per step, gives tokens/s). ``knobs``: name ->
    (default, tiny default, help), each an option ``--name`` and a key of the spec."""

    name: str
    doc: str
    script: str
    sides: tuple[str, ...]
    run_side: Callable[[str, dict[str, Any], Path, Stamps], dict[str, Any]]
    knobs: dict[str, tuple[Any, Any, str]] = field(default_factory=dict)
    shape: str = "1b"
    steps: int = 10
    warmup: int = 3
    rounds: int = 2
    baselines: dict[str, str] = field(default_factory=dict)  # side -> the side it is compared with (default "trl")
    default_sides: tuple[str, ...] = ()  # the rows run without --sides (empty: every side)
    planned: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # planner figures for the summary
    # (summary, rows) -> lines for results.md: the targets, as measured
    targets: Callable[[dict[str, dict[str, Any]], list[dict[str, Any]]], list[str]] | None = None

    def baseline(self, side: str) -> str | None:
        base = self.baselines.get(side, "trl" if "trl" in self.sides else None)
        return None if base == side else base


def is_oom(err: BaseException) -> bool:
    """CUDA allocator failures, and the library errors that wrap one (cuBLAS, NCCL, DeepSpeed)."""
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return any(s in text for s in ("out of memory", "cublas_status_alloc_failed", "cuda error: out of memory"))


# -- the child: one side in this process ---------------------------------------------------------
def child(race: Race, side: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stamps = Stamps()
    row: dict[str, Any] = {"side": side, "status": "ok"}
    try:
        row.update(race.run_side(side, spec, work, stamps))
    except Exception as err:  # noqa: BLE001 - an OOM is a row; anything else fails the child
        if not is_oom(err):
            raise
        row.update(status="oom", error=f"{type(err).__name__}: {str(err)[:800]}")
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    expected = spec["warmup"] + spec["steps"]
    if row["status"] == "ok" and len(steps) != expected:
        raise RuntimeError(f"{side}: timed {len(steps)} optimizer steps, expected {expected}")
    row["steps_done"] = len(steps)
    if len(steps) > spec["warmup"]:
        timed = steps[spec["warmup"]:]
        row.update(step_times=steps, step_s=statistics.median(timed), step_q1_s=q1(timed))
        tokens = row.get("tokens_per_step")
        if tokens and len(tokens) == len(steps):
            row["tokens_per_s"] = sum(tokens[spec["warmup"]:]) / sum(timed)
    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB if cuda else None
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB if cuda else None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        row.update(device=props.name, device_total_gib=props.total_memory / GiB)
    return row


# -- the parent: every side, alternating, each a fresh process -----------------------------------
def run_child(race: Race, side: str, spec: dict[str, Any], work: Path, log: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(race.script).resolve()), "--child", side, "--spec", json.dumps(spec),
           "--workdir", str(work)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        out += (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        code = None
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out)
    found = [ln for ln in out.splitlines() if ln.startswith("ROW ")]
    if code == 0 and found:
        row = json.loads(found[-1][4:])
    else:
        oom = "out of memory" in out.lower() or "outofmemoryerror" in out.lower()
        status = "timeout" if code is None else "oom" if oom else "error"
        row = {"side": side, "status": status, "returncode": code, "tail": out[-3000:]}
    row["wall_s"] = time.perf_counter() - t0
    row["log"] = str(log)
    return row


def summarize(race: Race, rows: list[dict[str, Any]], sides: list[str]) -> dict[str, dict[str, Any]]:
    """Per side: the median over rounds of each round's median step, tokens/s likewise, the highest
    peak; ratios to the side's baseline (speed-up = baseline step / this step, or tokens/s over
    the baseline's; memory = this peak / the baseline's)."""
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        timed = [r for r in mine if r.get("step_s") is not None and r["status"] == "ok"]
        peaks = [r["peak_allocated_gib"] for r in mine if r.get("peak_allocated_gib") is not None]
        reserved = [r["peak_reserved_gib"] for r in mine if r.get("peak_reserved_gib") is not None]
        statuses = sorted({r["status"] for r in mine})
        s: dict[str, Any] = {"status": "/".join(statuses), "rounds": len(mine),
                             "peak_allocated_gib": max(peaks) if peaks else None,
                             "peak_reserved_gib": max(reserved) if reserved else None}
        if timed:
            s["step_s"] = statistics.median(r["step_s"] for r in timed)
            s["step_q1_s"] = min(r["step_q1_s"] for r in timed)
            s["step_s_per_round"] = [r["step_s"] for r in timed]
            tps = [r["tokens_per_s"] for r in timed if r.get("tokens_per_s")]
            if tps:
                s["tokens_per_s"] = statistics.median(tps)
        out[side] = s
    for side, s in out.items():
        base = out.get(race.baseline(side) or "")
        if not base:
            continue
        s["baseline"] = race.baseline(side)
        if s.get("tokens_per_s") and base.get("tokens_per_s"):
            s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
        elif s.get("step_s") and base.get("step_s"):
            s["speedup"] = base["step_s"] / s["step_s"]
        if s.get("peak_allocated_gib") and base.get("peak_allocated_gib"):
            s["memory_ratio"] = s["peak_allocated_gib"] / base["peak_allocated_gib"]
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def render(out: Path) -> None:
    """``results.md``: one section per race file in ``out`` (its spec, one line per side, its targets)."""
    parts = ["# Races on one GPU: posttrain against TRL\n\nRendered by benchmarks/races/race.py from the `*.jsonl` "
             "files here; commands in `commands.txt`, each child's output in `logs/`. Speed-up: tokens/s "
             "(or step time) against the row named in `vs`; memory: peak allocated over the row's.\n"]
    for path in sorted(out.glob("*.jsonl")):
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        heads = [ln for ln in lines if "race" in ln and "spec" in ln]
        if not heads:
            continue
        head = heads[-1]
        rows = [ln for ln in lines[lines.index(head) + 1:] if "side" in ln]
        summaries = [ln for ln in lines[lines.index(head) + 1:] if "summary" in ln]
        summary = summaries[-1]["summary"] if summaries else None
        parts.append(f"## {head['race']}\n\n`{head['command']}`\n\nspec: `{json.dumps(head['spec'])}`\n")
        parts.append("| side | round | status | step s (median) | q1 | tokens/s | vs | speed-up | peak alloc GiB | "
                     "reserved GiB | memory ratio | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        by_side = summary or {}
        for r in rows:
            s = by_side.get(r["side"], {})
            note = r.get("error") or (r.get("tail", "")[-160:].replace("\n", " ") if r["status"] != "ok" else "")
            parts.append("| " + " | ".join([
                r["side"], str(r.get("round", "")), r["status"] + (f" ({note[:160]})" if note else ""),
                _fmt(r.get("step_s")), _fmt(r.get("step_q1_s")), _fmt(r.get("tokens_per_s"), ".0f"),
                _fmt(s.get("baseline")), _fmt(s.get("speedup"), ".2f") + ("x" if s.get("speedup") else ""),
                _fmt(r.get("peak_allocated_gib"), ".2f"), _fmt(r.get("peak_reserved_gib"), ".2f"),
                _fmt(s.get("memory_ratio"), ".2f"), _fmt(r.get("wall_s"), ".0f")]) + " |")
        found = summaries[-1].get("targets", []) if summaries else []
        if found:
            parts.append("\n" + "\n".join(f"- {line}" for line in found))
        parts.append("")
    (out / "results.md").write_text("\n".join(parts) + "\n")


def main(race: Race, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=race.doc.split("\n")[0])
    ap.add_argument("--shape", default=race.shape, help="a preset of posttrain.planner.memory.SHAPES; tiny: every knob's tiny default")
    ap.add_argument("--tiny", action="store_true", help="the same as --shape tiny")
    for name, (default, tiny, help_) in race.knobs.items():
        kind = type(default) if default is not None else type(tiny)
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                        help=f"{help_} (default {default}; {tiny} with --shape tiny)")
    ap.add_argument("--steps", type=int, default=race.steps, help="measured steps per row")
    ap.add_argument("--warmup", type=int, default=race.warmup, help="first steps left out of the median")
    ap.add_argument("--rounds", type=int, default=race.rounds, help="times every row runs, alternating")
    ap.add_argument("--sides", default=",".join(race.default_sides or race.sides),
                    help=f"comma-separated subset of {', '.join(race.sides)}")
    ap.add_argument("--out", default=None, help="results folder: <race>.jsonl, results.md, commands.txt, logs/")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one child may run")
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / race.name), help="where the runs write")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    if args.child:  # one row in this process, its JSON on the last line of stdout
        row = child(race, args.child, json.loads(args.spec), work)
        print("ROW " + json.dumps(row), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip a teardown where DeepSpeed's and gloo's threads can abort (benchmarks/harness/workloads.py)
    tiny = args.tiny or args.shape == "tiny"
    spec: dict[str, Any] = {"shape": "tiny" if tiny else args.shape, "steps": args.steps, "warmup": args.warmup}
    for name, (default, tiny_default, _) in race.knobs.items():
        given = getattr(args, name)
        spec[name] = given if given is not None else tiny_default if tiny else default
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(race.sides)
    if unknown:
        ap.error(f"unknown side(s) {sorted(unknown)}: choose from {', '.join(race.sides)}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / "races")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", os.path.relpath(Path(race.script).resolve(), ROOT), *argv])
    with (out / "commands.txt").open("a") as f:
        f.write(command + "\n")
    rows: list[dict[str, Any]] = []

    def emit(obj: dict[str, Any]) -> None:
        line = json.dumps(obj)
        print(line[:2000], flush=True)
        with (out / f"{race.name}.jsonl").open("a") as f:
            f.write(line + "\n")
        render(out)

    emit({"race": race.name, "spec": spec, "sides": sides, "rounds": args.rounds, "command": command})
    for rnd in range(args.rounds):
        for side in sides:  # alternating: every side once per round
            log = out / "logs" / f"{race.name}-{side}-r{rnd}.log"
            row = {**run_child(race, side, spec, work, log, args.timeout), "round": rnd}
            rows.append(row)
            emit(row)
    summary = summarize(race, rows, sides)
    final: dict[str, Any] = {"summary": summary}
    if race.planned is not None:
        final.update(race.planned(spec))
    if race.targets is not None:
        final["targets"] = race.targets(summary, rows)
    emit(final)
    return 0 if all(r["status"] in OK_STATUSES for r in rows) else 1
