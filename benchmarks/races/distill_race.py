"""One GPU, distillation: TRL's GKDTrainer against posttrain's DistillationTrainer (issue 25).

The rows of benchmarks/races/dpo_race.py (alternating fresh processes, ``--rounds`` times, through
benchmarks/races/race.py), for a step that is all training: a 1.1B student learns a 1.1B teacher's token
distributions on the data's completions (generalized JSD, beta 0.5, temperature 1, no generation:
GKD's ``lmbda`` 0 and ``seq_kd`` off; TRL's DistillationTrainer always generates, so it is not the
comparison for this step).

- ``trl``: ``trl.experimental.gkd.GKDTrainer`` on a bf16 student and teacher, no DeepSpeed, AdamW on
  the bf16 parameters (rows as two-message conversations under a template that only concatenates);
- ``posttrain-{auto,ds,torch}-{bf16,fp32}``: posttrain's DistillationTrainer, default mix (the
  teacher replicated on one process), ``master_weights`` bf16 or fp32, the student under
  ``single_process_engine`` ``auto`` (posttrain's default: with ``lmbda`` 0 the student is never
  decoded, so the torch path at both precisions), ``deepspeed`` (ZeRO-2) or ``torch`` (forced, the
  same run as auto's here: not a default row). Each row records the ``engine`` that ran.

Both: random-weight Llama-shape models (student seed 0, teacher seed 1), ``--pairs`` rows of
``--seq-len`` tokens (half prompt, half completion) per step, bf16, no gradient checkpointing, dropout
off (GKD's default; set on posttrain's, whose defaults are TRL's DistillationTrainer's), learning rate 1e-6,
a log line every step.

    python benchmarks/races/distill_race.py --out DIR      # one GPU
    DS_ACCELERATOR=cpu python benchmarks/races/distill_race.py --shape tiny --steps 1 --warmup 1 --rounds 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import dpo_race, race  # noqa: E402
from benchmarks.races.race import Stamps  # noqa: E402

SIDES = dpo_race.SIDES
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def teacher_dir(shape: str, dtype: Any) -> Path:
    """The teacher: the student's shape with other random weights (seed 1), saved once."""
    import torch
    from filelock import FileLock

    from benchmarks.harness.bench_models import model_dir
    from posttrain.demo import tiny
    from posttrain.planner import memory, shapes

    student = model_dir(shape, dtype)
    path = student.with_name(student.name + "-teacher")
    with FileLock(str(path) + ".lock"):
        if not (path / "config.json").exists():
            torch.manual_seed(1)
            cfg = memory.model_config(shape)
            cfg.eos_token_id = tiny.load_tokenizer().eos_token_id
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = shapes.model_class("causal").from_config(cfg, dtype=dtype)
            model.save_pretrained(str(path))
            del model
            tiny.load_tokenizer().save_pretrained(str(path))
    return path


def distill_rows(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` rows whose prompt and completion are each longer than half of ``seq_len`` tokens."""
    from benchmarks.harness.bench_models import prompt_rows

    texts = prompt_rows(2 * n, seq_len // 2 + 8)
    return [{"prompt": texts[2 * i]["prompt"], "completion": " " + texts[2 * i + 1]["prompt"]} for i in range(n)]


def run_trl(spec: dict, student: Path, teacher: Path, rows: list[dict], out: Path, stamps: Stamps) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from posttrain.demo import tiny

    tok = tiny.load_tokenizer(student)
    tok.chat_template = TEMPLATE  # the row's text as it is: prompt + completion
    data = Dataset.from_list([{"messages": [{"role": "user", "content": r["prompt"]},
                                            {"role": "assistant", "content": r["completion"]}]} for r in rows])
    args = GKDConfig(output_dir=str(out / "trl"), per_device_train_batch_size=spec["pairs"], max_length=spec["seq_len"],
                     learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"], bf16=True, lmbda=0.0, beta=0.5,
                     seq_kd=False, temperature=1.0, gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                     report_to=[], seed=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                     dataloader_num_workers=0)
    trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.bfloat16),
                         teacher_model=AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.bfloat16),
                         args=args, train_dataset=data, processing_class=tok, callbacks=[stamps.callback()])
    stamps.mark()
    trainer.train()


def run_posttrain(spec: dict, student: Path, teacher: Path, rows: list[dict], out: Path, stamps: Stamps,
                  engine: str, master_weights: str) -> dict[str, Any]:
    from posttrain.placement.session import Session
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    stamps.wrap_session(Session)  # patched on the class: the trainer makes its session in __init__
    cfg = DistillationConfig(output_dir=str(out / f"posttrain-{engine}-{master_weights}"), overwrite_output_dir=True,
                             per_device_train_batch_size=spec["pairs"], max_length=spec["seq_len"],
                             learning_rate=1e-6, max_steps=spec["warmup"] + spec["steps"], bf16=True,
                             master_weights=master_weights, single_process_engine=dpo_race.ENGINES[engine],
                             lmbda=0.0, beta=0.5, disable_dropout=True, gradient_checkpointing=False,
                             logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = DistillationTrainer(str(student), str(teacher), args=cfg, train_dataset=rows)
    stamps.mark()
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h][spec["warmup"]:]
    s = trainer.session
    return {"placements": {n: s.zero_stage(n) for n in s.roles}, "master_weights": s.master_weights("student"),
            "engine": s.engine_kind("student"), "one_rank_changes": s.one_rank_changes,
            "losses": [h["loss"] for h in history], "phase_s": race.phase_medians(history)}


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import model_dir

    student, teacher = model_dir(spec["shape"], torch.bfloat16), teacher_dir(spec["shape"], torch.bfloat16)
    rows = distill_rows(spec["pairs"] * (spec["warmup"] + spec["steps"]), spec["seq_len"])
    if side == "trl":
        run_trl(spec, student, teacher, rows, out, stamps)
        return {}
    _, engine, master_weights = side.split("-")
    return run_posttrain(spec, student, teacher, rows, out, stamps, engine, master_weights)


RACE = race.Race(name="distill_race", doc=__doc__, script=__file__, sides=SIDES,
                 default_sides=dpo_race.DEFAULT_SIDES, run_side=run_side,
                 knobs={"pairs": (4, 2, "rows per step"), "seq_len": (512, 64, "tokens per row (half prompt)")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
