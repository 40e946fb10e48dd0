"""ZeRO-mix benchmark harness: one workload and shape, several mixes, each in a fresh process group.

    python benchmarks/harness/harness.py --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --mixes all
    python benchmarks/harness/harness.py --report DIR (re-render DIR's table and plot from its JSON)

Every mix runs as its own ``torchrun`` of benchmarks/harness/workloads.py, one after another: the workload's
real trainer (posttrain's under posttrain's mixes, TRL's own under ``trl-zero2``/``trl-zero3``
where TRL has one). A run that runs out of memory, fails or times out becomes a row saying so; one
whose rollout engine fell back (a lost compile or graph, or ``generate`` instead of the engine) is
``degraded``. ``--rounds K`` runs the mixes K
times in alternating order (A B, B A, ...) and pools each mix's measured steps: on a shared host
the speed drifts over minutes, and alternation spreads that drift over every mix alike. Rows from several invocations
accumulate in ``DIR/results.json`` (default ``benchmarks/results/<date>-<machine>/``), and each
invocation re-renders ``results.md`` and ``results.png`` and appends its command to ``commands.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from posttrain.planner import memory  # noqa: E402

WORKER = ROOT / "benchmarks" / "harness" / "workloads.py"
ALL_MIXES = ["zero2-zero3", "zero3", "zero2-replicated", "zero2-zero3-offload", "trl-zero2", "trl-zero3",
             "zero2-zero3-stock"]


def machine_name(nproc: int) -> str:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).replace("NVIDIA", "").strip().replace(" ", "-")
        return f"{nproc}x{name}"
    return f"{nproc}xcpu"


def parse_shapes(workload: str, shape: str, overrides: list[str]) -> dict[str, str]:
    names = memory.WORKLOADS[workload]
    shapes = {}.fromkeys(names["trained"] + names["frozen"], shape)
    for item in overrides:
        role, _, value = item.partition("=")
        if role not in shapes or not value:
            raise SystemExit(f"--role-shape {item!r}: expected ROLE=SHAPE with ROLE one of {list(shapes)}")
        shapes[role] = value
    return shapes


def case_name(spec: dict[str, Any]) -> str:
    # A local model folder by its name: the case names a run directory.
    shapes = {r: s if s in memory.SHAPES else Path(s).name for r, s in spec["shapes"].items()}
    main = shapes[memory.WORKLOADS[spec["workload"]]["trained"][0]]
    odd = [f"{r}={s}" for r, s in shapes.items() if s != main]
    tag = "+".join([main, *odd])
    extra = f"-r{spec['response_len']}" if spec["workload"] in ("ppo", "grpo", "rloo") else ""
    if spec.get("generation_backend") == "hf":  # beside the default backend's rows in one results dir
        extra += "-hf"
    return f"{spec['workload']}-{tag}-mb{spec['micro_batch']}-s{spec['seq_len']}{extra}"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def stop(proc: subprocess.Popen) -> None:
    """End a torchrun and every worker it started. torch elastic starts each worker in a session of
    its own, so killing torchrun's group leaves them running (on a GPU: beside the next mix). SIGTERM
    first: torchrun's agent stops its workers (SIGTERM, then SIGKILL after 30 s); then SIGKILL for
    whatever is left of torchrun's group and of each worker's session."""
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_one(spec: dict[str, Any], run_dir: Path, nproc: int, timeout: float, worker: Path = WORKER) -> dict[str, Any]:
    """One mix in a fresh process group; the row for it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), str(run_dir / "spec.json"), str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false",
           # Fewer fragmentation OOMs: what fails then is what the allocated peak says.
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    start = time.perf_counter()
    status = None
    with open(run_dir / "log.txt", "w") as log:
        # A new session, so that a timeout can end torchrun and every worker it started.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc, status = -9, "timeout"
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    statuses = {r["status"] for r in ranks}
    if status is None:
        status = "oom" if "oom" in statuses else "error" if statuses - {"ok"} or rc != 0 or len(ranks) < nproc else "ok"
    row: dict[str, Any] = {"case": case_name(spec), **{k: spec[k] for k in (
        "workload", "shapes", "micro_batch", "seq_len", "response_len", "mix", "warmup", "steps")},
        "generation_backend": spec.get("generation_backend"),
        "world_size": nproc, "status": status, "wall_s": round(wall, 1)}
    # What ran, from any rank that got that far ("" if none did: every new row has the key).
    row["trainer"] = next((r["trainer"] for r in ranks if "trainer" in r), "")
    if any("gradient_checkpointing" in r for r in ranks):
        row["gradient_checkpointing"] = next(r["gradient_checkpointing"] for r in ranks if "gradient_checkpointing" in r)
    if status != "ok":
        errors = [r.get("error", "") for r in ranks if r.get("status") != "ok"]
        tail = (run_dir / "log.txt").read_text()[-1500:]
        row["error"] = errors[0] if errors else f"exit {rc}: {tail}"
    peaks = [r.get("peak_allocated_gib") for r in ranks]
    if any(p is not None for p in peaks):
        row["peak_allocated_gib"] = [round(p, 3) for p in peaks]
        row["peak_reserved_gib"] = [round(r["peak_reserved_gib"], 3) for r in ranks]
        row["device_total_gib"] = round(ranks[0]["device_total_gib"], 2)
    ok = [r for r in ranks if r.get("status") == "ok"]
    if status == "ok" and ok:
        r0 = ok[0]
        # Ranks step in lock-step; the slowest rank's median is the step time.
        row["step_s"] = round(max(r["step_s"] for r in ok), 4)
        row["phase_s"] = {k: round(max(r["phase_s"][k] for r in ok), 4) for k in r0["phase_s"]}
        row["step_q1_s"] = round(max(r["step_q1_s"] for r in ok), 4)
        row["phase_q1_s"] = {k: round(max(r["phase_q1_s"][k] for r in ok), 4) for k in r0["phase_q1_s"]}
        row["setup_s"] = round(max(r["setup_s"] for r in ok), 1)
        # Between steps (models, optimizer states, the engine's cache): the peak's floor.
        row["resting_allocated_gib"] = [round(r.get("resting_allocated_gib", 0.0), 3) for r in ok]
        row["tokens_per_s"] = round(r0["tokens_per_step"] * nproc / row["step_s"], 1)
        row["losses"] = [round(x, 5) for x in r0["losses"]]
        row["step_times"] = [{k: round(v, 5) for k, v in t.items()} for t in r0["step_times"]]  # rank 0's
        if r0.get("rollout"):
            row["rollout"] = r0["rollout"]
        if r0.get("compiled_layers") is not None:  # the policy's layers trained compiled (posttrain's GRPO/RLOO)
            row["compiled_layers"] = r0["compiled_layers"]
        if r0.get("engines"):  # DeepSpeed or the torch path, per trained role (the planner reads it)
            row["engines"] = r0["engines"]
        row.update(canary_verdict(ok))
        if row["status"] == "ok":
            row.update(rollout_verdict(ok))
    return row


