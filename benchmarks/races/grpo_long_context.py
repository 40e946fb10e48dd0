"""One GPU, GRPO at long completions (issue 40): how long a completion posttrain trains on one H200 and how long
TRL 1.16's GRPOTrainer + peft does, the same case on both sides.

The case: the random-weight Llama 3 8B shape (benchmarks/harness/bench_models.py's model, saved again with
``max_position_embeddings`` 131072), LoRA r ``--lora-r``, alpha ``--lora-alpha``, dropout 0.05 on every linear
layer but the head (peft's "all-linear"), ``--completions`` completions of one ``--prompt-len``-token prompt per
optimizer step (``num_generations`` = ``gradient_accumulation_steps`` = that, one completion per micro-batch),
every completion exactly ``max_completion_length`` tokens long (``min_new_tokens`` equal to it: posttrain's
sampling setting, ``generation_kwargs`` on TRL's side), temperature 1, beta 0 (TRL's default), learning rate
1e-6, bf16, the model loaded in ``--dtype``, activation checkpointing (TRL's default). Reward: the fraction of
even token ids (benchmarks/races/grpo_lora_race.py). Each row records the completions' mean length, so a row
that did not train at its length shows it.

Phases (``--phases``, each row a fresh process as benchmarks/races/race.py runs them, appended to
``<out>/grpo_long_context.jsonl`` as it finishes, so the rows of an interrupted run survive):

- ``posttrain``: posttrain at each of ``--lengths`` (timed: ``--warmup`` + ``--steps`` steps);
- ``planner``: ``posttrain plan --longest-completion``'s prediction for this case on a budget near
  ``--planner-gib`` GiB: halfway between the planner's peaks of the two lengths that straddle ``--planner-gib``
  (``--planner-exact-gib``: that budget itself), so the check decides whether the planner's error is under half a
  length step both ways, where a budget within its error of a boundary would decide nothing (recorded in the
  header line beside the prediction for the whole GPU, ``--gpu-gib``); then posttrain at the predicted length and
  at the next length up, each child held to the budget
  (``torch.cuda.set_per_process_memory_fraction``) for ``--warmup`` + ``--steps`` steps (a run's later steps hold
  Adam's states, which its first backward runs without): the first must fit and the second must not (CUDA only);
- ``trl``: TRL at ``--trl-start`` tokens, doubling until a length runs out of memory or passes ``--trl-max``
  (one untimed step each, ``--search-warmup`` more to time them); a child past ``--timeout`` is a ``timeout``
  row and ends the search undecided;
- ``trl-train``: TRL's training phase alone at ``--trl-start`` tokens, doubling as ``trl`` does: the same
  GRPOTrainer + peft, its generation replaced through TRL's own ``rollout_func`` by fixed completions of exactly
  that length (random ids, seeded; no sampler log-probs), because ``generate`` at these lengths runs past the
  device's per-command limit. It measures where TRL's training step runs out of memory, not its generation's
  peak (transformers' cache, freed before training);
- ``compare``: both sides timed at ``--compare-length`` (default: the longest length both reached, read from the
  rows of this ``--out`` folder, earlier invocations included), reusing a timed row at that length.

``--memory-trace``: posttrain's rows record every allocation of their last step after its generation and report the
peak, the blocks live at it by the line that made them, and the peak without DeepSpeed's gradient bucket
(benchmarks/harness/memory_trace.py): what the planner's terms are checked against.

    python benchmarks/races/grpo_long_context.py --out DIR                                # one H200, every phase
    python benchmarks/races/grpo_long_context.py --out DIR --phases trl --trl-start 8192  # one phase, resumed
    DS_ACCELERATOR=cpu python benchmarks/races/grpo_long_context.py --shape tiny --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.grpo_lora_race import LORA_DROPOUT, lora_b_norm, lora_config, parity_reward  # noqa: E402
from benchmarks.races.race import GiB, Stamps  # noqa: E402

NAME = "grpo_long_context"
LR = 1e-6
POSITIONS = 131072  # Llama 3.1's context: every searched length fits the model's positions
PHASES = ("posttrain", "planner", "trl", "trl-train", "compare")
# GPU run's defaults, then --shape tiny's: a CPU finishes it in a minute.
DEFAULTS = {"lengths": ([16384], [16]), "trl_start": (1024, 16), "trl_max": (131072, 16),
            "completions": (8, 2), "prompt_len": (128, 16), "lora_r": (16, 16), "lora_alpha": (32, 32),
            "planner_gib": (48.0, 1.2), "length_step": (1024, 8)}


def long_model(shape: str) -> Path:
    """The bench model of ``shape`` (bf16, random weights) with ``max_position_embeddings`` POSITIONS: a folder of
    links to its weights and its config rewritten (saved once)."""
    import torch
    from filelock import FileLock

    from benchmarks.harness.bench_models import model_dir

    base = model_dir(shape, torch.bfloat16)
    path = base.parent / f"{base.name}-pos{POSITIONS}"
    with FileLock(str(base.parent / f"{path.name}.lock")):
        if not (path / "config.json").exists():
            path.mkdir(exist_ok=True)
            for f in base.iterdir():
                if f.name != "config.json" and not (path / f.name).exists():
                    (path / f.name).symlink_to(f.resolve())
            config = json.loads((base / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS}, indent=2))
    return path


def settings(spec: dict[str, Any]) -> dict[str, Any]:
    """Both sides' config: one prompt's completions per step, one completion per micro-batch."""
    n = spec["completions"]
    return dict(per_device_train_batch_size=1, gradient_accumulation_steps=n, num_generations=n,
                max_completion_length=spec["response_len"], beta=0.0, temperature=1.0, learning_rate=LR,
                max_steps=spec["warmup"] + spec["steps"], bf16=True, seed=0, logging_steps=1, disable_tqdm=True,
                gradient_checkpointing=True, model_init_kwargs={"dtype": spec["dtype"]})


def lengths_logged(logs: list[dict[str, Any]]) -> list[float]:
    return [h["completions/mean_length"] for h in logs if "completions/mean_length" in h]


def fixed_completions(length: int, vocab: int) -> Any:
    """A TRL ``rollout_func``: each prompt tokenized, and a completion of exactly ``length`` random ids (no
    special ids, seeded by the call's index), no sampler log-probs."""
    import torch

    calls = [0]

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        g = torch.Generator().manual_seed(calls[0])
        calls[0] += 1
        ids = torch.randint(3, vocab, (len(prompts), length), generator=g).tolist()
        return {"prompt_ids": [tok(p)["input_ids"] for p in prompts], "completion_ids": ids, "logprobs": None}

    return rollout


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
            fixed: bool = False) -> dict[str, Any]:
    """TRL's GRPOTrainer + peft on this case; ``fixed``: its training phase alone (:func:`fixed_completions`)."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.demo import tiny

    args = GRPOConfig(output_dir=str(out / "trl"), report_to=[], save_strategy="no",
                      use_cpu=not torch.cuda.is_available(),
                      generation_kwargs={"min_new_tokens": spec["response_len"]}, **settings(spec))
    rollout = fixed_completions(spec["response_len"], AutoConfig.from_pretrained(path).vocab_size) if fixed else None
    trainer = GRPOTrainer(model=str(path), reward_funcs=[parity_reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tiny.load_tokenizer(path), peft_config=lora_config(spec),
                          callbacks=[stamps.callback()], rollout_func=rollout)
    stamps.mark()
    trainer.train()
    return {"mean_lengths": lengths_logged(stamps.logs), "lora_b_norm": lora_b_norm(trainer.model)}


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> dict[str, Any]:
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(output_dir=str(out / "posttrain"), overwrite_output_dir=True, save_strategy="no",
                     max_prompt_length=spec["prompt_len"], vllm_enable_sleep_mode=spec.get("sleep_mode", False),
                     **settings(spec))
    trainer = GRPOTrainer(str(path), reward_funcs=[parity_reward], args=cfg, train_dataset=rows,
                          peft_config=lora_config(spec))
    trainer.rollout.sampling.min_new_tokens = spec["response_len"]  # no completion ends before its length
    s = trainer.session
    trace = trace_after_last_generation(trainer, spec) if spec.get("memory_trace") else None
    try:
        history = stamps.train(trainer)
    except Exception:
        if trace is not None and trace.recording is not None:  # what was live when it failed (an OOM: the log)
            trace.summary()
        raise
    st = trainer.rollout.stats
    traced = {"memory_trace": trace.summary()} if trace is not None else {}
    return {"mean_lengths": lengths_logged(history), "engine": s.engine_kind("policy"),
            "master_weights": s.master_weights("policy"), "phase_s": race.phase_medians(history[spec["warmup"]:]),
            "lora_b_norm": lora_b_norm(s.engines["policy"]), "kv_cache_gib": st.get("kv_cache_bytes", 0) / GiB,
            "degraded": trainer.rollout.degraded,
            "rollout": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None}, **traced}


class PhaseTrace:
    """The trainer's phases, with :mod:`benchmarks.harness.memory_trace` recording from the end of the last
    step's generation to the end of training: the score, old-policy forward and training phases the planner's
    check is about (a trace through 16K decode steps would be mostly the sampler's small blocks)."""

    def __init__(self, phases: Any, generations: int) -> None:
        self.phases, self.left, self.trace, self.recording = phases, generations, None, None

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with self.phases(name):
            yield
        if name == "generate" and self.recording is None:
            self.left -= 1
            if self.left == 0:
                from benchmarks.harness.memory_trace import traced

                self.recording = traced()
                self.trace = self.recording.__enter__()

    def pop(self) -> dict[str, float]:
        return self.phases.pop()

    def summary(self) -> dict[str, Any]:
        from benchmarks.harness.memory_trace import format_peak, peak

        if self.recording is None:
            return {"error": "the last generation phase never ended"}
        self.recording.__exit__(None, None, None)
        found = peak(self.trace.snapshot, self.trace.device, start_bytes=self.trace.start_bytes)
        # The planner adds DeepSpeed's gradient bucket to the training activations: the peak without it says
        # whether the two are live together.
        found["without_bucket"] = peak(self.trace.snapshot, self.trace.device, start_bytes=self.trace.start_bytes,
                                       ignore="setup_buckets")
        print(format_peak(found), "\nwithout DeepSpeed's gradient bucket:", format_peak(found["without_bucket"]),
              flush=True)
        return found


def trace_after_last_generation(trainer: Any, spec: dict[str, Any]) -> PhaseTrace:
    """Wrap ``trainer.phases`` so the last optimizer step's phases after its generation are traced (one
    generation per step: a generation batch of one prompt's completions is one optimizer step here)."""
    trainer.phases = PhaseTrace(trainer.phases, spec["warmup"] + spec["steps"])
    return trainer.phases


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import prompt_rows

    if spec.get("memory_gib") and torch.cuda.is_available():  # the planner check's budget
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_gib"] * GiB / total))
    path = long_model(spec["shape"])
    rows = prompt_rows(spec["warmup"] + spec["steps"], spec["prompt_len"])
    if side.startswith("trl"):
        result = run_trl(spec, path, rows, out, stamps, fixed=side == "trl-train")
    else:
        result = run_posttrain(spec, path, rows, out, stamps)
    row = {"length": spec["response_len"], "purpose": spec["purpose"], "memory_gib": spec.get("memory_gib"), **result}
    row["exact_length"] = bool(row["mean_lengths"]) and all(x == spec["response_len"] for x in row["mean_lengths"])
    return row


RACE = race.Race(name=NAME, doc=__doc__, script=__file__, sides=("posttrain", "trl", "trl-train"), run_side=run_side)


def planner_prediction(spec: dict[str, Any], gib: float, step: int) -> dict[str, Any]:
    """``posttrain plan --longest-completion`` for this case (what GRPOTrainer runs on one GPU: the default mix,
    DeepSpeed ZeRO-2 with fp32 master weights for a decoded LoRA policy) on ``gib`` GiB."""
    from posttrain.planner import longest, memory

    lora = memory.Lora(spec["lora_r"], ("all-linear",), LORA_DROPOUT)

    def plan_at(n: int) -> memory.Plan:
        return memory.plan("grpo", spec["shape"], "zero2-zero3", world_size=1, micro_batch=1,
                           seq_len=spec["prompt_len"] + n, response_len=n, gpu_memory_gib=gib, lora=lora,
                           gradient_checkpointing=True, generation_batch=spec["completions"],
                           sleep_mode=spec.get("sleep_mode", False), gradient_accumulation_steps=spec["completions"])

    found = longest.longest_completion(plan_at, step)
    return {"gib": gib, "length_step": step, "longest": found.length, "next": found.next_length,
            "longest_peak_gib": found.plan.peak / GiB if found.plan else None,
            "next_peak_gib": found.next_plan.peak / GiB if found.next_plan else None, "line": found.line(),
            "command": f"posttrain plan --workload grpo --shape {spec['shape']} --world-size 1 --micro-batch 1 "
                       f"--generation-batch-size {spec['completions']} --seq-len {spec['prompt_len'] + 1} "
                       f"--response-len 1 --gradient-accumulation-steps {spec['completions']} --use-peft "
                       f"--lora-r {spec['lora_r']} --lora-target-modules all-linear "
                       f"--gradient-checkpointing --mix zero2-zero3 --master-weights fp32 --gpu-memory {gib} "
                       f"--longest-completion --length-step {step}"
                       + (" --vllm-enable-sleep-mode" if spec.get("sleep_mode") else "")}


def earlier_rows(out: Path) -> list[dict[str, Any]]:
    path = out / f"{NAME}.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in lines if "side" in r]


def reached(rows: list[dict[str, Any]], side: str) -> int:
    """The longest length ``side`` trained at its exact length (0: none)."""
    return max((r["length"] for r in rows if r["side"].split("@")[0] == side and r["status"] == "ok"
                and r.get("exact_length")), default=0)


def targets(rows: list[dict[str, Any]], planner: dict[str, Any] | None) -> list[str]:
    """Issue 40's long-context targets, as measured."""
    ours, trl = reached(rows, "posttrain"), reached(rows, "trl")
    lines = [f"posttrain trained {ours:,}-token completions (target >= 16,384: {'met' if ours >= 16384 else 'missed'})",
             f"TRL + peft's longest: {trl:,} tokens"
             + (f" (its first failure: {min(fails)[1]} at {min(fails)[0]:,})"
                if (fails := [(r["length"], r["status"]) for r in rows if r["side"].split("@")[0] == "trl"
                              and r["status"] != "ok"]) else "")]
    if train := [r for r in rows if r["side"].startswith("trl-train@")]:
        fits = max((r["length"] for r in train if r["status"] == "ok" and r.get("exact_length")), default=0)
        fails = sorted((r["length"], r["status"]) for r in train if r["status"] != "ok")
        lines.append(f"TRL's training phase alone (fixed completions through its rollout_func): {fits:,} tokens"
                     + (f" (its first failure: {fails[0][1]} at {fails[0][0]:,})" if fails else ""))
    timed = {(r["side"].split("@")[0], r["length"]): r for r in rows if r.get("timed") and r["status"] == "ok"}
    both = sorted({n for side, n in timed if side == "posttrain"} & {n for side, n in timed if side == "trl"})
    if both:
        n = both[-1]
        a, b = timed[("posttrain", n)], timed[("trl", n)]
        lines.append(f"at {n:,} tokens: posttrain {a['step_s']:.1f} s/step, {a['peak_allocated_gib'] or 0:.1f} GiB; TRL "
                     f"{b['step_s']:.1f} s/step, {b['peak_allocated_gib'] or 0:.1f} GiB: {b['step_s'] / a['step_s']:.2f}x")
    if planner and planner.get("longest"):
        checked = {r["purpose"]: r for r in rows if r.get("purpose", "").startswith("planner-")
                   and r["length"] in (planner["longest"], planner["next"])}
        got = {k: r["status"] + (" (rollout degraded: a fallback)" if r.get("degraded") else "")
               + (" (not at its length)" if r["status"] == "ok" and not r.get("exact_length") else "")
               for k, r in checked.items()}
        if got:
            ok = got.get("planner-longest") == "ok" and got.get("planner-next") == "oom"
            lines.append(f"planner on {planner['gib']} GiB: {planner['longest']:,} predicted to fit "
                         f"({got.get('planner-longest')}), {planner['next']:,} not ({got.get('planner-next')}): "
                         f"{'confirmed' if ok else 'NOT confirmed'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return race.main(RACE, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", help="a preset of posttrain.planner.memory.SHAPES; tiny: the tiny defaults")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}")
    ap.add_argument("--lengths", default=None, help="posttrain's completion lengths, comma-separated (16384)")
    for name in DEFAULTS:
        if name != "lengths":
            kind = type(DEFAULTS[name][0])
            ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                            help=f"default {DEFAULTS[name][0]}; {DEFAULTS[name][1]} with --shape tiny")
    ap.add_argument("--gpu-gib", type=float, default=139.0, help="the whole GPU, for the recorded prediction")
    ap.add_argument("--planner-exact-gib", action="store_true",
                    help="check the planner on --planner-gib itself, not halfway between its two straddling peaks")
    ap.add_argument("--compare-length", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", help="model_init_kwargs dtype, both sides")
    ap.add_argument("--sleep-mode", action="store_true",
                    help="posttrain's rows and the planner with vllm_enable_sleep_mode (the engine's cache freed while "
                         "training)")
    ap.add_argument("--memory-trace", action="store_true",
                    help="posttrain's rows trace their last step after its generation (benchmarks/harness/memory_trace.py): "
                         "the peak and the blocks live at it, in the row (recording slows that step: not for timing)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps of a timed row")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps of a timed row")
    ap.add_argument("--search-warmup", type=int, default=0, help="warm-up steps of TRL's search rows (0: untimed)")
    ap.add_argument("--out", default=None, help="results folder: grpo_long_context.jsonl, results.md, logs/")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one child may run")
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / NAME))
    args = ap.parse_args(argv)
    tiny = args.shape == "tiny"
    pick = {name: (getattr(args, name, None) if name != "lengths" else args.lengths) for name in DEFAULTS}
    pick = {k: v if v is not None else DEFAULTS[k][1 if tiny else 0] for k, v in pick.items()}
    lengths = [int(x) for x in pick["lengths"].split(",")] if isinstance(pick["lengths"], str) else pick["lengths"]
    phases = [p for p in args.phases.split(",") if p]
    if set(phases) - set(PHASES) or any(n < 1 for n in lengths) or pick["trl_start"] < 1:
        ap.error(f"--phases takes {', '.join(PHASES)} and lengths are positive token counts")
    base = {"shape": args.shape, "completions": pick["completions"], "prompt_len": pick["prompt_len"],
            "lora_r": pick["lora_r"], "lora_alpha": pick["lora_alpha"], "dtype": args.dtype,
            "sleep_mode": args.sleep_mode, "memory_trace": args.memory_trace}
    out = Path(args.out or ROOT / "benchmarks" / "results" / "races")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir)
    command = shlex.join(["python", os.path.relpath(Path(__file__).resolve(), ROOT), *argv])
    with (out / "commands.txt").open("a") as f:
        f.write(command + "\n")

    def emit(obj: dict[str, Any]) -> None:
        print(json.dumps(obj)[:2000], flush=True)
        with (out / f"{NAME}.jsonl").open("a") as f:
            f.write(json.dumps(obj) + "\n")
        race.render(out)

    planner = planner_prediction(base, pick["planner_gib"], pick["length_step"])
    if not args.planner_exact_gib and planner["longest_peak_gib"] and planner["next_peak_gib"]:
        planner = planner_prediction(base, round((planner["longest_peak_gib"] + planner["next_peak_gib"]) / 2, 3),
                                     pick["length_step"])
    whole = planner_prediction(base, args.gpu_gib, pick["length_step"])
    emit({"race": NAME, "spec": {**base, **pick, "phases": phases, "steps": args.steps, "warmup": args.warmup},
          "planner": planner, "planner_whole_gpu": whole, "command": command})
    rows = earlier_rows(out)

    def run(side: str, length: int, purpose: str, timed: bool = True, memory_gib: float | None = None) -> dict:
        warmup = args.warmup if timed else args.search_warmup
        spec = {**base, "response_len": length, "purpose": purpose, "warmup": warmup,
                "steps": args.steps if timed or warmup else 1, "memory_gib": memory_gib}
        log = out / "logs" / f"{NAME}-{side}-{length}-{purpose}.log"
        row = {**race.run_child(RACE, side, spec, work, log, args.timeout), "side": f"{side}@{length}",
               "length": length, "purpose": purpose, "timed": warmup > 0}
        rows.append(row)
        emit(row)
        return row

    if "posttrain" in phases:
        for n in lengths:
            run("posttrain", n, "lengths")
    if "planner" in phases:
        import torch

        if not torch.cuda.is_available():
            print("planner: no CUDA device, so the predicted lengths are recorded, not run", flush=True)
        elif planner["longest"] and planner["next"]:
            # A warm-up step first: the peak of a run's later steps holds Adam's states, which the first step's
            # backward runs without.
            run("posttrain", planner["longest"], "planner-longest", memory_gib=planner["gib"])
            run("posttrain", planner["next"], "planner-next", memory_gib=planner["gib"])
    for side in ("trl", "trl-train"):  # doubling until a length fails
        n = pick["trl_start"]
        while side in phases and n <= pick["trl_max"]:
            if run(side, n, f"{side}-search", timed=False)["status"] != "ok":
                break
            n *= 2
    if "compare" in phases:
        n = args.compare_length or min(reached(rows, "posttrain"), reached(rows, "trl"))
        if n:
            for side in ("posttrain", "trl"):
                if not any(r["side"] == f"{side}@{n}" and r["status"] == "ok" and r.get("timed") for r in rows):
                    run(side, n, "compare")
        else:
            print("compare: no length both sides reached yet", flush=True)
    emit({"summary": race.summarize(RACE, rows, sorted({r["side"] for r in rows})),
          "targets": targets(rows, planner)})
    return 0 if all(r["status"] in race.OK_STATUSES for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
