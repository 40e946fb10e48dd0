"""A run's output dir: layout, lock, resume, and atomic ``checkpoint-N`` folders."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from posttrain.errors import ConfigError
from posttrain.placement.session import Session


class OutputDirSettings(Protocol):
    """What this module reads of a run's config (common.TrainConfig has these fields)."""

    output_dir: str
    overwrite_output_dir: bool
    resume_from_checkpoint: str | None
    save_total_limit: int | None


_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_PARTIAL = re.compile(r"checkpoint-(\d+)\.tmp")
_RUN_FILES = ("metrics.jsonl", "samples.jsonl")  # what a run appends to (and overwrite clears)
# A model's files at the top: a reused dir that holds one is refused (saving would replace it).
_MODEL_FILES = ("config.json", "adapter_config.json", "model.safetensors", "model.safetensors.index.json")
SETTINGS_FILE = "posttrain_config.json"  # the run's settings; config.json is the saved model's
LOCK_FILE = ".posttrain.lock"
_held_locks: dict[Path, int] = {}  # output dir -> the open lock file this process holds until it exits


def checkpoint_dir(cfg: OutputDirSettings, step: int) -> Path:
    return Path(cfg.output_dir) / f"checkpoint-{step}"


def is_complete_checkpoint(path: Path) -> bool:
    """Renamed into place, with the trainer state that :meth:`Session.save_state` writes last."""
    return bool(_CHECKPOINT.fullmatch(path.name)) and (path / "state" / "trainer_state.json").is_file()


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in ``output_dir``, oldest step first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if is_complete_checkpoint(p)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.fullmatch(p.name).group(1)))


def partial_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Half-written checkpoints: saves that did not finish on every rank."""
    return sorted(p for p in Path(output_dir).glob("checkpoint-*.tmp") if _PARTIAL.fullmatch(p.name))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step (half-written ones never count)."""
    found = checkpoints(output_dir)
    return found[-1] if found else None


def _is_main_rank() -> bool:
    # From the launcher's environment: this runs before the process group exists.
    return int(os.environ.get("RANK", "0")) == 0


def _say(message: str) -> None:
    if _is_main_rank():
        print(f"[posttrain] {message}", file=sys.stderr, flush=True)


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Hold ``output_dir`` (rank-0 flock until exit); a second run gets a ConfigError. Repeat calls: no-op."""
    if not _is_main_rank():
        return
    out = Path(output_dir).resolve()
    if out in _held_locks:
        if _same_file(_held_locks[out], out / LOCK_FILE):
            return
        os.close(_held_locks.pop(out))  # the dir was removed and made again: lock the new one
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"output_dir {out} cannot be written ({err.strerror}): choose a writable --output_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "a process that has not said who it is"
        os.close(fd)
        raise ConfigError(f"output_dir {out} is in use by another run ({holder}): wait for it to end or stop it, "
                          "or choose another --output_dir") from None
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
    _held_locks[out] = fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def prepare_output_dir(cfg: OutputDirSettings) -> None:
    """Every rank, before models load: lock the dir, resolve resume or refuse a used one, then clean it."""
    out = Path(cfg.output_dir)
    lock_output_dir(out)
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise ConfigError(f"save_total_limit must be >= 1 or unset (keep every checkpoint), got {cfg.save_total_limit}")
    resume = resume_dir(cfg) if cfg.resume_from_checkpoint else None
    used = [name for name in (*_RUN_FILES, *_MODEL_FILES) if (out / name).exists()] + [p.name for p in checkpoints(out)]
    if resume is None and used and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir {out} already holds a run "
                          f"({', '.join(used[:4])}{', ...' if len(used) > 4 else ''}): pass "
                          "--resume_from_checkpoint latest to continue it, --overwrite_output_dir true to "
                          "replace it, or choose another --output_dir")
    for partial in partial_checkpoints(out):
        _say(f"removing {partial}: a half-written checkpoint (its save did not finish on every rank)")
        if _is_main_rank():
            shutil.rmtree(partial, ignore_errors=True)
    if resume is not None:
        cfg.resume_from_checkpoint = str(resume)  # the trainer (and posttrain_config.json) see the checkpoint taken
        _say(f"resuming from {resume} (step {_checkpoint_step(resume)})")
        return
    cleared = [name for name in used if name not in _MODEL_FILES]
    if not cleared:
        return
    _say(f"overwrite_output_dir: clearing {', '.join(cleared)} in {out}")
    if _is_main_rank():
        for name in cleared:
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            else:
                (out / name).unlink()


def _checkpoint_step(path: Path) -> int:
    return int(json.loads((path / "state" / "trainer_state.json").read_text()).get("step", 0))


def resume_dir(cfg: OutputDirSettings) -> Path | None:
    """Checkpoint to resume (None: scratch); "latest"/"true": newest complete; none/half-written: refused."""
    if not cfg.resume_from_checkpoint:
        return None
    if str(cfg.resume_from_checkpoint).lower() in ("latest", "true"):
        path = latest_checkpoint(cfg.output_dir)
        if path is None:
            raise ConfigError(f"resume_from_checkpoint is 'latest' but {cfg.output_dir} holds no complete checkpoint: "
                              "unset resume_from_checkpoint to start from scratch, or give a checkpoint's path")
        return path
    path = Path(cfg.resume_from_checkpoint)
    if _PARTIAL.fullmatch(path.name) or (path.is_dir() and not (path / "state" / "trainer_state.json").is_file()):
        good = latest_checkpoint(path.parent)
        raise ConfigError(f"{path} is a half-written checkpoint (its save did not finish): resume from "
                          f"{good or 'an earlier checkpoint'}, or use resume_from_checkpoint: latest")
    if not (path / "state").is_dir():
        raise ConfigError(f"{path} is not a posttrain checkpoint (no state/ inside): give a checkpoint-N folder "
                          "of an output dir, or resume_from_checkpoint: latest")
    return path


def save_checkpoint(session: Session, cfg: OutputDirSettings, step: int, export: dict[str, Any], extra: dict) -> Path:
    """Write ``checkpoint-N/`` (``<role>/`` exports, ``state/``) atomically; prune to ``save_total_limit``."""
    final = checkpoint_dir(cfg, step)
    tmp = final.with_name(final.name + ".tmp")
    if session.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    session.accelerator.wait_for_everyone()
    for role, tokenizer in export.items():
        session.save_pretrained(role, tmp / role, tokenizer=tokenizer)
    session.save_state(tmp / "state", extra={"step": step, **extra})  # returns once every rank has written
    if session.is_main_process:
        if final.exists():  # from an earlier run past the checkpoint this one resumed from
            shutil.rmtree(final)
        os.replace(tmp, final)
        if cfg.save_total_limit:
            for old in checkpoints(cfg.output_dir)[: -cfg.save_total_limit]:
                shutil.rmtree(old)
    session.accelerator.wait_for_everyone()
    return final
