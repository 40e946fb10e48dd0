"""The training loop every trainer runs: resume, logging, evaluation, checkpoints and closing."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from accelerate.utils.memory import clear_device_cache

from posttrain.errors import ConfigError
from posttrain.models import packing
from posttrain.placement.ranks import mean_over_ranks
from posttrain.run import interrupt
from posttrain.run.output_dir import check_resume, claim_output_dir, resume_dir, save_checkpoint
from posttrain.run.preemption import JitCheckpoint
from posttrain.run.save import save_trained_model
from posttrain.trainers.config import TrainConfig, saves
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

    def _finish_init(self, callbacks: list[Any] | None) -> None:
        """The end of a trainer's ``__init__``: the trained model's tags (as TRL adds its own: a peft save keeps
        them in the card), transformers' callback handler and state, as TRL's trainers keep them."""
        from transformers.trainer_callback import (
            CallbackHandler,
            DefaultFlowCallback,
            TrainerControl,
            TrainerState,
        )

        model = self.session.unwrap(self.roles["trained"][0])
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if hasattr(base, "add_model_tags"):
            base.add_model_tags(["posttrain", self.name])

        handlers = [DefaultFlowCallback, *(callbacks or [])]
        self.callback_handler = CallbackHandler(handlers, getattr(self, "model", None), self.tokenizer, None, None)
        self.state = TrainerState(is_local_process_zero=self.session.accelerator.is_local_main_process,
                                  is_world_process_zero=self.session.is_main_process, max_steps=self.total_steps,
                                  logging_steps=self.cfg.logging_steps, eval_steps=self.cfg.eval_steps or 0,
                                  save_steps=self.cfg.save_steps or 0,
                                  train_batch_size=self.cfg.per_device_train_batch_size)
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(self.cfg, self.state, self.control)

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def _event(self, event: str, **kwargs: Any) -> None:
        self.state.global_step = self.step
        self.control = getattr(self.callback_handler, event)(self.cfg, self.state, self.control, **kwargs)

    @property
    def history(self) -> list[dict]:
        """The logged rows: ``state.log_history``."""
        return self.state.log_history

    @property
    def accelerator(self) -> Any:
        return self.session.accelerator

    @property
    def processing_class(self) -> Any:
        return self.tokenizer

    @property
    def args(self) -> TrainConfig:
        return self.cfg

    def is_world_process_zero(self) -> bool:
        return self.session.is_main_process

    def evaluates_after(self, step: int, last: bool | None = None) -> bool:
        """Whether an evaluation follows optimizer step ``step``: TRL's eval_strategy, and posttrain's at the last
        step ("epoch": every epoch's steps)."""
        cfg = self.cfg
        if not (self.evaluates and self.has_eval_data() and cfg.eval_strategy != "no"):
            return False
        last = step == self.total_steps if last is None else last
        return bool(cfg.eval_steps and step % cfg.eval_steps == 0) or last

    def saves_after(self, step: int, last: bool | None = None) -> bool:
        """Whether a checkpoint is due after optimizer step ``step`` (``save_steps`` and the last step)."""
        last = step == self.total_steps if last is None else last
        return saves(self.cfg) and (step % self.cfg.save_steps == 0 or last)

    def generation_loop(self) -> Any:
        """What a generation rank (``generation_processes``) runs instead of training; trainers with such ranks
        define it."""
        raise ConfigError(f"{type(self).__name__} has no generation ranks: set generation_processes 0")

    def training_ended(self) -> None:
        """After the last step, on every training rank (a trainer with generation ranks ends their loop here)."""

    def checkpoint_rank_state(self, directory: Path, rank: int) -> None:
        """Write what this rank alone holds into a checkpoint's ``state/`` (nothing by default)."""

    def restore_rank_state(self, directory: Path, rank: int) -> None:
        """Read what :meth:`checkpoint_rank_state` wrote (nothing by default)."""

    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Train to ``total_steps`` (or until a callback stops it); returns transformers' ``TrainOutput``.
        The logged rows are ``state.log_history`` (the whole run's after a resume)."""
        from transformers.trainer_utils import TrainOutput

        cfg, s = self.cfg, self.session
        if getattr(s, "generates", False):  # this rank only generates (generation_processes): its own loop
            return self.generation_loop()
        if not hasattr(self, "state"):
            self._finish_init(None)
        if resume_from_checkpoint not in (None, False):
            wanted = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            if wanted != cfg.resume_from_checkpoint and self.start == 0:
                raise ConfigError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}) differs from the config's "
                                  f"resume_from_checkpoint {cfg.resume_from_checkpoint!r}: set it in the config "
                                  "(args.resume_from_checkpoint), which the trainer reads before it loads anything")
        role = self.roles["trained"][0]
        check_resume(cfg, self.name, model_config=getattr(s.unwrap(role), "config", None),
                     uses_peft=getattr(self, "peft_config", None) is not None, role=role, num_processes=s.num_processes)
        claim_output_dir(cfg)  # every model loaded: only now is a previous run cleared
        self.step = 0
        ckpt = resume_dir(cfg)
        if ckpt is not None:  # engines, optimizers, RNG, counters
            state = s.load_state(ckpt / "state")
            self.step = int(state["step"])
            self.restore(state, ckpt)
            self.restore_rank_state(ckpt / "state", s.process_index)
        log = self.run_log = RunLog(s, cfg, self.total_steps, self.name, start=self.step, shown=self.shown,
                                    card=self.card_info())
        self.state.log_history = log.history
        started, first, losses = time.perf_counter(), self.step, []
        self._event("on_train_begin")
        if cfg.eval_on_start:  # transformers' field: the metrics before this run's first step
            self._evaluate_and_log(log)
        with JitCheckpoint() if cfg.enable_jit_checkpoint else nullcontext() as jit:
            self._train_steps(log, losses, jit)
        log.close()
        self.training_ended()
        self._event("on_train_end")
        runtime = time.perf_counter() - started
        losses = [v for v in losses if v is not None]
        train_loss = sum(losses) / len(losses) if losses else 0.0
        metrics = {"train_runtime": runtime, "train_steps_per_second": (self.step - first) / max(runtime, 1e-9),
                   "train_loss": train_loss, "epoch": self.state.epoch}
        return TrainOutput(self.step, train_loss, metrics)

    def _train_steps(self, log: RunLog, losses: list[Any], jit: JitCheckpoint | None) -> None:
        """Optimizer steps to ``total_steps`` (or a callback's stop): logging, evaluation and checkpoints as the
        config says; ``jit``: after a SIGTERM, a checkpoint at the first step that can take one, then stop."""
        cfg, s = self.cfg, self.session
        fallbacks = packing.fallbacks()
        window: list[dict[str, Any]] = []
        while self.step < self.total_steps:
            if cfg.torch_empty_cache_steps and self.step % cfg.torch_empty_cache_steps == 0:
                clear_device_cache()  # accelerate's, which transformers' Trainer calls every N steps
            self._event("on_step_begin")
            # self.step counts the steps done, as TRL's global_step.
            window.append(self.training_step(self.step + 1))
            losses.append(window[-1].get("loss"))
            self.step += 1
            self.state.epoch = window[-1].get("epoch", self.state.epoch)
            self._event("on_step_end")
            last = self.step == self.total_steps or self.control.should_training_stop
            if self.step % cfg.logging_steps == 0 or last or (self.step == 1 and cfg.logging_first_step):
                row = self.log_row(window)
                if packing.fallbacks() > fallbacks:  # a padding_free forward ran padded: shown, never silent
                    row["train/padding_free_fallbacks"] = float(packing.fallbacks() - fallbacks)
                log.log(self.step, row, advance=False)
                window = []
                self.on_log(self.step)
                self._event("on_log", logs=row)
            log.advance()
            if self.evaluates_after(self.step, last):
                self._evaluate_and_log(log)
            saved = self.saves_after(self.step, last) and self.can_checkpoint(self.step)
            if saved:
                self._save_checkpoint()
            if last:
                break
            if jit is not None and self.can_checkpoint(self.step) and jit.requested(s):
                if not saved or cfg.save_only_model:  # a checkpoint to resume, whatever save_only_model says
                    self._save_checkpoint(model_only=False)
                interrupt.stopped_by(signal.SIGTERM)
                raise KeyboardInterrupt  # stops as an interrupted run does; its line names this checkpoint

    def _evaluate_and_log(self, log: RunLog) -> None:
        metrics = self.evaluate()
        log.log(self.step, metrics, advance=False)
        self._event("on_evaluate", metrics=metrics)

    def _save_checkpoint(self, model_only: bool | None = None) -> None:
        """``checkpoint-N``; ``model_only`` (default: ``save_only_model``) without the state a resume needs."""
        save_checkpoint(self.session, self.cfg, self.step, self.checkpoint_models(),
                        {"total_steps": self.total_steps, **self.checkpoint_state()}, trainer=self.name,
                        rank_state=self.checkpoint_rank_state,
                        model_only=self.cfg.save_only_model if model_only is None else model_only)
        self._event("on_save")

    def end(self) -> None:
        """Finish the trackers and leave the process as it was (no ZeRO-3 mode, no group posttrain made):
        call it once on every process, after everything that needs the others (saving, pushing)."""
        self.session.close()

    def card_info(self) -> dict[str, Any]:
        """What the model card reads off the trainer: the trained model's hub name or path, as
        ``from_pretrained`` recorded it (None for an object built from a config), and its peft config."""
        model = self.session.unwrap(self.roles["trained"][0])
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return {"base_model": getattr(getattr(base, "config", None), "_name_or_path", None) or None,
                "peft_config": getattr(self, "peft_config", None)}

    @property
    def hub_model_id(self) -> str:
        from posttrain.run.hub import hub_repo_id

        return hub_repo_id(self.cfg)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: Any = None) -> None:
        """Write the model card (``README.md``) and learning curves to the output dir (main process)."""
        from posttrain.run.modelcard import write_model_card

        if self.session.is_main_process:
            info = self.card_info()
            write_model_card(self.cfg.output_dir, self.cfg, self.name, self.session, dataset_name=dataset_name,
                             model_name=model_name, tags=tags, **info)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, **card: Any) -> str | None:
        """Upload the saved model in the output dir, with its card, as ``transformers.Trainer.push_to_hub``."""
        from posttrain.run.hub import push_to_hub

        self.create_model_card(**{k: v for k, v in card.items() if k in ("model_name", "dataset_name", "tags")})
        if not self.session.is_main_process:
            return None
        return push_to_hub(self.cfg, self.cfg.output_dir, commit_message)

    def save_model(self, directory: str | os.PathLike | None = None) -> Path:
        """Save the first trained role in the output dir (TRL's layout), others in ``<role>/``; returns it. A
        generation rank saves nothing (the training ranks hold the trained weights)."""
        if getattr(self.session, "generates", False):
            return Path(directory or self.cfg.output_dir)
        trained = self.roles["trained"]
        merge = getattr(self.cfg, "merge_adapters", False)
        path = save_trained_model(self.session, trained[0], directory or self.cfg.output_dir, self.tokenizer, merge)
        for role in trained[1:]:
            save_trained_model(self.session, role, path / role, self.tokenizer, merge)
        return path


