"""Disjoint multi-model training: independent models, each under its own plugin, in one loop."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain.data.order import rank_batches, seed_everything
from posttrain.errors import ConfigError
from posttrain.models.setup import prepare_trained
from posttrain.placement.ranks import mean_over_ranks, world_size
from posttrain.run.save import save_trained_model
from posttrain.trainers.config import TrainConfig, make_session
from posttrain.trainers.loop import Trainer, window_mean
from posttrain.trainers.run_log import Phases


def model_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss a Hugging Face model computes itself when the batch carries ``labels``."""
    return model(**batch).loss


def text_collate(tokenizer: Any, max_length: int = 128, lm_labels: bool = True) -> Callable[[list[str]], dict]:
    """A collate for texts: right-padded ids and mask, and (``lm_labels``) labels without padding."""

    def collate(texts: list[str]) -> dict[str, torch.Tensor]:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True, max_length=max_length)
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if lm_labels:
            batch["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return batch

    return collate


@dataclass
class Task:
    """One model of a multi-model run: a path (loaded under its role's plugin) or an ``nn.Module``,
    its ``data``, a ``collate`` of items into tensors and ``loss(model, batch)``."""

    model: str | os.PathLike | torch.nn.Module
    data: Sequence[Any]
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] = model_loss
    model_cls: Any = None  # for a path: e.g. AutoModelForSequenceClassification (default: causal LM)
    tokenizer: Any = None  # saved beside the model in checkpoints


@dataclass
class MultiConfig(TrainConfig, TrainingArguments):
    """``transformers.TrainingArguments`` (TRL has no multi-model trainer) plus posttrain's placement fields and
    per-model learning rates; ``role_configs`` places each model (default: ``mix``'s training config)."""

    # TRL's configs' defaults over TrainingArguments', as posttrain's other trainers have them.
    logging_steps: float = 10
    bf16: bool | None = None
    learning_rates: dict[str, float] = field(default_factory=dict)  # per model; default learning_rate

    _algorithm = "multi-model training"
    _evaluates = False  # the script calls MultiTrainer.evaluate(name, items), not the loop
    _epochs = False


class MultiTrainer(Trainer):
    """Train every task's model in one loop; each model is a trained role named like its task. ``args``: a
    ``MultiConfig`` (its defaults when None), ``callbacks``: transformers ``TrainerCallback``s."""

    name = "multi"
    roles = {"trained": [], "frozen": []}  # one trained role per task, named like it

    def __init__(self, tasks: dict[str, Task], args: MultiConfig | None = None, callbacks: list | None = None) -> None:
        if not tasks:
            raise ConfigError("multi-model training needs at least one task")
        self.cfg = cfg = args if args is not None else MultiConfig()
        unknown = set(cfg.learning_rates) - set(tasks)
        if unknown:
            raise ConfigError(f"learning_rates names unknown model(s) {sorted(unknown)}: the models are {list(tasks)}")
        self.tasks = tasks
        self.roles = {"trained": list(tasks), "frozen": []}
        seed_everything(cfg.seed)
        self.total_steps = self.count_steps()
        s = self.session = make_session(cfg, list(tasks), [], total_steps=self.total_steps)
        for name, task in tasks.items():
            model = task.model if isinstance(task.model, torch.nn.Module) else s.load(name, task.model,
                                                                                      model_cls=task.model_cls)
            prepare_trained(s, name, model, cfg, None, total_steps=self.total_steps,
                            learning_rate=cfg.learning_rates.get(name))
        self.phases = Phases()
        self.batches: dict[str, Iterator[list[int]]] | None = None  # each model's data order
        self._finish_init(callbacks)

    def count_steps(self) -> int:
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        per_step = cfg.per_device_train_batch_size * world_size() * cfg.gradient_accumulation_steps
        longest = max(len(t.data) for t in self.tasks.values())
        return max(1, math.ceil(cfg.num_train_epochs * longest / per_step))

    def _batch(self, name: str, items: list[Any]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.session.device) for k, v in self.tasks[name].collate(items).items()}

    def _data_order(self, start_step: int) -> dict[str, Iterator[list[int]]]:
        s, cfg = self.session, self.cfg
        return {name: rank_batches(len(task.data), cfg.per_device_train_batch_size, cfg.seed + i, s.process_index,
                                   s.num_processes, start=start_step * cfg.gradient_accumulation_steps)
                for i, (name, task) in enumerate(self.tasks.items())}

    def train_step(self, name: str) -> dict[str, float]:
        """One optimizer step of model ``name`` (its accumulation micro-batches); no other model moves."""
        s, cfg, task = self.session, self.cfg, self.tasks[name]
        if self.batches is None:
            self.batches = self._data_order(self.step)
        engine = s.engines[name]
        losses = []
        for _ in range(cfg.gradient_accumulation_steps):
            batch = self._batch(name, [task.data[i] for i in next(self.batches[name])])
            loss = task.loss(engine, batch)
            s.backward(name, loss)
            s.step(name)
            losses.append(loss.item())
        return {f"{name}/loss": sum(losses) / len(losses)}

    def training_step(self, step: int) -> dict[str, float]:
        """Every model's optimizer step, one after the other."""
        s, cfg = self.session, self.cfg
        metrics: dict[str, float] = {}
        for name in self.tasks:
            with self.phases(name):
                metrics.update(self.train_step(name))
        for name in self.tasks:
            metrics[f"{name}/grad_norm"] = s.grad_norm(name) or 0.0
            metrics[f"{name}/learning_rate"] = s.learning_rate(name)
            seen = step * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * s.num_processes
            metrics[f"{name}/epoch"] = seen / len(self.tasks[name].data)  # each model reads its own data
        return {**metrics, **self.phases.pop()}

    def log_row(self, rows: list[dict[str, float]]) -> dict[str, float]:
        row = window_mean(rows)
        for name in self.tasks:  # each model's latest rate, norm and epoch
            row.update({k: rows[-1][k] for k in (f"{name}/grad_norm", f"{name}/learning_rate", f"{name}/epoch")})
        return mean_over_ranks(self.session, row)

    def checkpoint_models(self) -> dict[str, Any]:
        return {name: task.tokenizer for name, task in self.tasks.items()}

    def save_model(self, directory: str | os.PathLike | None = None) -> dict[str, Path]:
        """Save every model in its own folder, ``<output_dir>/<name>/``; returns name -> folder."""
        root = Path(directory or self.cfg.output_dir)
        return {name: save_trained_model(self.session, name, root / name, tokenizer=task.tokenizer)
                for name, task in self.tasks.items()}

    @torch.no_grad()
    def evaluate(self, name: str, items: Sequence[Any]) -> float:
        """Mean loss of model ``name`` over ``items``, split evenly over ranks (ZeRO-3 is collective)."""
        s, task = self.session, self.tasks[name]
        per_rank = len(items) // s.num_processes
        if per_rank == 0:
            raise ConfigError(f"evaluation needs at least {s.num_processes} items, one per process")
        mine = [items[i] for i in range(s.process_index * per_rank, (s.process_index + 1) * per_rank)]
        engine, size = s.engines[name], self.cfg.per_device_eval_batch_size
        engine.eval()
        total = 0.0
        for i in range(0, per_rank, size):
            chunk = mine[i : i + size]
            total += task.loss(engine, self._batch(name, chunk)).item() * len(chunk)
        engine.train()
        return mean_over_ranks(s, {"loss": total / per_rank})["loss"]
