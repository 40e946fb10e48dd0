"""End to end GRPO/RLOO benchmark runs: posttrain's trainer under a mix against TRL's own trainer.

Run by the harness as a worker (``harness.run_one(spec, dir, nproc, timeout, worker=THIS)``, from
``python benchmarks/grpo_bench.py``): ``torchrun --nproc_per_node N benchmarks/grpo_e2e.py SPEC OUTDIR``,
each rank writing ``OUTDIR/rank<R>.json`` in the harness's format. Both sides run the same thing:

- the policy of the spec's shape with random weights, saved once to ``.cache/posttrain/bench-models``
  (a preset has no checkpoint, and TRL loads its reference from the policy's path), and the tiny
  default's tokenizer (its ids are valid in every preset's vocabulary);
- prompts of about ``seq_len - response_len`` tokens, ``num_generations`` completions each of up to
  ``response_len`` tokens, ``micro_batch`` completions per GPU per step, one optimizer step per
  generation; a cheap Python reward function (so the comparison is the models' work);
- ``beta`` (default 0.04): the reference model, frozen.

posttrain's rows (any mix) time ``GRPOTrainer.train()``'s steps (``time/step`` and its phases);
``trl-zero2`` / ``trl-zero3`` run ``trl.GRPOTrainer`` (``trl.RLOOTrainer``) with that DeepSpeed
config, its own ``generate`` path (ZeRO-3 gathered for generation, TRL's default), timing each
optimizer step with a callback. Memory: the allocator's peak per rank over the whole run.
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import lower_quartiles  # noqa: E402
from benchmarks.workloads import PEAK, fold_peak, is_oom  # noqa: E402
from posttrain import memory  # noqa: E402
from posttrain.demo import tiny  # noqa: E402

GiB = 2**30
TRL_CONFIGS = {"trl-zero2": "zero2_train", "trl-zero3": "zero3_train"}


def length_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A reward that costs nothing next to the models: the completion's length."""
    return [float(len(ids)) for ids in completion_ids]


def model_dir(shape: str, dtype: torch.dtype) -> Path:
    """The policy of ``shape`` with random weights (seed 0) and the tiny tokenizer, saved once."""
    from filelock import FileLock

    if shape not in memory.SHAPES:
        return Path(shape)  # a hub name or local path: used as it is
    base = tiny.cache_dir() / "bench-models"
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{shape}-{str(dtype).removeprefix('torch.')}"
    with FileLock(str(base / f"{path.name}.lock")):
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            cfg = memory.model_config(shape)
            cfg.eos_token_id = tiny.load_tokenizer().eos_token_id
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is fast there
                model = memory.model_class("causal").from_config(cfg, dtype=dtype)
            model.save_pretrained(str(path))
            del model
            if torch.cuda.is_available():  # the run's peak is the trainer's, not this
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            tiny.load_tokenizer().save_pretrained(str(path))
    return path


def prompt_rows(n: int, prompt_len: int) -> list[dict[str, str]]:
    """``n`` distinct prompts of the tiny corpus's text, each about ``prompt_len`` tokens."""
    tok = tiny.load_tokenizer()
    lines = tiny.corpus()
    rows = []
    for i in range(n):
        text, k = "", i
        while len(tok(text)["input_ids"]) < prompt_len:
            text += lines[k % len(lines)] + " "
            k += 7
        ids = tok(text)["input_ids"][:prompt_len]
        rows.append({"prompt": tok.decode(ids)})
    return rows