# TRL constructor arguments posttrain does not take, and why.
_NOT_TAKEN = {
    "data_collator": "posttrain collates its own batches (padding-free where that is exact)",
    "compute_loss_func": "the loss is the algorithm's own: subclass the trainer to change it",
    "compute_metrics": "evaluation reports the trainer's own metrics over the whole eval set",
    "preprocess_logits_for_metrics": "evaluation reports the trainer's own metrics over the whole eval set",
    "optimizers": "each trained role's AdamW is built under its DeepSpeed plugin: set learning_rate, weight_decay "
                  "and adam_* in args",
    "optimizer_cls_and_kwargs": "each trained role's AdamW is built under its DeepSpeed plugin: set learning_rate, "
                                "weight_decay and adam_* in args",
    "quantization_config": "quantized (bitsandbytes) models are not supported: load the model in bf16",
    "formatting_func": "format the rows into the text column first (dataset.map)",
    "tools": "multi-turn tool use runs in GRPOTrainer and RLOOTrainer",
}


def refuse_arguments(trainer: str, **given: Any) -> None:
    """Refuse the TRL constructor arguments posttrain does not take, by name, before anything loads."""
    for name, value in given.items():
        if value is not None and value != (None, None):
            raise ConfigError(f"{trainer}({name}=...) is not supported: {_NOT_TAKEN[name]}")


