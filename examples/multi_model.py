"""Two disjoint models train together, each under its own DeepSpeed plugin, optimizer and scheduler:
a causal LM learns the bundled text under ZeRO-2 while a sequence classifier learns synthetic
sentiment under ZeRO-3.

    torchrun --standalone --nproc_per_node 2 examples/multi_model.py --config configs/multi_model.yaml
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/multi_model.py

It reports each model's held-out loss before and after (and the classifier's accuracy). Placement
per model comes from `role_configs` in the YAML.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from posttrain.demo import synthetic, tiny
from posttrain.placement.ranks import mean_over_ranks
from posttrain.scripts.args import demo_config, parse_config, run_script
from posttrain.trainers.multi import MultiConfig, MultiTrainer, Task, text_collate


@dataclass
class TaskArguments:
    lm_model_name_or_path: str | None = None  # None: the tiny causal LM
    classifier_model_name_or_path: str | None = None  # None: the tiny one-logit classifier
    heldout_lines: int = 400
    sentiment_pairs: int = 1024  # each gives a positive and a negative example
    heldout_pairs: int = 128


def sentiment(n: int, seed: int) -> list[tuple[str, float]]:
    """Bundled sentences labelled 1 (positive adjectives) or 0 (negative)."""
    pairs = synthetic.preference_pairs(n, seed=seed)
    return [(p["prompt"] + p[key], label) for p in pairs for key, label in (("chosen", 1.0), ("rejected", 0.0))]


def classification(tok: Any) -> tuple[Callable, Callable]:
    """The classifier's collate (texts and 0/1 labels) and loss (BCE on its one logit)."""
    texts = text_collate(tok, lm_labels=False)

    def collate(items):
        return {**texts([t for t, _ in items]), "labels": torch.tensor([y for _, y in items])}

    def bce(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits.float(), batch["labels"])

    return collate, bce


@torch.no_grad()
def accuracy(trainer: MultiTrainer, items: list[tuple[str, float]]) -> float:
    # Equal shares per rank: the ZeRO-3 classifier gathers its layers collectively.
    s = trainer.session
    share = len(items) // s.num_processes
    mine = items[s.process_index * share : (s.process_index + 1) * share]
    batch = {k: v.to(s.device) for k, v in trainer.tasks["classifier"].collate(mine).items()}
    logits = s.engines["classifier"](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    correct = ((logits.squeeze(-1) > 0).float() == batch["labels"]).float().mean().item()
    return mean_over_ranks(s, {"accuracy": correct})["accuracy"]


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_config((MultiConfig, TaskArguments), demo_config("multi_model"), argv,
                             model_fields=("lm_model_name_or_path", "classifier_model_name_or_path"))
    tok = tiny.load_tokenizer(args.lm_model_name_or_path)
    lines = tiny.corpus()
    train_lines, heldout_lines = lines[: -args.heldout_lines], lines[-args.heldout_lines :]
    heldout_lines = [line for line in heldout_lines if line not in set(train_lines)]
    collate, bce = classification(tok)
    train_sent, heldout_sent = sentiment(args.sentiment_pairs, seed=0), sentiment(args.heldout_pairs, seed=1)
    tasks = {
        "lm": Task(args.lm_model_name_or_path or tiny.model_path(), train_lines, text_collate(tok), tokenizer=tok),
        "classifier": Task(args.classifier_model_name_or_path or tiny.model_path("reward"), train_sent, collate, bce,
                           model_cls=AutoModelForSequenceClassification, tokenizer=tok),
    }
    trainer = MultiTrainer(tasks, args=cfg)
    heldout = {"lm": heldout_lines, "classifier": heldout_sent}
    before = {name: trainer.evaluate(name, items) for name, items in heldout.items()}
    acc_before = accuracy(trainer, heldout_sent)
    trainer.train()
    history = trainer.state.log_history
    after = {name: trainer.evaluate(name, items) for name, items in heldout.items()}
    acc_after = accuracy(trainer, heldout_sent)
    saved = trainer.save_model()  # each model in its own folder: <output_dir>/lm, <output_dir>/classifier
    if trainer.session.is_main_process:
        tenth = max(1, len(history) // 10)
        summary = {"placement": {name: trainer.session.zero_stage(name) for name in tasks}, "steps": len(history)}
        for name in tasks:
            curve = [h[f"{name}/loss"] for h in history]
            summary[name] = {"train_loss_first_tenth": round(sum(curve[:tenth]) / tenth, 4),
                             "train_loss_last_tenth": round(sum(curve[-tenth:]) / tenth, 4),
                             "heldout_loss_before": round(before[name], 4), "heldout_loss_after": round(after[name], 4)}
        summary["classifier"].update(heldout_accuracy_before=round(acc_before, 4), heldout_accuracy_after=round(acc_after, 4))
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print("\nmulti-model summary")
        for name in tasks:
            r = summary[name]
            print(f"  {name:10s} ZeRO-{summary['placement'][name]}  train loss {r['train_loss_first_tenth']:.3f} -> "
                  f"{r['train_loss_last_tenth']:.3f}   held-out loss {r['heldout_loss_before']:.3f} -> "
                  f"{r['heldout_loss_after']:.3f}")
        print(f"  classifier held-out accuracy {acc_before:.3f} -> {acc_after:.3f}")
        print(f"  models saved to {', '.join(str(p) for p in saved.values())}; metrics in {cfg.output_dir}/metrics.jsonl")
    trainer.end()


if __name__ == "__main__":
    raise SystemExit(run_script(main))
