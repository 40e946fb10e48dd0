"""A run's progress: phase times, the progress bar, ``metrics.jsonl`` and accelerate's trackers."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.placement.session import Session
from posttrain.run import interrupt
from posttrain.run.jsonrows import dumps_row, read_rows
from posttrain.run.modelcard import config_values, write_model_card
from posttrain.run.output_dir import SETTINGS_FILE, latest_checkpoint
from posttrain.trainers.config import TrainConfig, saves


class Phases:
    """Wall time per phase (``time/<name>``), synchronised so that it includes the device work."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        _sync()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # a profiler trace's phases
                yield
        finally:
            _sync()
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class RunLog:
    """Progress bar (``shown`` metrics), ``metrics.jsonl`` and trackers; ``history`` is the whole run's."""

    def __init__(self, session: Session, cfg: TrainConfig, total: int, name: str, start: int = 0,
                 shown: tuple[str, ...] = ("loss",), card: dict[str, Any] | None = None) -> None:
        self.session, self.cfg, self.name, self.card = session, cfg, name, card or {}
        self.out = Path(cfg.output_dir)
        self.main = session.is_main_process
        self.total, self.done, self.shown = total, start, shown
        self.postfix: dict[str, str] = {}
        self.closed = False
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            # Not config.json: the trained model is saved in output_dir itself.
            (self.out / SETTINGS_FILE).write_text(json.dumps(_jsonable(config_values(cfg)), indent=1))
            # A resumed run drops the rows logged after its checkpoint (they are written again).
            truncate_jsonl(self.out / "metrics.jsonl", start)
            truncate_jsonl(self.out / "samples.jsonl", start)
        self.history: list[dict] = []
        if start > 0:
            session.wait_for_everyone()  # read once rank 0 has cut the file back
            self.history = read_rows(self.out / "metrics.jsonl")
        if cfg.report_to:
            # Trackers (TensorBoard's hparams) take scalars only.
            scalars = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config_values(cfg).items()}
            run = {"wandb": {"name": cfg.run_name}} if getattr(cfg, "run_name", None) else None
            session.accelerator.init_trackers(name, config=scalars, init_kwargs=run)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=start, desc=name, disable=not self.main or cfg.disable_tqdm,
                        dynamic_ncols=True)
        interrupt.track(self.interrupted)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        row = {"step": step, **metrics}  # full precision: json writes floats with repr
        self.history.append(row)
        if self.main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(dumps_row(row) + "\n")
            shown = {_label(k): _short(metrics[k]) for k in self.shown if k in metrics}
            if self.cfg.disable_tqdm:
                if shown:
                    print(self.line(step, metrics, shown), flush=True)
            else:
                self.postfix.update(shown)
                self.bar.set_postfix(self.postfix, refresh=False)
        if self.cfg.report_to:
            self.session.accelerator.log(metrics, step=step)
        if advance:
            self.advance()

    def line(self, step: int, metrics: dict[str, float], shown: dict[str, str]) -> str:
        """The line printed per row without a progress bar: ``grpo step 3/60  reward 0.51 ...``."""
        extra = {k: _short(metrics[k]) for k in ("learning_rate", "lr", "epoch") if k in metrics}
        parts = [f"{self.name} step {step}/{self.total}", *(f"{k} {v}" for k, v in {**shown, **extra}.items())]
        return "  ".join(parts)

    def advance(self) -> None:
        self.done += 1
        self.bar.update(1)

    def interrupted(self) -> str:
        """The line an interrupt prints: the step reached and the checkpoint to resume from."""
        self.bar.close()
        latest = latest_checkpoint(self.cfg.output_dir)
        if latest is not None:
            how = f"resume with --resume_from_checkpoint latest ({latest.name})"
        else:
            how = "no checkpoint yet" + ("" if saves(self.cfg) else " (--save_strategy steps --save_steps N writes them)")
        step = max([self.done, *(int(h.get("step", 0)) for h in self.history[-1:])])  # logged, not yet advanced
        if self.closed:  # saving the model, or a later part of the script
            return f"interrupted after {self.name}'s training ended (step {step} of {self.total}); {how}"
        return f"interrupted at step {step} of {self.total}; {how}"

    def write(self, text: str) -> None:
        if self.main:
            self.bar.write(text)

    def close(self) -> None:
        self.closed = True
        self.bar.close()
        # Trackers are finished by Session.close() (the trainer's end()), after saving and pushing.
        if self.main:  # as TRL's trainers do: a model card (and the learning curves) in the output dir
            write_model_card(self.out, self.cfg, self.name, self.session, **self.card)


def _label(key: str) -> str:
    """A metric's name on the progress bar: ``eval/rewards/accuracies`` -> ``eval_accuracies``."""
    return key.replace("objective/", "").replace("rewards/", "").replace("/", "_")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def truncate_jsonl(path: Path, step: int) -> int:
    """Keep rows logged at ``step`` or earlier; returns how many were dropped (half-written line included)."""
    if not path.exists():
        return 0
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if _row_step(line) <= step]
    if len(kept) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(rows) - len(kept)


def _row_step(line: str) -> float:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return math.inf  # half-written
    return int(row.get("step", row.get("update", 0)))


def _jsonable(d: dict) -> dict:
    """JSON types as they are; a non-finite float and anything else as its text."""
    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return repr(v)
        return v if isinstance(v, (int, float, str, bool, list, dict, type(None))) else str(v)

    return {k: plain(v) for k, v in d.items()}