def default_args(config_cls: type, model: Any, suffix: str) -> Any:
    """TRL's config when ``args`` is None: the defaults, in ``<model name>-<suffix>``."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    return config_cls(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")


def eval_shards(session: Any, n: int, batch_size: int) -> Iterator[list[int]]:
    """This process's ``range(n)`` share in batches, the same count on every process (ZeRO-3 collectives)."""
    mine = list(range(session.process_index, n, session.num_processes))
    for j in range(math.ceil(math.ceil(n / session.num_processes) / batch_size)):
        yield mine[j * batch_size : (j + 1) * batch_size]


class RowsTrainer(Trainer):
    """A trainer stepping over prepared rows in TRL's Trainer order (SFT, reward). A subclass sets
    ``train_rows``, ``eval_rows``, ``loader`` and ``schedule`` (``config.row_schedule``), ``collate``,
    ``phases`` and ``num_tokens`` and supplies ``optimizer_step`` (its micro-batches may be fewer than
    gradient_accumulation_steps at an epoch's end, as in TRL)."""

    _steps: Any = None

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        raise NotImplementedError

    def training_step(self, step: int) -> dict[str, Any]:
        s = self.session
        role = self.roles["trained"][0]
        if self._steps is None:
            self._steps = self.loader.steps(self.schedule, s.process_index, start_step=step - 1)
        planned = next(self._steps)
        row = self.optimizer_step([self.collate([self.train_rows[i] for i in b.rows]) for b in planned.batches])
        row.update({"grad_norm": s.grad_norm(role) or 0.0, "learning_rate": s.learning_rate(role),
                    "epoch": planned.epoch, **self.phases.pop()})
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