def rollout_verdict(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """``degraded`` if any rank's rollout engine lost speed (``posttrain.rollout.api.slowed``: the
    counters ``Rollout.degraded`` reads) or gave way to transformers' ``generate`` (the row then
    times another path than it names); the reasons are the row's error."""
    from posttrain.rollout.api import slowed

    reasons = []
    for r in ranks:
        for role, st in (r.get("rollout") or {}).items():
            if slowed(st) or st.get("fallback"):
                why = st.get("fallback_reasons") or [st.get("fallback")]
                reasons.append(f"rank {r.get('rank')} {role}: " + "; ".join(str(w) for w in why if w))
    if not reasons:
        return {}
    return {"status": "degraded", "error": " | ".join(reasons)[:1500]}


def canary_verdict(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The canary's fields of a row (benchmarks/harness/canary.py): each frozen role's max abs difference
    from its unsharded weights over every rank (a wrong gather may show on one rank only), the
    largest of them, and the status: ``wrong`` beyond the tolerance, ``unchecked`` if the canary
    could not run. A trainer with no frozen model (SFT, reward) has an empty ``canary`` and nothing else."""
    errors = [r["canary_error"] for r in ranks if "canary_error" in r]
    if errors or any("canary" not in r for r in ranks):
        return {"status": "unchecked", "error": f"canary: {errors[0] if errors else 'no result'}"}
    if not any(r["canary"] for r in ranks):
        return {"canary": {}}
    per_role = {k: max(r["canary"][k] for r in ranks) for k in ranks[0]["canary"]}
    worst = max(per_role.values(), default=0.0)
    tolerance = ranks[0]["canary_tolerance"]
    out: dict[str, Any] = {"canary": per_role, "canary_max_abs_diff": worst, "canary_tolerance": tolerance}
    if worst > tolerance:
        bad = ", ".join(f"{k} {v:.3g}" for k, v in per_role.items() if v > tolerance)
        out.update(status="wrong", error=f"frozen outputs differ from the unsharded weights' beyond {tolerance}: {bad}")
    return out


def lower_quartiles(step_times: list[dict[str, float]]) -> dict[str, Any]:
    """``step_q1_s`` and ``phase_q1_s``: the first quartile of the step and of each phase.

    On a shared host, slow stretches only add time (a neighbour's load, CPU steal); they cannot
    make code faster. So, as ``timeit`` advises for its minimum, a low quantile estimates what the
    code costs and the median what this host made of it; both are reported."""
    def q1(values: list[float]) -> float:
        return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]

    return {"step_q1_s": q1([t["step"] for t in step_times]),
            "phase_q1_s": {k: q1([t[k] for t in step_times]) for k in step_times[0] if k != "step"}}


def pool_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a mix run several times: medians over every measured step of every round
    (rank 0's step times; ranks step in lock-step), the highest peaks, each round's own median."""
    if len(rows) > 1:  # rounds that --budget skipped or cut short add nothing
        rows = [r for r in rows if r["status"] != "skipped"] or rows[:1]
    if len(rows) == 1:
        return rows[0]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        return {**failed[0], "rounds": len(rows)}
    steps = [t for r in rows for t in r["step_times"]]
    row = {**rows[0], "rounds": len(rows), "steps": len(steps), "step_times": steps,
           "round_step_s": [r["step_s"] for r in rows], "round_phase_s": [r["phase_s"] for r in rows],
           "wall_s": round(sum(r["wall_s"] for r in rows), 1)}
    row["step_s"] = round(statistics.median(t["step"] for t in steps), 4)
    row["phase_s"] = {k: round(statistics.median(t[k] for t in steps), 4) for k in rows[0]["phase_s"]}
    q1 = lower_quartiles(steps)
    row["step_q1_s"] = round(q1["step_q1_s"], 4)
    row["phase_q1_s"] = {k: round(v, 4) for k, v in q1["phase_q1_s"].items()}
    row["tokens_per_s"] = round(rows[0]["tokens_per_s"] * rows[0]["step_s"] / row["step_s"], 1)
    row["setup_s"] = round(statistics.median(r["setup_s"] for r in rows), 1)
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        if key in rows[0]:
            row[key] = [max(vals) for vals in zip(*(r[key] for r in rows))]
    if "canary" in rows[0]:
        row["canary"] = {k: max(r["canary"][k] for r in rows) for k in rows[0]["canary"]}
    if "canary_max_abs_diff" in rows[0]:
        row["canary_max_abs_diff"] = max(r["canary_max_abs_diff"] for r in rows)
    return row


def planned_peak(row: dict[str, Any]) -> float | None:
    """The planner's peak for a row's configuration, in GiB."""
    try:
        p = memory.plan(row["workload"], row["shapes"], row["mix"], world_size=row["world_size"],
                        micro_batch=row["micro_batch"], seq_len=row["seq_len"], response_len=row["response_len"],
                        gpu_memory_gib=row.get("device_total_gib", 139.0),
                        generation_backend=row.get("generation_backend") or "hf",
                        gradient_checkpointing=bool(row.get("gradient_checkpointing")))
    except Exception:  # noqa: BLE001 - e.g. a hub model the planner cannot reach offline
        return None
    return p.peak / memory.GiB


def canary_cell(row: dict[str, Any]) -> str:
    """The canary's largest difference (and its tolerance) for the table; rows from before it: blank."""
    if "canary_max_abs_diff" not in row:
        return "no frozen role" if row.get("canary") == {} else ""
    return f"{row['canary_max_abs_diff']:.2g} (tol {row['canary_tolerance']:g})"


def render(out: Path) -> None:
    """results.md and results.png from results.json."""
    rows = json.loads((out / "results.json").read_text())["rows"]
    lines = ["| case | mix | trainer | status | step s | phases s | tokens/s | peak alloc GiB (max rank) | "
             "peak reserved GiB | planned GiB | plan err | set-up s | canary max abs diff |", "|" + "---|" * 13]
    for r in rows:
        peak = max(r["peak_allocated_gib"]) if r.get("peak_allocated_gib") else None
        measured = r["status"] in ("ok", "degraded")  # degraded: measured, on a slower generation path
        plan = planned_peak(r) if measured or r["status"] == "oom" else None
        err = f"{100 * (plan - peak) / peak:+.1f}%" if plan and peak and measured else ""
        if r["status"] == "oom" and plan and r.get("device_total_gib"):
            err = "predicts OOM" if plan > r["device_total_gib"] else "predicted to fit"
        q1 = r.get("phase_q1_s", {})
        phases = ", ".join(f"{k} {v:.3f}" + (f" (q1 {q1[k]:.3f})" if k in q1 else "")
                           for k, v in r.get("phase_s", {}).items())
        f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"  # noqa: E731
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
        # Rows from before the harness ran the trainers have no trainer: DPO, PPO and distillation
        # rows then timed a hand-written step on the Session (GRPO/RLOO ones were the trainers).
        trainer = r.get("trainer", "hand-written step" if r.get("workload") in ("dpo", "ppo", "distill") else "")
        lines.append(f"| {r['case']} | {r['mix']} | {trainer} | {status} | {f(r.get('step_s'), 3)} | {phases} | "
                     f"{f(r.get('tokens_per_s'), 0)} | {f(peak)} | "
                     f"{f(max(r['peak_reserved_gib']) if r.get('peak_reserved_gib') else None)} | {f(plan)} | {err} | "
                     f"{f(r.get('setup_s'), 1)} | {canary_cell(r)} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cols = min(2, len(cases))
    fig, axes = plt.subplots((len(cases) + cols - 1) // cols, cols, figsize=(6.5 * cols, 4.8 * ((len(cases) + 1) // 2)),
                             squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.axis("off")
    for ax, case in zip(axes.flat, cases):
        xmax = 0.0
        for i, r in enumerate(r for r in rows if r["case"] == case):
            total = r.get("device_total_gib")
            if r["status"] == "oom" and total:
                # Out of memory: a dashed line at the device's capacity, named down its side.
                ax.axvline(total, color="red", lw=0.9, ls="--")
                ax.text(total, 0.5, f"{r['mix']}: out of memory ", color="red", fontsize=8, rotation=90,
                        ha="right", va="center", transform=ax.get_xaxis_transform())
                xmax = max(xmax, total)
            elif r["status"] in ("ok", "degraded") and r.get("peak_allocated_gib"):
                x, y = max(r["peak_allocated_gib"]), r["step_s"]
                # One colour per mix across panels; TRL's baselines as squares.
                ax.scatter([x], [y], color=f"C{ALL_MIXES.index(r['mix']) if r['mix'] in ALL_MIXES else i}",
                           marker="s" if r["mix"].startswith("trl") else "o", s=45, label=r["mix"], alpha=0.85)
                xmax = max(xmax, x)
        ax.set_title(case, fontsize=10)
        ax.set_xlabel("peak allocated GiB per GPU (max over ranks)")
        ax.set_ylabel("median step s")
        ax.set_xlim(0, xmax * 1.08 or 1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)


def save(out: Path, rows: list[dict[str, Any]], command: str) -> None:
    path = out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": []}
    keep = {(r["case"], r["mix"]) for r in rows}
    data["rows"] = [r for r in data["rows"] if (r["case"], r["mix"]) not in keep] + rows
    path.write_text(json.dumps(data, indent=1) + "\n")
    if command:
        with open(out / "commands.txt", "a") as f:
            f.write(command + "\n")
    render(out)


def environment() -> dict[str, str]:
    import importlib.metadata as md

    env = {p: md.version(p) for p in ("torch", "transformers", "accelerate", "deepspeed", "trl")}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()
    except OSError:
        pass
    return env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/harness/harness.py", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=list(memory.WORKLOADS), default="dpo")
    ap.add_argument("--shape", default="tiny", help=f"a preset ({', '.join(memory.SHAPES)}), hub name or local path")
    ap.add_argument("--role-shape", action="append", default=[], metavar="ROLE=SHAPE",
                    help="a different shape for one role, e.g. value=1b")
    ap.add_argument("--micro-batch", type=int, default=4, help="per GPU: pairs (dpo, reward), prompts (ppo), sequences")
    ap.add_argument("--seq-len", type=int, default=512, help="whole sequence (a pair's: each side); "
                    "ppo: prompt + response")
    ap.add_argument("--response-len", type=int, default=64, help="ppo: tokens generated per prompt")
    ap.add_argument("--generation-backend", choices=["posttrain", "hf"], default="posttrain",
                    help="ppo: posttrain.rollout's engine, or transformers' generate")
    ap.add_argument("--mixes", default="all", help=f"comma-separated, or all: {','.join(ALL_MIXES)}")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="measured steps (the median is reported)")
    ap.add_argument("--rounds", type=int, default=1, help="run the mixes this many times, alternating their order, "
                    "and pool the measured steps")
    ap.add_argument("--profile-steps", type=int, default=0, help="after measuring, this many more steps under "
                    "torch.profiler; rank 0's trace and kernel table land in the run's directory under runs/")
    ap.add_argument("--memory-at-rest", action="store_true", help="record allocations (slower steps: a diagnostic "
                    "run) and write what is live as the last measured step begins, and at the recording's peak, "
                    "by origin, to each run's memory-at-rest-rank*.json")
    ap.add_argument("--nproc", type=int, default=2, help="processes (GPUs)")
    ap.add_argument("--precision", choices=["bf16", "no"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mix")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole invocation; later mixes are skipped")
    ap.add_argument("--min-run", type=float, default=45, help="seconds of budget a mix needs to start")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/<date>-<machine>")
    ap.add_argument("--report", metavar="DIR", default=None, help="only re-render DIR's results.md/png")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.report:
        render(Path(args.report))
        return 0
    if args.steps < 5:
        print("note: fewer than 5 measured steps", file=sys.stderr)
    mixes = ALL_MIXES if args.mixes == "all" else [m.strip() for m in args.mixes.split(",") if m.strip()]
    for m in mixes:
        memory.mix_configs(m)  # fail early on a typo
    out = Path(args.out or ROOT / "benchmarks" / "results" /
               f"{datetime.date.today().isoformat()}-{machine_name(args.nproc)}")
    out.mkdir(parents=True, exist_ok=True)
    base = dict(workload=args.workload, shapes=parse_shapes(args.workload, args.shape, args.role_shape),
                micro_batch=args.micro_batch, seq_len=args.seq_len,
                response_len=args.response_len if args.workload in ("ppo", "grpo", "rloo") else 0,
                generation_backend=args.generation_backend if args.workload == "ppo" else None,
                warmup=args.warmup, steps=args.steps, precision=args.precision, profile_steps=args.profile_steps,
                memory_at_rest=args.memory_at_rest)
    command = shlex.join(["python", "benchmarks/harness/harness.py", *argv])
    env = environment()
    start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in mixes}
    for k in range(args.rounds):
        for mix in mixes if k % 2 == 0 else mixes[::-1]:
            spec = {**base, "mix": mix}
            left = None if args.budget is None else args.budget - (time.perf_counter() - start)
            if left is not None and left < args.min_run:
                row = {"case": case_name(spec), **spec, "world_size": args.nproc, "status": "skipped",
                       "trainer": "", "error": "time budget spent"}
            else:
                timeout = args.timeout if left is None else min(args.timeout, left)
                tag = f"-round{k + 1}" if args.rounds > 1 else ""
                row = run_one(spec, out / "runs" / f"{case_name(spec)}-{mix}{tag}", args.nproc, timeout)
                if row["status"] == "timeout" and timeout < args.timeout:
                    # Cut short by --budget, not slower than --timeout: the mix did not fail.
                    row["status"], row["error"] = "skipped", "time budget spent while it ran"
            planned = planned_peak(row) if row["status"] != "skipped" else None
            row["env"] = env
            row["command"] = command
            runs[mix].append(row)
            peak = max(row["peak_allocated_gib"]) if row.get("peak_allocated_gib") else None
            print(f"[bench] {row['case']} {mix}{f' round {k + 1}' if args.rounds > 1 else ''}: {row['status']} "
                  f"step {row.get('step_s')} s, peak {peak} GiB, planned {planned and round(planned, 2)} GiB, "
                  f"wall {row.get('wall_s')} s" + (f" :: {row['error'][:300]}" if row["status"] != "ok" else ""),
                  flush=True)
            save(out, [pool_rounds(runs[mix])], command if k == 0 and mix == mixes[0] else "")
    rows = [pool_rounds(r) for r in runs.values()]
    if args.rounds > 1:
        for r in rows:
            print(f"[bench] {r['case']} {r['mix']} pooled over {r.get('rounds', 1)} rounds: step {r.get('step_s')} s "
                  f"(rounds: {r.get('round_step_s')})", flush=True)
    print(f"[bench] results in {out}")
    return 0 if all(r["status"] in ("ok", "oom") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
