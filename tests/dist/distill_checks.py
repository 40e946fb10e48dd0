"""Two-process distillation checks, one launch; rank 0 writes the findings as JSON for test_distill.py."""

import json
import sys
from pathlib import Path

from posttrain.demo import tiny
from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

MIXES = ["zero2-zero3", "zero2-replicated", "zero3"]


def rows(lines):
    # "<subject words> <rest>": the first two words prompt the rest.
    return [{"prompt": " ".join(w[:2]), "completion": " " + " ".join(w[2:])} for w in (x.split() for x in lines)]


# The dataset's completions unless a check says otherwise (lmbda 0), GKD's beta 0.5 and dropout off, no
# activation checkpointing, a row logged every step and no checkpoint unless asked.
SETTINGS = dict(max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=2e-3,
                max_completion_length=6, disable_tqdm=True, lmbda=0.0, beta=0.5, disable_dropout=True,
                gradient_checkpointing=False, logging_steps=1, save_steps=None)


def trainer(tmp: Path, name: str, **kw) -> DistillationTrainer:
    lines = tiny.corpus()
    cfg = DistillationConfig(output_dir=str(tmp / name), **{**SETTINGS, **kw})
    return DistillationTrainer(str(tiny.model_path()), str(TEACHER), args=cfg, train_dataset=rows(lines[:64]),
                               eval_dataset=rows(lines[-8:]))


def train(t: DistillationTrainer) -> list[dict]:
    t.train()
    return t.state.log_history


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res = {"losses": {}, "eval": {}}
    for mix in MIXES:
        t = trainer(tmp, mix, mix=mix, beta=0.5, temperature=2.0)
        if mix == "zero2-zero3":
            s = t.session
            student = t.student.module
            res["world"] = s.num_processes
            res["stages"] = [s.zero_stage("student"), s.zero_stage("teacher")]
            res["teacher_local"], res["teacher_full"] = s.numel_at_rest("teacher")
            res["teacher_data_empty"] = s.fast_frozen["teacher"].at_rest()
            res["student_whole"] = all(not hasattr(p, "ds_id") and p.numel() > 0 for p in student.parameters())
        res["eval"][mix] = t.evaluate()
        res["losses"][mix] = losses(train(t))
    # Every source of sequences, with accumulation; then checkpoint at step 2 and resume from it.
    kinds = {"on_policy": dict(lmbda=1.0), "seq_kd": dict(seq_kd=True), "mixed": dict(lmbda=0.5, seq_kd=True)}
    for kind, kw in kinds.items():
        hist = train(trainer(tmp, kind, beta=0.0, gradient_accumulation_steps=2, save_steps=2, max_steps=4, **kw))
        res[kind] = {"losses": losses(hist), "on_policy": [h["on_policy"] for h in hist if "loss" in h],
                     "seq_kd": [h["seq_kd"] for h in hist if "loss" in h],
                     "length": [h["completion_length"] for h in hist if "loss" in h],
                     "epoch": [h["epoch"] for h in hist if "loss" in h],
                     "learning_rate": [h["learning_rate"] for h in hist if "loss" in h]}
    # A ZeRO-3 student generates too (every rank in lock-step, gathering its layers per forward).
    hist = train(trainer(tmp, "zero3_on_policy", mix="zero3", lmbda=1.0, max_steps=2))
    res["zero3_on_policy"] = {"losses": losses(hist), "on_policy": [h["on_policy"] for h in hist if "loss" in h]}
    resumed = trainer(tmp, "resumed", beta=0.0, gradient_accumulation_steps=2, max_steps=4, lmbda=0.5, seq_kd=True,
                      resume_from_checkpoint=str(tmp / "mixed" / "checkpoint-2"))
    hist = train(resumed)
    res["resumed"] = {"losses": losses(hist), "on_policy": [h["on_policy"] for h in hist if "loss" in h]}
    res["student_export"] = sorted(p.name for p in (tmp / "mixed" / "checkpoint-4" / "student").iterdir())
    if resumed.session.is_main_process:
        json.dump(res, open(out, "w"))


# A larger init gives the random teacher sharp, far-from-uniform distributions: divergences of order 1.
TEACHER = tiny.model_path("causal", seed=1, hidden_size=96, intermediate_size=256, initializer_range=0.2)

if __name__ == "__main__":
    main(*sys.argv[1:])
