"""One GPU, DPO: TRL's own DPOTrainer against posttrain's, fp32 and bf16 optimizer states (issue 25).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl``: ``trl.DPOTrainer`` on a bf16 model with a bf16 reference, no DeepSpeed, AdamW on the
  bf16 parameters (no fp32 master weights): TRL's strongest single-GPU setting;
- ``posttrain-{auto,ds,torch}-{bf16,fp32}``: posttrain's DPOTrainer, default mix, ``master_weights``
  bf16 or fp32, under ``single_process_engine`` ``auto`` (posttrain's default: for DPO on one GPU
  the torch path at both precisions, posttrain/plain.py: the model and torch's fused AdamW),
  ``deepspeed`` (DeepSpeed's ZeRO-2 engine) or ``torch`` (forced; the same run as auto's here,
  so not a default row). Each row records the ``engine`` that ran.

Both sides: the same random-weight model (Llama 1.1B shape, hidden 2048, 22 layers, built from a
config and saved once, as benchmarks/harness/grpo_e2e.py does), ``--pairs`` preference pairs of
``--seq-len`` tokens each side per step, bf16, gradient checkpointing, learning rate 1e-6, one
optimizer step per batch, a log line every step. Timing, memory and output as benchmarks/races/race.py
says; the summary also has the planner's figures for posttrain's DeepSpeed rows.

    python benchmarks/races/dpo_race.py --out DIR                       # one GPU
    DS_ACCELERATOR=cpu python benchmarks/races/dpo_race.py --shape tiny --steps 2 --warmup 1 --rounds 1   # CPU check
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import GiB, Stamps  # noqa: E402

# The default rows (race.Race runs every side unless --sides names some): TRL, posttrain's default
# (auto) at both precisions, and DeepSpeed's engine at both; the forced torch rows on request.
DEFAULT_SIDES = ("trl", "posttrain-auto-bf16", "posttrain-ds-bf16", "posttrain-auto-fp32", "posttrain-ds-fp32")
SIDES = DEFAULT_SIDES + ("posttrain-torch-bf16", "posttrain-torch-fp32")
ENGINES = {"auto": "auto", "ds": "deepspeed", "torch": "torch"}


def preference_rows(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` pairs whose prompt + completion is longer than ``seq_len`` tokens on either side, so
    that truncation to ``max_length = seq_len`` makes every sequence exactly that long."""
    from benchmarks.harness.bench_models import prompt_rows

    texts = prompt_rows(3 * n, seq_len // 2 + 8)
    return [{"prompt": texts[3 * i]["prompt"], "chosen": texts[3 * i + 1]["prompt"],
             "rejected": texts[3 * i + 2]["prompt"]} for i in range(n)]


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> None:
    from trl import DPOConfig, DPOTrainer

    run_trl_with_reference(spec, path, rows, out, stamps, DPOConfig, DPOTrainer, spec["pairs"])


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
                  engine: str, master_weights: str) -> dict[str, Any]:
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    return run_posttrain_with_reference(spec, path, rows, out, stamps, engine, master_weights, DPOConfig, DPOTrainer,
                                        spec["pairs"])


def run_trl_with_reference(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
                           config_cls: Any, trainer_cls: Any, batch: int) -> None:
    """TRL's trainer of an offline objective with a reference (DPO, KTO): a bf16 model and a bf16 reference, ``batch``
    rows a step (the races' TRL side)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny

    cpu = not torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    args = config_cls(output_dir=str(out / "trl"), per_device_train_batch_size=batch, max_length=spec["seq_len"],
                      learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"], bf16=True,
                      gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                      use_cpu=cpu, disable_tqdm=True, dataloader_num_workers=0)
    trainer = trainer_cls(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tiny.load_tokenizer(path), callbacks=[stamps.callback()])
    stamps.mark()
    trainer.train()


def run_posttrain_with_reference(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
                                 engine: str, master_weights: str, config_cls: Any, trainer_cls: Any,
                                 batch: int) -> dict[str, Any]:
    """posttrain's trainer of that objective (the same settings), under ``single_process_engine`` ``engine`` and
    ``master_weights``; the row's fields."""
    cfg = config_cls(output_dir=str(out / f"posttrain-{engine}-{master_weights}"), overwrite_output_dir=True,
                     per_device_train_batch_size=batch, max_length=spec["seq_len"], learning_rate=1e-6,
                     max_steps=spec["warmup"] + spec["steps"], bf16=True, master_weights=master_weights,
                     gradient_checkpointing=True, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                     single_process_engine=ENGINES[engine])
    trainer = trainer_cls(str(path), args=cfg, train_dataset=rows)
    s = trainer.session
    history = stamps.train(trainer)[spec["warmup"]:]
    return {"placements": {n: s.zero_stage(n) for n in s.roles}, "master_weights": s.master_weights("policy"),
            "engine": s.engine_kind("policy"), "one_rank_changes": s.one_rank_changes,
            "losses": [h["loss"] for h in history], "phase_s": race.phase_medians(history)}


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    """One row, in this process: the side's trainer for warm-up + measured steps."""
    import torch

    from benchmarks.harness.bench_models import model_dir

    path = model_dir(spec["shape"], torch.bfloat16)
    rows = preference_rows(spec["pairs"] * (spec["warmup"] + spec["steps"]), spec["seq_len"])
    if side == "trl":
        run_trl(spec, path, rows, out, stamps)
        return {}
    _, engine, master_weights = side.split("-")
    return run_posttrain(spec, path, rows, out, stamps, engine, master_weights)


def planned(spec: dict[str, Any]) -> dict[str, float]:
    """The planner's per-GPU figures for posttrain's rows, auto (what it plans for DPO: the torch
    path), DeepSpeed (ds) and torch engines (gradient checkpointing on, as run)."""
    from posttrain.planner import memory

    plans = {(eng, mw): memory.plan("dpo", spec["shape"], "zero2-zero3", world_size=1, micro_batch=spec["pairs"],
                                    seq_len=spec["seq_len"], master_weights=mw, gradient_checkpointing=True,
                                    single_process_engine=ENGINES[eng])
             for eng in ENGINES for mw in ("fp32", "bf16")}
    out = {}
    for eng in ENGINES:
        fp32, bf16 = plans[eng, "fp32"], plans[eng, "bf16"]
        out.update({f"planned_peak_{eng}_fp32_gib": fp32.peak / GiB, f"planned_peak_{eng}_bf16_gib": bf16.peak / GiB,
                    f"planned_{eng}_fp32_extra_gib": (fp32.peak - bf16.peak) / GiB})
    return out


RACE = race.Race(name="dpo_race", doc=__doc__, script=__file__, sides=SIDES, default_sides=DEFAULT_SIDES,
                 run_side=run_side, planned=planned,
                 knobs={"pairs": (4, 2, "preference pairs per step"),
                        "seq_len": (512, 64, "tokens per sequence, each side")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
