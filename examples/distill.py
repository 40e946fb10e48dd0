"""Knowledge distillation: the student trains under ZeRO-2 while the teacher is sharded with ZeRO-3.

    torchrun --standalone --nproc_per_node 2 examples/distill.py --config configs/distill.yaml
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/distill.py

With no teacher given it first trains a tiny teacher (a wider, deeper tiny Llama) on the bundled text
and caches it; then the tiny student, from random weights, learns from it. It reports the
student-teacher divergence on held-out lines before and after, and the factor it fell by. A real
run names both models (`--model_name_or_path`, `--teacher_model_name_or_path`; one vocabulary).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import tiny
from posttrain.trainers.common import parse_config
from posttrain.trainers.distill import DistillConfig, DistillTrainer
from posttrain.trainers.multi import MultiConfig, MultiTrainer, Task, text_collate

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "distill.yaml"


@dataclass
class TeacherArguments:
    """The built-in tiny teacher, used when no teacher_model_name_or_path is given."""

    teacher_shape: dict = field(default_factory=lambda: dict(hidden_size=128, intermediate_size=352,
                                                             num_hidden_layers=4))
    teacher_steps: int = 400
    teacher_learning_rate: float = 3e-3
    teacher_batch_size: int = 16
    heldout_lines: int = 400  # the corpus's last lines; those also in the training lines are dropped
    prompt_words: int = 2  # each line's first words prompt the rest


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
                      per_device_train_batch_size=args.teacher_batch_size)
    start = tiny.model_path("causal", seed=seed + 1, **args.teacher_shape)
    trainer = MultiTrainer(cfg, {"teacher": Task(start, lines, text_collate(tok), tokenizer=tok)})
    history = trainer.train()
    trainer.session.save_pretrained("teacher", path, tokenizer=tok)
    losses = {"first": history[0]["teacher/loss"], "last": history[-1]["teacher/loss"]}
    if trainer.session.is_main_process:
        done.write_text(json.dumps(losses))
    trainer.session.accelerator.wait_for_everyone()
    return path, losses


def main() -> None:
    cfg, targs = parse_config((DistillConfig, TeacherArguments), DEFAULT_CONFIG)
    lines = tiny.corpus()
    train_lines = lines[: -targs.heldout_lines]
    seen = set(train_lines)
    heldout = [line for line in lines[-targs.heldout_lines :] if line not in seen]
    teacher_losses = None
    if cfg.teacher_model_name_or_path is None:
        path, teacher_losses = tiny_teacher(targs, train_lines, cfg.seed)
        cfg.teacher_model_name_or_path = str(path)
    trainer = DistillTrainer(cfg, split(train_lines, targs.prompt_words), split(heldout, targs.prompt_words))
    history = trainer.train()
    trainer.save_model()
    if trainer.session.is_main_process:
        evals = [h for h in history if "eval/forward_kl" in h]
        before, after = evals[0], evals[-1]
        summary = {
            "heldout_lines": len(heldout),
            "teacher": cfg.teacher_model_name_or_path,
            "teacher_lm_loss": teacher_losses,
            "placement": {"student": trainer.session.zero_stage("student"),
                          "teacher": trainer.session.zero_stage("teacher")},
            **{f"{k.split('/')[1]}_before": round(before[k], 4) for k in before if k.startswith("eval/")},
            **{f"{k.split('/')[1]}_after": round(after[k], 4) for k in after if k.startswith("eval/")},
            "forward_kl_fall_factor": round(before["eval/forward_kl"] / after["eval/forward_kl"], 2),
            "steps": after["step"],
        }
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print("\ndistillation summary")
        if teacher_losses:
            print(f"  teacher LM loss on the training text: {teacher_losses['first']:.3f} -> {teacher_losses['last']:.3f}")
        print(f"  student ZeRO-{summary['placement']['student']}, teacher ZeRO-{summary['placement']['teacher']}")
        for name in ("forward_kl", "reverse_kl", "jsd"):
            print(f"  held-out {name:10s} {before['eval/' + name]:.4f} -> {after['eval/' + name]:.4f} "
                  f"(falls {before['eval/' + name] / after['eval/' + name]:.1f}x)")
        print(f"  student saved to {cfg.output_dir}/student; metrics in {cfg.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
