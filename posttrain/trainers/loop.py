"""The one training loop every trainer runs: resume, the logging cadence, evaluation, checkpoints,
progress, trackers, metrics.jsonl, Ctrl-C and closing. A trainer subclasses :class:`Trainer` and
supplies its step (:meth:`Trainer.training_step`), optionally its evaluation
(:meth:`Trainer.evaluate`) and how a logging window of steps becomes one row."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from posttrain.data.order import rank_batches
from posttrain.placement.ranks import mean_over_ranks
from posttrain.run.output_dir import resume_dir, save_checkpoint
from posttrain.run.save import save_trained_model
from posttrain.trainers.config import TrainConfig
from posttrain.trainers.run_log import RunLog

# Values a logged row takes from the window's last step rather than averaging (TRL logs the
# latest rate, epoch and gradient norm at a logging step).
LATEST = ("grad_norm", "learning_rate", "lr", "epoch", "episode", "num_tokens")


class Trainer:
    """The loop's side of a trainer.

    A subclass sets ``name`` (the run's name in progress lines and the model card), ``shown`` (the
    metrics the progress bar shows) and ``roles`` (its trained and frozen roles, and under
    "decoded" the trained roles its rollout engine decodes from in every run; read by the memory
    planner and passed to ``make_session``), and builds its models in ``__init__``, as TRL's trainers
    do: a constructed trainer holds ``self.cfg``, ``self.session`` (its engines prepared) and
    ``self.total_steps``. It supplies:

    - ``training_step(step)``: one optimizer step (step counts from 1); returns this rank's values
      of the step (the ones the step used);
    - ``log_row(rows)``: the logged row of a logging window's steps (default: each value's mean
      over the window, ``LATEST`` values from its last step, then the mean over ranks);
    - ``evaluate()`` (if ``evaluates``) and ``has_eval_data()``;
    - ``checkpoint_models()`` (role -> tokenizer saved in each checkpoint),
      ``checkpoint_state()`` and ``restore(state, checkpoint)`` for what else resuming needs.
    """

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

    # -- what a trainer supplies ---------------------------------------------------------------
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
        """What a checkpoint holds beyond the engines (the step is restored by the loop)."""

    def can_checkpoint(self, step: int) -> bool:
        return True

    def on_log(self, step: int) -> None:
        """Called after a row is logged (GRPO writes its samples then)."""

    # -- the loop ------------------------------------------------------------------------------
    @property
    def start(self) -> int:
        """The step this run starts from: the checkpoint's when resuming (read from its trainer
        state, so known before :meth:`train` loads it), else 0."""
        ckpt = resume_dir(self.cfg)
        if ckpt is None:
            return 0
        return int(json.loads((ckpt / "state" / "trainer_state.json").read_text()).get("step", 0))

    def train(self) -> list[dict]:
        """Train to ``total_steps``; returns the logged rows (the whole run's after a resume)."""
        cfg, s = self.cfg, self.session
        self.step = 0
        ckpt = resume_dir(cfg)
        if ckpt is not None:  # the one place a run resumes: engines, optimizers, RNG, counters
            state = s.load_state(ckpt / "state")
            self.step = int(state["step"])
            self.restore(state, ckpt)
        log = self.run_log = RunLog(s, cfg, self.total_steps, self.name, start=self.step, shown=self.shown)
        self.history = log.history
        window: list[dict[str, Any]] = []
        while self.step < self.total_steps:
            # self.step counts the steps done, as TRL's global_step: during a step, the ones before it.
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
        """The first trained role in Hugging Face format, in the output dir itself by default (TRL's
        layout: ``from_pretrained(output_dir)`` loads it), every other trained role in ``<role>/``
        beside it; returns the first one's folder."""
        trained = self.roles["trained"]
        merge = getattr(self.cfg, "merge_adapters", False)  # LoRA roles: the merged model instead of the adapter
        path = save_trained_model(self.session, trained[0], directory or self.cfg.output_dir, self.tokenizer, merge)
        for role in trained[1:]:
            save_trained_model(self.session, role, path / role, self.tokenizer, merge)
        return path


def collated_batches(trainer: Any, start_micro: int) -> Iterator[dict]:
    """This process's micro-batches of ``trainer.train_rows`` in the data order of
    :func:`~posttrain.data.order.rank_batches`, from micro-batch ``start_micro`` on, collated by ``trainer.collate``
    (DPO, SFT, reward)."""
    cfg, s = trainer.cfg, trainer.session
    for idx in rank_batches(len(trainer.train_rows), cfg.per_device_train_batch_size, cfg.seed,
                            s.process_index, s.num_processes, start=start_micro):
        yield trainer.collate([trainer.train_rows[i] for i in idx])


def eval_shards(session: Any, n: int, batch_size: int) -> Iterator[list[int]]:
    """This process's share of ``range(n)`` (every ``num_processes``-th index) in batches of up to
    ``batch_size``. Every process gets the same number of batches, as ZeRO-3 forwards are
    collective: one out of indices gets empty batches, and still runs a forward on some row that
    it does not count (SFT, reward)."""
    mine = list(range(session.process_index, n, session.num_processes))
    for j in range(math.ceil(math.ceil(n / session.num_processes) / batch_size)):
        yield mine[j * batch_size : (j + 1) * batch_size]


class RowsTrainer(Trainer):
    """A trainer whose step is one optimizer step over prepared rows (SFT, reward): the data order
    of :func:`~posttrain.data.order.rank_batches`, the micro-batches collated by ``self.collate``, and a running
    ``num_tokens`` kept in checkpoints. A subclass sets ``train_rows``, ``eval_rows``, ``collate``,
    ``phases`` and ``num_tokens`` and supplies ``optimizer_step(micro_batches)``."""

    _batches: Any = None

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        raise NotImplementedError

    def training_step(self, step: int) -> dict[str, Any]:
        """The next accumulation micro-batches of the data order (from the resumed step's on), one
        optimizer step, and the values the step used."""
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
    """A logging window's row: each value's mean over the window's steps (a step without it counts
    0, as a phase that ran only in some steps), ``LATEST`` values from the last step."""
    keys = dict.fromkeys(k for r in rows for k in r)
    out = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    out.update({k: rows[-1][k] for k in LATEST if k in rows[-1]})
    return out