def _settings(spec: dict[str, Any]) -> dict[str, Any]:
    return dict(per_device_train_batch_size=spec["micro_batch"], num_generations=spec.get("num_generations", 8),
                max_completion_length=spec["response_len"], beta=spec.get("beta", 0.04), temperature=1.0,
                learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"], gradient_accumulation_steps=1,
                bf16=spec["precision"] == "bf16", seed=0)


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path) -> tuple[list[dict], Any]:
    """posttrain's trainer: per measured step its time and phases; returns (steps, trainer)."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if spec["workload"] == "rloo" else (GRPOConfig, GRPOTrainer)
    cfg = config_cls(model_name_or_path=str(path), mix=spec["mix"], output_dir=str(out / "run"),
                     overwrite_output_dir=True, disable_tqdm=True, max_prompt_length=spec["seq_len"],
                     generation_backend=spec.get("generation_backend") or "posttrain",
                     reward_funcs=["benchmarks.grpo_e2e:length_reward"], **_settings(spec))
    trainer = trainer_cls(cfg, train_rows=rows)
    history = trainer.train()
    steps = [{"step": h["time/step"], **{k.removeprefix("time/"): v for k, v in h.items()
                                          if k.startswith("time/") and k != "time/step"}} for h in history]
    return [{**s, "loss": h["loss"]} for s, h in zip(steps, history)], trainer


def canary(trainer: Any, spec: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The harness's correctness canary on the frozen models (the reference; rows of the run's
    length) after the measured steps, posttrain's roles and TRL's ``ref_model`` alike."""
    from benchmarks import canary as canary_check

    if hasattr(trainer, "session"):
        s = trainer.session
        frozen = {name: (s.engines[name], s.fast_frozen.get(name)) for name in s.roles if not s.role(name).trains}
        device = s.device
    else:  # TRL's trainer
        frozen = {"reference": (trainer.ref_model, None)} if trainer.ref_model is not None else {}
        device = trainer.accelerator.device
    ids = torch.randint(3, len(tiny.load_tokenizer()), (spec["micro_batch"], spec["seq_len"]), device=device)
    try:
        diffs = {name: canary_check.check(engine, ids, fast) for name, (engine, fast) in frozen.items()}
    except Exception as err:  # noqa: BLE001 - reported in the row
        return {"canary_error": f"{type(err).__name__}: {str(err)[:500]}"}
    return {"canary": diffs, "canary_tolerance": canary_check.TOLERANCE[dtype]}


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path) -> tuple[list[dict], Any]:
    """TRL's own trainer under one DeepSpeed config; per step its time (TRL reports no phases)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from posttrain import dsconfig

    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if spec["workload"] == "rloo" else (GRPOConfig, GRPOTrainer)
    ds_config = dsconfig.read_config(TRL_CONFIGS[spec["mix"]])
    steps: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps.append({"step": time.perf_counter() - self.start})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and steps:
                steps[-1]["loss"] = float(logs["loss"])

    cpu = not torch.cuda.is_available()  # CPU tests: gloo, or every rank runs alone as rank 0 of 1
    if cpu:  # DeepSpeed's own group, before zero.Init sizes the ZeRO-3 partitions
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    args = config_cls(output_dir=str(out / "run"), deepspeed=ds_config, report_to=[], save_strategy="no",
                      logging_steps=1, use_cpu=cpu, ddp_backend="gloo" if cpu else None, **_settings(spec))
    trainer = trainer_cls(model=str(path), reward_funcs=[length_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tiny.load_tokenizer(path),
                          callbacks=[StepTimes()])
    trainer.train()
    return steps, trainer


def run(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    path = model_dir(spec["shapes"]["policy"], dtype)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = (spec["warmup"] + spec["steps"]) * spec["micro_batch"] * world // spec.get("num_generations", 8)
    rows = prompt_rows(max(prompts, 1), spec["seq_len"] - spec["response_len"])
    baseline = spec["mix"] in TRL_CONFIGS
    steps, trainer = (run_trl if baseline else run_posttrain)(spec, path, rows, out)
    measured = steps[spec["warmup"]:]
    res: dict[str, Any] = {"setup_s": time.perf_counter() - t0 - sum(s["step"] for s in steps),
                           "step_times": [{k: v for k, v in s.items() if k != "loss"} for s in measured]}
    res["step_s"] = statistics.median(s["step"] for s in measured)
    phases = [k for k in measured[0] if k not in ("step", "loss")]
    res["phase_s"] = {k: statistics.median(s.get(k, 0.0) for s in measured) for k in phases}
    res.update(lower_quartiles(res["step_times"]))
    # Completions of up to response_len tokens after their prompt, per GPU per step.
    res["tokens_per_step"] = spec["micro_batch"] * spec["seq_len"]
    res["losses"] = [s.get("loss", float("nan")) for s in measured]
    res["world_size"] = world
    if not baseline:
        res["rollout"] = trainer.rollout.stats
    res.update(canary(trainer, spec, dtype))
    return res


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out_dir)
    result: dict[str, Any] = {"rank": rank, "status": "ok"}
    try:
        result.update(run(spec, out))
    except BaseException as err:  # noqa: BLE001 - every failure is reported, OOM as such
        result["status"] = "oom" if is_oom(err) else "error"
        result["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if torch.cuda.is_available():
        fold_peak()
        result["peak_allocated_gib"] = PEAK["allocated"]
        result["peak_reserved_gib"] = PEAK["reserved"]
        result["device_total_gib"] = torch.cuda.get_device_properties(0).total_memory / GiB
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    if result["status"] != "ok":
        print(f"rank {rank}: {result['status']}: {result['error'][:300]}", file=sys.stderr, flush=True)
        os._exit(3)
    os._exit(0)  # as workloads.py: skip a teardown where DeepSpeed's and gloo's threads can abort


if __name__ == "__main__":
    main(*sys.argv[1:])
