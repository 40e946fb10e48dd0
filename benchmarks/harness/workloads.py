"""One benchmark run: one workload's real trainer under one mix, in the process group torchrun started.

Run by benchmarks/harness/harness.py as ``torchrun --nproc_per_node N benchmarks/harness/workloads.py SPEC OUTDIR``;
each rank writes ``OUTDIR/rank<R>.json``. Every workload runs a trainer end to end, on models of the
spec's shapes with random weights and rows of the tiny corpus cut to exact lengths
(benchmarks/harness/bench_models.py):

- posttrain's mixes: posttrain's own trainer (``DPOTrainer``, ``PPOTrainer``, ``DistillationTrainer``,
  ``GRPOTrainer``, ``RLOOTrainer``, ``SFTTrainer``, ``RewardTrainer``) with ``mix`` set;
- ``trl-zero2`` / ``trl-zero3``: TRL's own trainer (``trl.DPOTrainer``,
  ``trl.experimental.gkd.GKDTrainer``, ``trl.GRPOTrainer``, ``trl.RLOOTrainer``, ``trl.SFTTrainer``,
  ``trl.RewardTrainer``) with that single DeepSpeed config, its frozen models placed by ``prepare_deepspeed`` as TRL does. TRL 1.16 has no
  PPOTrainer (``trl.experimental.ppo`` was removed in 1.13), so PPO's baseline rows are posttrain's
  PPOTrainer in TRL's placement: every role under the trained config, frozen models at stage 0
  (trl-zero2) or ZeRO-3 with DeepSpeed's own gathering and memory-efficient linear (trl-zero3).

A step's time is the wall time of one optimizer step with the device synchronised at both ends:
posttrain's ``training_step`` (the loop's logging and checkpointing are outside it), TRL's
``on_step_begin`` to ``on_step_end`` (its DataLoader fetches the batch before). Phases are the
trainer's own ``time/*`` metrics (posttrain; TRL logs none). Memory: the allocator's peak per rank
over the whole run, the canary after it left out.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import grpo_e2e  # noqa: E402
from benchmarks.harness.bench_models import completion_rows, model_dir, preference_rows, prompt_rows  # noqa: E402
from benchmarks.harness.harness import lower_quartiles  # noqa: E402
from benchmarks.races.race import is_oom  # noqa: E402
from posttrain.demo import tiny  # noqa: E402
from posttrain.planner import memory, shapes  # noqa: E402

GiB = 2**30
# The single DeepSpeed config of TRL's baselines (trl.models.utils.prepare_deepspeed copies it to
# the frozen models, at stage 0 unless it is ZeRO-3).
TRL_CONFIGS = {"trl-zero2": "zero2_train", "trl-zero3": "zero3_train"}
# The logged value each trainer calls its loss; PPO's is the policy's.
LOSS_KEYS = {"ppo": "loss/policy_avg"}
# Time metrics that are the whole step, not one of its phases.
WHOLE_STEP = ("time/step", "time/update")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dtype_of(spec: dict[str, Any]) -> torch.dtype:
    return torch.bfloat16 if spec["precision"] == "bf16" else torch.float32


def total_steps(spec: dict[str, Any]) -> int:
    return spec["warmup"] + spec["steps"] + spec.get("profile_steps", 0)


# -- timing ------------------------------------------------------------------------------------------
LIBRARIES = ("posttrain/", "benchmarks/", "trl/", "transformers/", "deepspeed/", "accelerate/", "peft/")


def _by_origin(blocks: Any, top: int) -> list[list[Any]]:
    """(size, frames) pairs grouped by the innermost frame of posttrain, the benchmarks, TRL,
    transformers, DeepSpeed, accelerate or peft: [origin, GiB, count], largest first."""
    by_origin: dict[str, list[float]] = {}
    for size, frames in blocks:
        frame = next((f for f in frames or [] if any(lib in f["filename"] for lib in LIBRARIES)), None)
        origin = (f"{'/'.join(frame['filename'].split('/')[-2:])}:{frame['line']} {frame['name']}"
                  if frame else "(no frame recorded)")
        entry = by_origin.setdefault(origin, [0.0, 0])
        entry[0] += size / 2**30
        entry[1] += 1
    return sorted(([o, round(g, 4), n] for o, (g, n) in by_origin.items()), key=lambda r: -r[1])[:top]


def allocations_by_origin(snapshot: dict[str, Any], top: int = 40) -> list[list[Any]]:
    """Live allocations of a ``torch.cuda.memory._snapshot()`` by origin (:func:`_by_origin`)."""
    return _by_origin(((b["size"], b.get("frames")) for s in snapshot["segments"] for b in s["blocks"]
                       if b["state"] == "active_allocated"), top)


def allocations_at_peak(snapshot: dict[str, Any], device: int = 0, top: int = 40) -> dict[str, Any]:
    """Where the peak came from: the snapshot's allocation trace of ``device`` (its index in
    ``device_traces``) replayed, and the allocations live at its highest point grouped by origin.
    Relative to the trace's start (allocations made before recording began are not in it;
    ``truncated``: the trace filled its ring, so its first events are lost)."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []

    def replay(upto: int) -> tuple[dict[int, tuple[int, Any]], int, int]:
        """The allocations live after event ``upto``, and the highest total (and its event) on the way."""
        live: dict[int, tuple[int, Any]] = {}
        current = peak = 0
        peak_at = -1
        for i, e in enumerate(events[: upto + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames"))
                current += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                current -= live.pop(e["addr"])[0]
            if current > peak:
                peak, peak_at = current, i
        return live, peak, peak_at

    _, peak, peak_at = replay(len(events) - 1)
    live, _, _ = replay(peak_at)
    return {"peak_over_trace_start_gib": round(peak / 2**30, 4), "events": len(events), "peak_event": peak_at,
            "by_origin": _by_origin(live.values(), top)}


TRACE_ENTRIES = 1_000_000  # allocation events --memory-at-rest keeps (its "truncated" says when too few)


class StepClock:
    """Each optimizer step's wall time (device synchronised at both ends), and torch.profiler over
    the ``profile_steps`` steps after the measured ones: rank 0 writes a gzipped Chrome trace and
    its kernel table to the run's directory."""

    def __init__(self, spec: dict[str, Any], out: Path, rank: int) -> None:
        self.times: list[float] = []
        self.losses: dict[int, float] = {}  # TRL's logged loss by step
        self.phases: list[dict[str, float]] = []  # posttrain's, per step (TRL times none)
        self.resting: list[int] = []  # bytes allocated as each step begins (what stays between steps)
        self.first_begin: float | None = None
        self.profile_from = spec["warmup"] + spec["steps"] + 1
        self.profile_to = self.profile_from + spec.get("profile_steps", 0) - 1
        self.out, self.rank = out, rank
        self.prof: Any = None
        self.label: Any = None
        # Where the memory held between steps comes from (``memory_at_rest``: allocations recorded
        # from the trainer's construction, summarised by origin as the last measured step begins),
        # and what was live at the highest point of that recording (allocations_at_peak): before that
        # step, and through its end (a later step can peak higher than the first: Adam's states are
        # allocated inside the first one).
        self.memory_at_rest = bool(spec.get("memory_at_rest")) and torch.cuda.is_available()
        self.at_rest: dict[str, Any] | None = None
        if self.memory_at_rest:
            torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES)

    def _peak(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        peak = allocations_at_peak(snapshot, torch.cuda.current_device())  # this rank's GPU
        peak["truncated"] = peak["events"] >= TRACE_ENTRIES
        return peak

    def _write_memory_at_rest(self, final: bool) -> None:
        snapshot = torch.cuda.memory._snapshot()
        if final:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_at_rest = False
            self.at_rest["at_peak_through_last_step"] = self._peak(snapshot)
        else:
            self.at_rest = {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                            "by_origin": allocations_by_origin(snapshot), "at_peak": self._peak(snapshot)}
        (self.out / f"memory-at-rest-rank{self.rank}.json").write_text(json.dumps(self.at_rest, indent=1))

    def begin(self, step: int) -> None:
        if self.memory_at_rest and step == self.profile_from - 1:
            self._write_memory_at_rest(final=False)
        if step == self.profile_from and self.profile_to >= step:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        if self.prof is not None:
            from torch.profiler import record_function

            self.label = record_function(f"step_{step - self.profile_from}")
            self.label.__enter__()
        _sync()
        self.resting.append(torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)
        self.start = time.perf_counter()
        if self.first_begin is None:
            self.first_begin = self.start

    def end(self, step: int) -> None:
        _sync()
        self.times.append(time.perf_counter() - self.start)
        if self.memory_at_rest and self.at_rest is not None and step == self.profile_from - 1:
            self._write_memory_at_rest(final=True)
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if self.prof is not None and step == self.profile_to:
            self.prof.__exit__(None, None, None)
            if self.rank == 0:
                self._write(self.prof)
            self.prof = None

    def _write(self, prof: Any) -> None:
        import gzip
        import shutil

        raw = self.out / "trace-rank0.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(self.out / "trace-rank0.json.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        raw.unlink()
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        (self.out / "kernels-rank0.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))

    def callback(self) -> Any:
        """The same clock as a transformers callback, for TRL's trainers."""
        from transformers import TrainerCallback

        clock = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.begin(state.global_step + 1)

            def on_step_end(self, args, state, control, **kwargs):
                clock.end(state.global_step)  # already counts the step just taken

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    clock.losses[state.global_step] = float(logs["loss"])

        return StepTimes()


class TimedSteps:
    """Mixed into a posttrain trainer: its ``training_step`` between the clock's two readings, and
    the step's phases as this rank timed them (the ``time/*`` values the step returns; the logged
    row averages them over ranks)."""

    clock: StepClock

    def training_step(self, step: int) -> dict[str, Any]:
        self.clock.begin(step)
        row = super().training_step(step)
        self.clock.end(step)
        times = {**row, **row.get("times", {})}  # GRPO/RLOO return theirs under "times"
        self.clock.phases.append({k.removeprefix("time/"): v for k, v in times.items()
                                  if k.startswith("time/") and k not in WHOLE_STEP})
        return row


# -- settings both sides share -------------------------------------------------------------------
def posttrain_settings(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """posttrain's TrainConfig fields of every run: the placement, batch, steps and precision."""
    mix, role_configs = spec["mix"], {}
    if mix in TRL_CONFIGS:  # no TRL trainer for this workload: posttrain's in TRL's placement
        mix, role_configs = trl_placement(spec["workload"], mix)
    return dict(output_dir=str(out / "run"), overwrite_output_dir=True, disable_tqdm=True, logging_steps=1,
                max_steps=total_steps(spec), mix=mix, role_configs=role_configs, seed=0, learning_rate=1e-6,
                per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=1,
                bf16=spec["precision"] == "bf16", save_strategy="no")


def trl_placement(workload: str, mix: str) -> tuple[str, dict[str, Any]]:
    """What ``prepare_deepspeed`` gives each frozen model under the trained role's single config,
    as a posttrain mix and role configs: stage 0 (a full copy per GPU) under ZeRO-2; under ZeRO-3
    the trained config itself, with DeepSpeed's gathering (the ``-stock`` mix) and its
    memory-efficient linear on (DeepSpeed's default, which posttrain turns off for frozen roles)."""
    from posttrain.placement import dsconfig

    roles = memory.WORKLOADS[workload]
    train = TRL_CONFIGS[mix]
    if mix == "trl-zero2":
        frozen: Any = "replicated_inference"
    else:
        frozen = dsconfig.read_config(train)
        frozen["zero_optimization"]["memory_efficient_linear"] = True
    base = "zero2-replicated" if mix == "trl-zero2" else "zero2-zero3-stock"
    return base, {**{r: train for r in roles["trained"]}, **{r: frozen for r in roles["frozen"]}}


def trl_settings(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """TrainingArguments fields of every TRL run (the same batch, steps, rate and precision)."""
    from posttrain.placement import dsconfig

    cpu = not torch.cuda.is_available()  # CPU tests: gloo, or every rank runs alone as rank 0 of 1
    if cpu:  # DeepSpeed's own group, before zero.Init sizes the ZeRO-3 partitions
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    return dict(output_dir=str(out / "run"), deepspeed=dsconfig.read_config(TRL_CONFIGS[spec["mix"]]), report_to=[],
                save_strategy="no", logging_steps=1, use_cpu=cpu, ddp_backend="gloo" if cpu else None,
                disable_tqdm=True, dataloader_num_workers=0, max_steps=total_steps(spec), seed=0, learning_rate=1e-6,
                per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=1,
                bf16=spec["precision"] == "bf16")


def role_path(spec: dict[str, Any], role: str, kind: str = "causal", seed: int = 0) -> Path:
    """The saved model of a role's shape, in the run's shared vocabulary."""
    vocab = memory.shared_vocab(spec["shapes"], spec["workload"])
    return model_dir(spec["shapes"][role], dtype_of(spec), kind, vocab, seed)


def other_path(spec: dict[str, Any], role: str, like: str) -> str | None:
    """A frozen role's own model when its shape differs from ``like``'s, else None (the trainer's
    default: the same weights)."""
    return str(role_path(spec, role)) if spec["shapes"][role] != spec["shapes"][like] else None


def rows_needed(spec: dict[str, Any]) -> int:
    return total_steps(spec) * spec["micro_batch"] * int(os.environ.get("WORLD_SIZE", "1"))


# -- the trainers: (class, keyword arguments), built by run() -----------------------------------
def posttrain_dpo(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    cfg = DPOConfig(max_length=spec["seq_len"], **common)
    return DPOTrainer, dict(model=str(role_path(spec, "policy")), ref_model=other_path(spec, "reference", "policy"),
                            args=cfg, train_dataset=preference_rows(rows_needed(spec), spec["seq_len"]))


def trl_dpo(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy = role_path(spec, "policy")
    args = DPOConfig(max_length=spec["seq_len"], **common)  # after the args: a ZeRO-3 reference loads partitioned
    ref = other_path(spec, "reference", "policy")
    ref_model = shapes.model_class("causal").from_pretrained(ref, dtype=torch.float32) if ref else None
    return DPOTrainer, dict(model=str(policy), ref_model=ref_model, args=args,
                            train_dataset=Dataset.from_list(preference_rows(rows_needed(spec), spec["seq_len"])),
                            processing_class=tiny.load_tokenizer(policy))


def posttrain_ppo(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer

    prompt_len = spec["seq_len"] - spec["response_len"]
    cfg = PPOConfig(max_prompt_length=prompt_len, response_length=spec["response_len"],
                    total_episodes=rows_needed(spec), local_rollout_forward_batch_size=spec["micro_batch"],
                    generation_backend=spec.get("generation_backend") or "posttrain", **common)
    # Prompts longer than prompt_len, cut to it by max_prompt_length: every query is that long.
    return PPOTrainer, dict(args=cfg, model=str(role_path(spec, "policy")),
                            ref_model=other_path(spec, "reference", "policy"),
                            reward_model=str(role_path(spec, "reward", "sequence", seed=2)),
                            value_model=str(role_path(spec, "value", "sequence", seed=3)),
                            train_dataset=prompt_rows(rows_needed(spec), prompt_len + 8))


def posttrain_distill(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    # GKD's settings, as trl_distill's: the data's completions (lmbda 0), beta 0.5, dropout off, no checkpointing.
    cfg = DistillationConfig(max_length=spec["seq_len"], lmbda=0.0, beta=0.5, disable_dropout=True,
                             gradient_checkpointing=False, **common)
    return DistillationTrainer, dict(model=str(role_path(spec, "student")),
                                     teacher_model=str(role_path(spec, "teacher", seed=1)), args=cfg,
                                     train_dataset=completion_rows(rows_needed(spec), spec["seq_len"]))


def trl_distill(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    """TRL's GKDTrainer with the settings posttrain_distill gives posttrain's (lmbda 0: the data's completions,
    beta 0.5, no gradient checkpointing)."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    student = role_path(spec, "student")
    tok = tiny.load_tokenizer(student)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the row's text as it is
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in completion_rows(rows_needed(spec), spec["seq_len"])]
    args = GKDConfig(max_length=spec["seq_len"], lmbda=0.0, beta=0.5, seq_kd=False, temperature=1.0,
                     gradient_checkpointing=False, **common)
    # Loaded here, after the args (a ZeRO-3 config then partitions them), in TRL's default float32:
    # TRL's own loading from a path needs config.architectures, which not every local model records.
    load = shapes.model_class("causal").from_pretrained
    return GKDTrainer, dict(model=load(str(student), dtype=torch.float32),
                            teacher_model=load(str(role_path(spec, "teacher", seed=1)), dtype=torch.float32), args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tok)


def sft_documents(spec: dict[str, Any]) -> list[dict[str, str]]:
    """Text documents of ``seq_len`` tokens with the EOS both trainers add (benchmarks/races/sft_race.py's,
    all of the longest length it makes): padded batches of ``micro_batch`` x ``seq_len``."""
    from benchmarks.races.sft_race import documents

    return documents(spec["seq_len"], 1, count=rows_needed(spec))


def posttrain_sft(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    cfg = SFTConfig(max_length=spec["seq_len"], **common)
    return SFTTrainer, dict(model=str(role_path(spec, "policy")), args=cfg, train_dataset=sft_documents(spec))


def trl_sft(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    policy = role_path(spec, "policy")
    args = SFTConfig(max_length=spec["seq_len"], **common)  # before the model loads: ZeRO-3 partitions it
    return SFTTrainer, dict(model=str(policy), args=args, train_dataset=Dataset.from_list(sft_documents(spec)),
                            processing_class=tiny.load_tokenizer(policy))


def reward_rows(spec: dict[str, Any]) -> list[dict[str, str]]:
    """Preference pairs of about ``seq_len`` tokens a side, within ``max_length`` (benchmarks/races/reward_race.py's)."""
    from benchmarks.races.reward_race import reward_pairs

    return reward_pairs(rows_needed(spec), spec["seq_len"])


def posttrain_reward(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    cfg = RewardConfig(max_length=spec["seq_len"], **common)
    return RewardTrainer, dict(model=str(role_path(spec, "reward", "sequence")), args=cfg,
                               train_dataset=reward_rows(spec))


def trl_reward(spec: dict[str, Any], out: Path, common: dict[str, Any]) -> tuple[type, dict]:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    path = role_path(spec, "reward", "sequence")
    args = RewardConfig(max_length=spec["seq_len"], **common)
    return RewardTrainer, dict(model=str(path), args=args, train_dataset=Dataset.from_list(reward_rows(spec)),
                               processing_class=tiny.load_tokenizer(path))


BUILDERS = {"dpo": (posttrain_dpo, trl_dpo), "ppo": (posttrain_ppo, None), "distill": (posttrain_distill, trl_distill),
            "grpo": (grpo_e2e.posttrain_trainer, grpo_e2e.trl_trainer),
            "rloo": (grpo_e2e.posttrain_trainer, grpo_e2e.trl_trainer),
            "sft": (posttrain_sft, trl_sft), "reward": (posttrain_reward, trl_reward)}
# Sequences per micro-batch entry: a DPO or reward pair is two.
PAIRED = ("dpo", "reward")


# -- what a run reports ------------------------------------------------------------------------------
def frozen_models(trainer: Any) -> dict[str, tuple[Any, Any]]:
    """Each frozen model of a trainer: (engine, posttrain's fast frozen model or None)."""
    if hasattr(trainer, "session"):
        s = trainer.session
        return {n: (s.engines[n], s.fast_frozen.get(n)) for n in s.roles if not s.role(n).trains and n in s.engines}
    found = {"reference": getattr(trainer, "ref_model", None), "teacher": getattr(trainer, "teacher_model", None)}
    return {n: (m, None) for n, m in found.items() if m is not None}


def rollout_stats(trainer: Any) -> dict[str, dict[str, Any]]:
    """The rollout engines' counters by role (backend, fallbacks and their reasons, captures)."""
    from posttrain.rollout import Rollout

    engines = [getattr(trainer, "rollout", None), getattr(trainer, "rollout_engine", None),
               *getattr(trainer, "rollouts", {}).values()]
    return {r.role: dict(r.stats) for r in engines if isinstance(r, Rollout)}


def canary(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The correctness canary (benchmarks/harness/canary.py) after the measured steps: each frozen role's
    outputs on a batch of the run's shape against its weights run unsharded. A canary that cannot
    run leaves the row ``unchecked`` rather than losing its measurements."""
    from benchmarks.harness import canary as canary_check

    frozen = frozen_models(trainer)
    if not frozen:  # SFT, reward: nothing frozen, nothing to check (the row says so)
        return {"canary": {}}
    device = trainer.session.device if hasattr(trainer, "session") else trainer.accelerator.device
    ids = torch.randint(3, len(tiny.load_tokenizer()), (spec["micro_batch"], spec["seq_len"]), device=device)
    try:
        diffs = {name: canary_check.check(engine, ids, fast) for name, (engine, fast) in frozen.items()}
    except Exception as err:  # noqa: BLE001 - reported in the row
        return {"canary_error": f"{type(err).__name__}: {str(err)[:500]}"}
    return {"canary": diffs, "canary_tolerance": canary_check.TOLERANCE[dtype_of(spec)]}


def peak_memory(outside_bytes: int) -> dict[str, float]:
    """The allocator's peaks in GiB, with device bytes held outside it (posttrain's fast frozen
    shards in symmetric memory: ``Session.bytes_outside_allocator``) added back."""
    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": (torch.cuda.max_memory_allocated() + outside_bytes) / GiB,
            "peak_reserved_gib": (torch.cuda.max_memory_reserved() + outside_bytes) / GiB,
            "device_total_gib": torch.cuda.get_device_properties(0).total_memory / GiB}


def run(spec: dict[str, Any], out: Path, result: dict[str, Any]) -> None:
    """Build the trainer, train warm-up + measured (+ profiled) steps, fill ``result`` (times in
    seconds, memory in GiB); peaks are filled in before anything can fail after them."""
    t0 = time.perf_counter()
    baseline = spec["mix"] in TRL_CONFIGS and BUILDERS[spec["workload"]][1] is not None
    posttrain_build, trl_build = BUILDERS[spec["workload"]]
    clock = StepClock(spec, out, int(os.environ.get("RANK", "0")))
    if baseline:
        cls, kwargs = trl_build(spec, out, trl_settings(spec, out))
        result["trainer"] = f"{cls.__module__.split('.')[0]}.{cls.__name__}"  # named in the row if it fails
        trainer = cls(**kwargs, callbacks=[clock.callback()])
    else:
        cls, kwargs = posttrain_build(spec, out, posttrain_settings(spec, out))
        result["trainer"] = f"posttrain.{cls.__name__}" + (" (TRL's placement)" if spec["mix"] in TRL_CONFIGS else "")
        trainer = type(f"Timed{cls.__name__}", (TimedSteps, cls), {})(**kwargs)
        trainer.clock = clock
    result["gradient_checkpointing"] = bool(getattr(getattr(trainer, "cfg", None) or trainer.args,
                                                    "gradient_checkpointing", False))
    trainer.train()
    if hasattr(trainer, "session"):  # what ran each trained role (one process: DeepSpeed or the torch path)
        result["engines"] = {r: trainer.session.engine_kind(r) for r in trainer.roles["trained"]}
    outside = trainer.session.bytes_outside_allocator() if hasattr(trainer, "session") else 0
    result.update(peak_memory(outside))
    if len(clock.times) != total_steps(spec):
        raise RuntimeError(f"timed {len(clock.times)} optimizer steps, expected {total_steps(spec)}")
    measured = slice(spec["warmup"], spec["warmup"] + spec["steps"])
    history = [h for h in getattr(trainer, "history", []) if not any(k.startswith("eval/") for k in h)]
    if hasattr(trainer, "session"):
        key = LOSS_KEYS.get(spec["workload"], "loss")
        losses = [h.get(key, float("nan")) for h in history][measured]
        phases = clock.phases[measured]
    else:
        losses = [clock.losses.get(i + 1, float("nan")) for i in range(total_steps(spec))][measured]
        phases = [{} for _ in losses]
    steps = [{"step": t, **p} for t, p in zip(clock.times[measured], phases)]
    names = dict.fromkeys(k for s in steps for k in s if k != "step")
    steps = [{k: s.get(k, 0.0) for k in ("step", *names)} for s in steps]  # a phase that did not run: 0
    result.update(setup_s=clock.first_begin - t0, step_times=steps, losses=losses,
                  step_s=statistics.median(s["step"] for s in steps),
                  phase_s={k: statistics.median(s[k] for s in steps) for k in names},
                  tokens_per_step=(2 if spec["workload"] in PAIRED else 1) * spec["micro_batch"] * spec["seq_len"],
                  world_size=int(os.environ.get("WORLD_SIZE", "1")), rollout=rollout_stats(trainer),
                  compiled_layers=getattr(trainer, "compiled_layers", None),
                  resting_allocated_gib=max(clock.resting[measured]) / 2**30)
    result.update(lower_quartiles(steps))
    result.update(canary(trainer, spec))


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    spec.setdefault("precision", None)
    spec["precision"] = spec["precision"] or ("bf16" if torch.cuda.is_available() else "no")
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out_dir)
    result: dict[str, Any] = {"rank": rank, "status": "ok"}
    try:
        run(spec, out, result)
    except BaseException as err:  # noqa: BLE001 - every failure is reported, OOM as such
        result["status"] = "oom" if is_oom(err) else "error"
        result["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
        result["traceback"] = traceback.format_exc()[-4000:]
        if "peak_allocated_gib" not in result:
            result.update(peak_memory(0))
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    if result["status"] != "ok":
        # Other ranks may be blocked in a collective: exit at once so torchrun ends the group.
        print(f"rank {rank}: {result['status']}: {result['error'][:300]}", file=sys.stderr, flush=True)
        os._exit(3)
    # The measurement is written; skip interpreter teardown, where DeepSpeed's and gloo's threads
    # can abort the process (seen on CPU: "terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
