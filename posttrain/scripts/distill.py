"""``posttrain distill``: knowledge distillation (TRL's script: ScriptArguments, DistillationConfig, ModelConfig).
With no model named, a tiny teacher is trained (once, cached) on the bundled text and distilled into the tiny
student."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig, ScriptArguments

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.scripts.args import (
    demo_config,
    finish,
    model_arguments,
    parse_config,
    record_script_arguments,
    require_dataset,
    run_script,
)
from posttrain.scripts.data import load_train_eval
from posttrain.scripts.ppo import saved_as
from posttrain.trainers.distill import DistillationConfig, DistillationTrainer
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
                      per_device_train_batch_size=args.teacher_batch_size, overwrite_output_dir=True,
                      logging_steps=1, save_strategy="no", disable_tqdm=True)
    start = tiny.model_path("causal", seed=seed + 1, **args.teacher_shape)
    trainer = MultiTrainer({"teacher": Task(start, lines, text_collate(tok), tokenizer=tok)}, args=cfg)
    trainer.train()
    history = trainer.state.log_history
    trainer.session.save_pretrained("teacher", path, tokenizer=tok)
    losses = {"first": history[0]["teacher/loss"], "last": history[-1]["teacher/loss"]}
    if trainer.session.is_main_process:
        done.write_text(json.dumps(losses))
    trainer.session.accelerator.wait_for_everyone()
    return path, losses


def _check_prompt(dataset: Any, name: str) -> None:
    if "prompt" not in dataset.column_names:
        raise ConfigError(f"{name}: no column 'prompt'; distillation needs prompt rows (and a 'completion' where the "
                          f"dataset's completions train: lmbda < 1), got columns {dataset.column_names}: rename its "
                          "columns")


def load_rows(script: ScriptArguments, targs: TeacherArguments, cfg: DistillationConfig) -> tuple[list, list | None]:
    """(train, eval) prompt(-completion) rows: the named dataset's, or the bundled text's lines."""
    if script.dataset_name is not None:
        train, test = load_train_eval(script, targs.test_split_size, cfg, check=_check_prompt)
        return train.to_list(), (test.to_list() if test is not None else None)
    lines = tiny.corpus()
    train_lines = lines[: -targs.heldout_lines]
    seen = set(train_lines)
    heldout = [line for line in lines[-targs.heldout_lines :] if line not in seen]
    eval_rows = split(heldout, targs.prompt_words) if cfg.eval_strategy != "no" else None
    return split(train_lines, targs.prompt_words), eval_rows


def main(argv: list[str] | None = None) -> None:
    script, cfg, model_args, targs = parse_config(
        (ScriptArguments, DistillationConfig, ModelConfig, TeacherArguments), demo_config("distill"), argv,
        model_fields=("model_name_or_path", "teacher_model_name_or_path"), prog="posttrain distill")
    if cfg.teacher_model_name_or_path is None and model_args.model_name_or_path is not None:
        raise ConfigError("distilling into your own student needs a teacher with its vocabulary: set "
                          "--teacher_model_name_or_path (the built-in tiny teacher fits only the tiny student)")
    require_dataset([script, model_args])
    model, peft_config = model_arguments(model_args, cfg, tiny.model_path)
    # The teacher loads as TRL's script loads it: the student's dtype and attention, its own revision.
    teacher_kwargs = {"revision": cfg.teacher_model_revision, "attn_implementation": model_args.attn_implementation,
                      "dtype": model_args.dtype}
    cfg.teacher_model_init_kwargs = {**{k: v for k, v in teacher_kwargs.items() if v is not None},
                                     **(cfg.teacher_model_init_kwargs or {})}
    teacher_losses = None
    if cfg.teacher_model_name_or_path is None:
        path, teacher_losses = tiny_teacher(targs, tiny.corpus()[: -targs.heldout_lines], cfg.seed)
        cfg.teacher_model_name_or_path = str(path)
    train_rows, eval_rows = load_rows(script, targs, cfg)
    trainer = DistillationTrainer(model=model, teacher_model=cfg.teacher_model_name_or_path, args=cfg,
                                  train_dataset=train_rows, eval_dataset=eval_rows, peft_config=peft_config)
    before = []
    if eval_rows is not None and not cfg.resume_from_checkpoint:  # the held-out divergence before training
        before = [trainer.evaluate()]
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    history = trainer.state.log_history
    final = trainer.save_model()
    dataset_name = script.dataset_name or "lines of posttrain's bundled text"
    if trainer.is_world_process_zero():
        record_script_arguments(cfg.output_dir, script, model_args, targs)
        evals = before + [h for h in history if "eval/forward_kl" in h]
        summary = {"heldout_lines": len(eval_rows or []), "teacher": cfg.teacher_model_name_or_path,
                   "teacher_lm_loss": teacher_losses,
                   "placement": {"student": trainer.session.zero_stage("student"),
                                 "teacher": trainer.session.zero_stage("teacher")},
                   "steps": trainer.state.global_step}
        print("\ndistillation summary")
        if teacher_losses:
            print(f"  teacher LM loss on the training text: {teacher_losses['first']:.3f} -> {teacher_losses['last']:.3f}")
        print(f"  student ZeRO-{summary['placement']['student']}, teacher ZeRO-{summary['placement']['teacher']}")
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            summary.update({f"{k.split('/')[1]}_before": round(first[k], 4) for k in first if k.startswith("eval/")})
            summary.update({f"{k.split('/')[1]}_after": round(last[k], 4) for k in last if k.startswith("eval/")})
            summary["forward_kl_fall_factor"] = round(first["eval/forward_kl"] / last["eval/forward_kl"], 2)
            for name in ("forward_kl", "reverse_kl", "jsd"):
                print(f"  held-out {name:10s} {first['eval/' + name]:.4f} -> {last['eval/' + name]:.4f} "
                      f"(falls {first['eval/' + name] / last['eval/' + name]:.1f}x)")
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"  student {saved_as(peft_config, cfg.merge_adapters)} to {final}; metrics in "
              f"{cfg.output_dir}/metrics.jsonl")
    finish(trainer, dataset_name)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
