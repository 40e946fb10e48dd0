"""The training loop every trainer runs: resume, logging, evaluation, checkpoints and closing."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from posttrain.data.order import rank_batches
from posttrain.placement.ranks import mean_over_ranks
from posttrain.run.output_dir import resume_dir, save_checkpoint
from posttrain.run.save import save_trained_model
from posttrain.trainers.config import TrainConfig
from posttrain.trainers.run_log import RunLog

# Values a logged row takes from the window's last step rather than averaging, as TRL.
LATEST = ("grad_norm", "learning_rate", "lr", "epoch", "episode", "num_tokens")


class Trainer:
    """Subclasses set ``name``, ``shown``, ``roles``; build ``cfg``, ``session``, ``total_steps`` in
    ``__init__``; and supply ``training_step(step)`` (step from 1). Other methods have defaults."""

    name: ClassVar[str] = "train"
    shown: ClassVar[tuple[str, ...]] = ("loss",)
    roles: ClassVar[dict[str, list[str]]] = {"trained": ["policy"], "frozen": []}
    evaluates: ClassVar[bool] = False
    cfg: TrainConfig
    session: Any = None
    total_steps: int
    tokenizer: Any = None
    step: int = 0
    history: list[dict]
    run_log: RunLog | None = None

    def training_step(self, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def log_row(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        return mean_over_ranks(self.session, window_mean(rows))

    def has_eval_data(self) -> bool:
        return False

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError(f"{self.name} does not evaluate")

    def checkpoint_models(self) -> dict[str, Any]:
        return {self.roles["trained"][0]: self.tokenizer}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore what a checkpoint holds beyond the engines and the step."""

    def can_checkpoint(self, step: int) -> bool:
        return True

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.session.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def on_log(self, step: int) -> None:
        """Called after a row is logged (GRPO writes its samples then)."""

    @property
    def start(self) -> int:
        """The step this run starts from: the resumed checkpoint's (known before :meth:`train`), else 0."""
        ckpt = resume_dir(self.cfg)
        if ckpt is None:
            return 0
        return int(json.loads((ckpt / "state" / "trainer_state.json").read_text()).get("step", 0))

    def train(self) -> list[dict]:
        """Train to ``total_steps``; returns the logged rows (the whole run's after a resume)."""
        cfg, s = self.cfg, self.session
        self.step = 0
        ckpt = resume_dir(cfg)
        if ckpt is not None:  # engines, optimizers, RNG, counters
            state = s.load_state(ckpt / "state")
            self.step = int(state["step"])
            self.restore(state, ckpt)
        log = self.run_log = RunLog(s, cfg, self.total_steps, self.name, start=self.step, shown=self.shown)
        self.history = log.history
        window: list[dict[str, Any]] = []
        while self.step < self.total_steps:
            # self.step counts the steps done, as TRL's global_step.
            window.append(self.training_step(self.step + 1))
            self.step += 1
            last = self.step == self.total_steps
            if self.step % cfg.logging_steps == 0 or last:
                log.log(self.step, self.log_row(window), advance=False)
                window = []
                self.on_log(self.step)
            log.advance()
            if self.evaluates and self.has_eval_data() and (
                    (cfg.eval_steps and self.step % cfg.eval_steps == 0) or last):
                log.log(self.step, self.evaluate(), advance=False)
            if cfg.save_steps and (self.step % cfg.save_steps == 0 or last) and self.can_checkpoint(self.step):
                save_checkpoint(s, cfg, self.step, self.checkpoint_models(),
                                {"total_steps": self.total_steps, **self.checkpoint_state()})
        log.close()
        return self.history

    def save_model(self, directory: str | os.PathLike | None = None) -> Path:
        """Save the first trained role in the output dir (TRL's layout), others in ``<role>/``; returns it."""
        trained = self.roles["trained"]
        merge = getattr(self.cfg, "merge_adapters", False)
        path = save_trained_model(self.session, trained[0], directory or self.cfg.output_dir, self.tokenizer, merge)
        for role in trained[1:]:
            save_trained_model(self.session, role, path / role, self.tokenizer, merge)
        return path


def collated_batches(trainer: Any, start_micro: int) -> Iterator[dict]:
    """This process's collated micro-batches of ``trainer.train_rows``, from ``start_micro`` on."""
    cfg, s = trainer.cfg, trainer.session
    for idx in rank_batches(len(trainer.train_rows), cfg.per_device_train_batch_size, cfg.seed,
                            s.process_index, s.num_processes, start=start_micro):
        yield trainer.collate([trainer.train_rows[i] for i in idx])


def eval_shards(session: Any, n: int, batch_size: int) -> Iterator[list[int]]:
    """This process's ``range(n)`` share in batches, the same count on every process (ZeRO-3 collectives)."""
    mine = list(range(session.process_index, n, session.num_processes))
    for j in range(math.ceil(math.ceil(n / session.num_processes) / batch_size)):
        yield mine[j * batch_size : (j + 1) * batch_size]


class RowsTrainer(Trainer):
    """A trainer stepping over prepared rows (SFT, reward). A subclass sets ``train_rows``,
    ``eval_rows``, ``collate``, ``phases`` and ``num_tokens`` and supplies ``optimizer_step``."""

    _batches: Any = None

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        raise NotImplementedError

    def training_step(self, step: int) -> dict[str, Any]:
        cfg, s, ga = self.cfg, self.session, self.cfg.gradient_accumulation_steps
        role = self.roles["trained"][0]
        if self._batches is None:
            self._batches = collated_batches(self, (step - 1) * ga)
        row = self.optimizer_step([next(self._batches) for _ in range(ga)])
        row.update({"grad_norm": s.grad_norm(role) or 0.0, "learning_rate": s.learning_rate(role),
                    "epoch": step * ga * cfg.per_device_train_batch_size * s.num_processes / len(self.train_rows),
                    **self.phases.pop()})
        return row

    def has_eval_data(self) -> bool:
        return self.eval_rows is not None

    def checkpoint_state(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.num_tokens = int(state.get("num_tokens", 0))


def window_mean(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each value's mean over the window (a step without it counts 0); ``LATEST`` ones from its last."""
    keys = dict.fromkeys(k for r in rows for k in r)
    out = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    out.update({k: rows[-1][k] for k in LATEST if k in rows[-1]})
    return out
