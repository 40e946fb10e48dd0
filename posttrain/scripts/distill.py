"""``posttrain distill``: knowledge distillation. With no model named, a tiny teacher is trained (once,
cached) on the bundled text and distilled into the tiny student."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.run.hub import push_to_hub
from posttrain.run.modelcard import write_model_card
from posttrain.scripts.args import (
    demo_config,
    parse_config,
    record_script_arguments,
    require_dataset,
    run_script,
)
from posttrain.scripts.data import eval_steps_per_epoch, load_train_eval
from posttrain.scripts.ppo import saved_as
from posttrain.trainers.distill import DistillConfig, DistillTrainer
from posttrain.trainers.multi import MultiConfig, MultiTrainer, Task, text_collate


@dataclass
class TeacherArguments:
    """The built-in tiny teacher and data, used when no teacher_model_name_or_path is given."""

    teacher_shape: dict = field(default_factory=lambda: dict(hidden_size=128, intermediate_size=352,
                                                             num_hidden_layers=4))
    teacher_steps: int = 400
    teacher_learning_rate: float = 3e-3
    teacher_batch_size: int = 16
    heldout_lines: int = 400  # the corpus's last lines; those also in the training lines are dropped
    prompt_words: int = 2  # each line's first words prompt the rest
    test_split_size: float = 0.0  # held out of train (a fraction, or rows if >= 1) without a test split


def split(lines: list[str], prompt_words: int) -> list[dict[str, str]]:
    rows = []
    for words in (line.split() for line in lines):
        rows.append({"prompt": " ".join(words[:prompt_words]), "completion": " " + " ".join(words[prompt_words:])})
    return rows


def tiny_teacher(args: TeacherArguments, lines: list[str], seed: int) -> tuple[Path, dict]:
    """Train (once, cached) a larger tiny LM on ``lines``; returns its path and its loss curve."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(args.teacher_shape.items()))
    path = tiny.cache_dir() / f"distill-teacher-{tag}-n{args.teacher_steps}-lr{args.teacher_learning_rate}-s{seed}"
    done = path / "train_losses.json"
    if done.exists():
        return path, json.loads(done.read_text())
    tok = tiny.load_tokenizer()
    cfg = MultiConfig(output_dir=str(path.parent / f"{path.name}-run"), learning_rate=args.teacher_learning_rate,
                      warmup_steps=args.teacher_steps // 10, max_steps=args.teacher_steps, seed=seed,
                      per_device_train_batch_size=args.teacher_batch_size, overwrite_output_dir=True)
    start = tiny.model_path("causal", seed=seed + 1, **args.teacher_shape)
    trainer = MultiTrainer(cfg, {"teacher": Task(start, lines, text_collate(tok), tokenizer=tok)})
    history = trainer.train()
    trainer.session.save_pretrained("teacher", path, tokenizer=tok)
    losses = {"first": history[0]["teacher/loss"], "last": history[-1]["teacher/loss"]}
    if trainer.session.is_main_process:
        done.write_text(json.dumps(losses))
    trainer.session.accelerator.wait_for_everyone()
    return path, losses


def _check_prompt_completion(dataset: Any, name: str) -> None:
    missing = [c for c in ("prompt", "completion") if c not in dataset.column_names]
    if missing:
        raise ConfigError(f"{name}: no column {missing[0]!r}; distillation needs prompt-completion rows, got "
                          f"columns {dataset.column_names}: rename its columns")


def load_rows(script: ScriptArguments, targs: TeacherArguments, cfg: DistillConfig) -> tuple[list, list | None]:
    """(train, eval) prompt-completion rows: the named dataset's, or the bundled text's lines."""
    if script.dataset_name is not None:
        train, test = load_train_eval(script, targs.test_split_size, cfg, check=_check_prompt_completion)
        return train.to_list(), (test.to_list() if test is not None else None)
    lines = tiny.corpus()
    train_lines = lines[: -targs.heldout_lines]
    seen = set(train_lines)
    heldout = [line for line in lines[-targs.heldout_lines :] if line not in seen]
    eval_rows = split(heldout, targs.prompt_words) if cfg.eval_strategy != "no" else None
    return split(train_lines, targs.prompt_words), eval_rows


def main(argv: list[str] | None = None) -> None:
    script, cfg, targs = parse_config((ScriptArguments, DistillConfig, TeacherArguments), demo_config("distill"),
                                      argv, model_fields=("model_name_or_path", "teacher_model_name_or_path"),
                                      prog="posttrain distill")
    if cfg.teacher_model_name_or_path is None and cfg.model_name_or_path is not None:
        raise ConfigError("distilling into your own student needs a teacher with its vocabulary: set "
                          "--teacher_model_name_or_path (the built-in tiny teacher fits only the tiny student)")
    require_dataset([script, cfg])
    teacher_losses = None
    if cfg.teacher_model_name_or_path is None:
        path, teacher_losses = tiny_teacher(targs, tiny.corpus()[: -targs.heldout_lines], cfg.seed)
        cfg.teacher_model_name_or_path = str(path)
    train_rows, eval_rows = load_rows(script, targs, cfg)
    if eval_rows is not None and cfg.eval_strategy == "epoch":
        cfg.eval_steps = eval_steps_per_epoch(len(train_rows), cfg)
    student = str(tiny.model_path()) if cfg.model_name_or_path is None else None
    trainer = DistillTrainer(cfg, train_rows, eval_rows, model=student)
    before = []
    if eval_rows is not None and not cfg.resume_from_checkpoint:  # the held-out divergence before training
        before = [trainer.evaluate()]
    history = trainer.train()
    final = trainer.save_model()
    if not trainer.session.is_main_process:
        return
    # The card written at the end of training cannot know the data: name it.
    write_model_card(cfg.output_dir, cfg, "distill", trainer.session,
                     dataset_name=script.dataset_name or "lines of posttrain's bundled text")
    record_script_arguments(cfg.output_dir, script, targs)
    evals = before + [h for h in history if "eval/forward_kl" in h]
    summary = {"heldout_lines": len(eval_rows or []), "teacher": cfg.teacher_model_name_or_path,
               "teacher_lm_loss": teacher_losses,
               "placement": {"student": trainer.session.zero_stage("student"),
                             "teacher": trainer.session.zero_stage("teacher")},
               "steps": history[-1]["step"] if history else 0}
    print("\ndistillation summary")
    if teacher_losses:
        print(f"  teacher LM loss on the training text: {teacher_losses['first']:.3f} -> {teacher_losses['last']:.3f}")
    print(f"  student ZeRO-{summary['placement']['student']}, teacher ZeRO-{summary['placement']['teacher']}")
    if len(evals) >= 2:
        before, after = evals[0], evals[-1]
        summary.update({f"{k.split('/')[1]}_before": round(before[k], 4) for k in before if k.startswith("eval/")})
        summary.update({f"{k.split('/')[1]}_after": round(after[k], 4) for k in after if k.startswith("eval/")})
        summary["forward_kl_fall_factor"] = round(before["eval/forward_kl"] / after["eval/forward_kl"], 2)
        for name in ("forward_kl", "reverse_kl", "jsd"):
            print(f"  held-out {name:10s} {before['eval/' + name]:.4f} -> {after['eval/' + name]:.4f} "
                  f"(falls {before['eval/' + name] / after['eval/' + name]:.1f}x)")
    Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"  student {saved_as(cfg)} to {final}; metrics in {cfg.output_dir}/metrics.jsonl")
    if cfg.push_to_hub:
        print(f"pushed to {push_to_hub(cfg, final)}")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
