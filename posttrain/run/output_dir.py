"""A run's output dir: layout, lock, resume, and atomic ``checkpoint-N`` folders."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from posttrain import checks
from posttrain.errors import ConfigError
from posttrain.placement.session import Session
from posttrain.run.modelcard import CARD_FILE, CURVES_FILE, is_posttrain_card


class OutputDirSettings(Protocol):
    """What this module reads of a run's config (every trainer's config has these fields)."""

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
SAVED_BY_FILE = "saved_by.json"  # in checkpoint-N/state/: the trainer, config class and models that saved it
MODEL_ONLY = "model_only"  # trainer_state.json's mark of a save_only_model checkpoint (no state to resume)
# What posttrain writes at an output dir's top besides checkpoints and saved models.
_OWN_FILES = (*_RUN_FILES, SETTINGS_FILE, LOCK_FILE, CURVES_FILE, "summary.json")
# save_pretrained's files (model, adapter, tokenizer): a saved model, replaced by the next save.
_WEIGHTS = re.compile(r"(model|adapter_model|pytorch_model)[\w.-]*\.(safetensors|bin)(\.index\.json)?")
_SAVED_MODEL = re.compile(r"(config|generation_config|adapter_config|tokenizer|tokenizer_config|special_tokens_map"
                          r"|added_tokens|preprocessor_config|processor_config|vocab)\.json|chat_template\.(jinja|json)"
                          r"|merges\.txt|vocab\.txt|(tokenizer|spiece|sentencepiece\.bpe)\.model|" + _WEIGHTS.pattern)
# The model shape a checkpoint records and a resumed run must match (vocab_size too: posttrain never resizes).
ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")
_NEARLY_FULL = 64 * 2**20  # free bytes below which a failed write is taken as a full disk
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
        holder = _holder(fd)
        os.close(fd)
        raise _in_use(out, holder) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
    _held_locks[out] = fd


def _holder(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said who it is"


def _in_use(out: Path, holder: str) -> ConfigError:
    return ConfigError(f"output_dir {out} is in use by another run ({holder}): wait for it to end or stop it, "
                       "or choose another --output_dir")


def _check_not_held(out: Path) -> None:
    """Refuse a dir another run holds, without taking the lock or creating anything."""
    resolved = out.resolve()
    if not _is_main_rank() or (resolved in _held_locks and _same_file(_held_locks[resolved], out / LOCK_FILE)):
        return
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (or unreadable: lock_output_dir says so when the run claims the dir)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # blocked by any run's exclusive lock
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        raise _in_use(resolved, _holder(fd)) from None
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


@dataclass(frozen=True)
class OutputDirPlan:
    """What :func:`claim_output_dir` will do to the output dir, as :func:`plan_output_dir` found it."""

    path: Path  # the output dir, ``~`` expanded (cfg.output_dir is set to it)
    given: str  # output_dir as the run was given it
    resume: Path | None  # the checkpoint the run resumes
    clear: tuple[str, ...]  # the previous run's files and checkpoints that overwrite_output_dir removes
    partial: tuple[Path, ...]  # half-written checkpoints, removed
    kept: tuple[str, ...]  # entries posttrain did not write: never deleted or replaced


def plan_output_dir(cfg: OutputDirSettings) -> OutputDirPlan:
    """Every check of the output dir, with no side effect on disk: call it before any model loads.

    Refuses a dir another run holds, a reused dir without resume or overwrite, a bad resume checkpoint,
    a dir holding files posttrain did not write (unless overwrite_output_dir, which keeps them); the
    only change it makes is ``cfg.output_dir`` with ``~`` expanded."""
    given = cfg.output_dir
    cfg.output_dir = checks.check_output_dir(given)
    out = Path(cfg.output_dir)
    _check_not_held(out)
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise ConfigError(f"save_total_limit must be >= 1 or unset (keep every checkpoint), got {cfg.save_total_limit}")
    resume = resume_dir(cfg) if cfg.resume_from_checkpoint else None
    if resume is not None:  # saved by the processes that train (generation ranks save nothing)
        check_checkpoint_files(resume, int(os.environ.get("WORLD_SIZE", "1")) - getattr(cfg, "generation_processes", 0))
    foreign = foreign_entries(out)
    used = [name for name in (*_RUN_FILES, *_MODEL_FILES) if (out / name).exists() and name not in foreign]
    used += [p.name for p in checkpoints(out)]
    replaced = [name for name in foreign if _would_write(name)]
    if resume is None and replaced:
        names = ", ".join(replaced[:4]) + (", ..." if len(replaced) > 4 else "")
        raise ConfigError(f"output_dir {out.absolute()} holds {names} that posttrain did not write (no run of its own "
                          f"is there), and the run would replace {'them' if len(replaced) > 1 else 'it'}: choose "
                          "another --output_dir")
    if resume is None and used and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir {out} already holds a run "
                          f"({', '.join(used[:4])}{', ...' if len(used) > 4 else ''}): pass "
                          "--resume_from_checkpoint latest to continue it, --overwrite_output_dir true to "
                          "replace it, or choose another --output_dir")
    if resume is None and foreign and not cfg.overwrite_output_dir:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ConfigError(f"output_dir {out.absolute()} holds files posttrain did not write ({shown}): choose a new "
                          "or empty --output_dir, or pass --overwrite_output_dir true to write the run beside them "
                          "(posttrain deletes and replaces none of them, and writes no model card over a README.md "
                          "not its own)")
    clearing = resume is None and cfg.overwrite_output_dir
    clear = tuple(n for n in used if n not in _MODEL_FILES) if clearing else ()
    return OutputDirPlan(out, str(given), resume, clear, tuple(partial_checkpoints(out)), tuple(foreign))


def claim_output_dir(cfg: OutputDirSettings) -> OutputDirPlan:
    """Every rank, once every model is loaded and prepared (the start of ``train()``): check again, lock the
    dir (rank 0), remove half-written checkpoints, take the resumed checkpoint or clear the previous run."""
    first = plan_output_dir(cfg)  # refused before the lock file is made
    lock_output_dir(first.path)
    plan = plan_output_dir(cfg)  # again under the lock: what happened since the check counts
    if first.given != str(plan.path) or first.given in (".", "./"):
        _say(f"output_dir {first.given!r} is {plan.path.absolute()}")
    for partial in plan.partial:
        _say(f"removing {partial}: a half-written checkpoint (its save did not finish on every rank)")
        if _is_main_rank():
            shutil.rmtree(partial, ignore_errors=True)
    if plan.resume is not None:
        cfg.resume_from_checkpoint = str(plan.resume)  # the trainer and posttrain_config.json see the one taken
        _say(f"resuming from {plan.resume} (step {_checkpoint_step(plan.resume)})")
        return plan
    if plan.kept:
        _say(f"overwrite_output_dir: keeping {', '.join(plan.kept)} in {plan.path.absolute()} (posttrain did not "
             "write them)")
    if plan.clear:
        _say(f"overwrite_output_dir: clearing {', '.join(plan.clear)} in {plan.path}")
    if _is_main_rank():
        for name in plan.clear:
            if (plan.path / name).is_dir():
                shutil.rmtree(plan.path / name)
            else:
                (plan.path / name).unlink()
    return plan


def prepare_output_dir(cfg: OutputDirSettings) -> OutputDirPlan:
    """Check and claim at once (:func:`claim_output_dir`), for callers that have no models to load first."""
    return claim_output_dir(cfg)


def foreign_entries(output_dir: str | os.PathLike) -> list[str]:
    """Names at the top of ``output_dir`` that posttrain did not write. Its run files and a saved model's files
    count as its own only where a run of its own is (its settings, lock, model card, a checkpoint or weights)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir())
    a_run = (SETTINGS_FILE in names or LOCK_FILE in names or any(_WEIGHTS.fullmatch(n) for n in names)
             or bool(checkpoints(out)) or (CARD_FILE in names and is_posttrain_card(out / CARD_FILE)))
    foreign = []
    for name in names:
        if _CHECKPOINT.fullmatch(name) or _PARTIAL.fullmatch(name):
            continue
        if name == CARD_FILE:
            ours = is_posttrain_card(out / name)
        elif _would_write(name):
            ours = a_run
        else:
            ours = (out / name).is_dir() and _is_model_or_log_folder(out / name)
        if not ours:
            foreign.append(name)
    return foreign


def _would_write(name: str) -> bool:
    """A name the run writes (or overwrite_output_dir clears) at the output dir's top, README.md aside."""
    return name in _OWN_FILES or bool(_SAVED_MODEL.fullmatch(name))


def _is_model_or_log_folder(path: Path) -> bool:
    """A trained role's saved model (``value/``) or a tracker's logs (``<trainer>/events.out.tfevents.*``)."""
    return ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()
            or any(path.glob("events.out.tfevents.*")) or any(path.glob("*/events.out.tfevents.*")))


def _checkpoint_step(path: Path) -> int:
    try:
        return int(json.loads((path / "state" / "trainer_state.json").read_text()).get("step", 0))
    except (OSError, ValueError, AttributeError):  # unreadable: the folder's name says it
        return _step_of(path) if _CHECKPOINT.fullmatch(path.name) else 0


def resume_dir(cfg: OutputDirSettings) -> Path | None:
    """Checkpoint to resume (None: scratch); "latest"/"true": newest complete; none/half-written: refused."""
    if not cfg.resume_from_checkpoint:
        return None
    if str(cfg.resume_from_checkpoint).lower() in ("latest", "true"):
        path = latest_checkpoint(cfg.output_dir)
        if path is None:
            raise ConfigError(f"resume_from_checkpoint is 'latest' but {cfg.output_dir} holds no complete checkpoint: "
                              "unset resume_from_checkpoint to start from scratch, or give a checkpoint's path")
        return _resumable(path)
    path = Path(cfg.resume_from_checkpoint).expanduser()
    if _PARTIAL.fullmatch(path.name) or (path.is_dir() and not (path / "state" / "trainer_state.json").is_file()):
        good = latest_checkpoint(path.parent)
        raise ConfigError(f"{path} is a half-written checkpoint (its save did not finish): resume from "
                          f"{good or 'an earlier checkpoint'}, or use resume_from_checkpoint: latest")
    if not (path / "state").is_dir():
        raise ConfigError(f"{path} is not a posttrain checkpoint (no state/ inside): give a checkpoint-N folder "
                          "of an output dir, or resume_from_checkpoint: latest")
    return _resumable(path)


def is_model_only(path: Path) -> bool:
    """A checkpoint saved with ``save_only_model``: its models, no engine, optimizer or RNG state."""
    try:
        state = json.loads((path / "state" / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and bool(state.get(MODEL_ONLY))


def _resumable(path: Path) -> Path:
    """``path``, unless it holds only models (save_only_model): then the sentence naming what can resume."""
    if not is_model_only(path):
        return path
    whole = [p for p in checkpoints(path.parent) if not is_model_only(p)]
    other = f"resume from {whole[-1]}, the newest checkpoint with it, or " if whole else ""
    folder = _first_model_folder(path)
    start = f"start a new run from its model with --model_name_or_path {path / folder}" if folder else "start a new run"
    raise ConfigError(f"{path} was saved with save_only_model, so it holds no optimizer, schedule or RNG state to "
                      f"resume: {other}{start}")


def check_resume(cfg: OutputDirSettings, trainer_name: str, model_config: Any = None, uses_peft: bool | None = None,
                 role: str | None = None, num_processes: int | None = None) -> Path | None:
    """The checkpoint ``cfg.resume_from_checkpoint`` names, checked before any weights load; None: no resume.

    It must be whole, saved by ``trainer_name``'s trainer (or a config of ``cfg``'s class) on as many processes
    as this run has (``num_processes``; WORLD_SIZE when None), with LoRA as ``uses_peft`` says, from a model
    of ``model_config``'s shape (a transformers config or its dict); ``role``: its model folder compared
    (default: the first the checkpoint saved). A check without its argument (None) is skipped."""
    ckpt = resume_dir(cfg)
    if ckpt is None:
        return None
    check_checkpoint_files(ckpt, num_processes)
    saved = _read_saved_by(ckpt)
    role = role or next(iter(saved.get("models", {})), None) or _first_model_folder(ckpt)
    model = saved.get("models", {}).get(role, {}) if role else {}
    folder = ckpt / role if role else None
    start = f"start a new run from its model with --model_name_or_path {folder}" if folder else "start a new run"
    # The trainer's name where the checkpoint recorded it, else its config class (always recorded).
    if saved.get("trainer") is not None:
        other = f"the {saved['trainer']} trainer" if saved["trainer"] != trainer_name else None
    else:
        config = saved.get("config")
        other = f"a run configured with {config}" if config not in (None, type(cfg).__name__) else None
    if other is not None:
        raise ConfigError(f"checkpoint {ckpt} was saved by {other} and this run is {trainer_name} (resuming would take "
                          f"its optimizer, schedule and step): give a checkpoint of a {trainer_name} run, or {start}")
    saved_peft = model.get("peft")
    if saved_peft is None and folder is not None and folder.is_dir():
        saved_peft = (folder / "adapter_config.json").is_file()
    if uses_peft is not None and saved_peft is not None and saved_peft != uses_peft:
        if saved_peft:
            raise ConfigError(f"checkpoint {ckpt} trained LoRA adapters (use_peft) and this run trains the whole "
                              "model: add --use_peft true with the LoRA settings it was saved with to resume it, or "
                              "start a new run without --resume_from_checkpoint")
        raise ConfigError(f"checkpoint {ckpt} trained the whole model and this run trains LoRA adapters (use_peft): "
                          f"drop --use_peft to resume it, or {start.replace('a new run', 'a new LoRA run')}")
    saved_arch = model.get("arch") or (_arch_of_folder(folder) if folder is not None else None)
    if model_config is not None and saved_arch:
        mine = arch_of(model_config)
        differ = [k for k in ARCH_KEYS if saved_arch.get(k) is not None and mine.get(k) is not None
                  and saved_arch[k] != mine[k]]
        if differ:
            source = model.get("name_or_path") or _run_setting(ckpt, "model_name_or_path")
            raise ConfigError(f"checkpoint {ckpt} was saved from another model than the one given "
                              f"({'; '.join(f'{k} {saved_arch[k]} there, {mine[k]} here' for k in differ)}): give "
                              f"--model_name_or_path {source or 'of the model that run started from'} to resume it, "
                              "or a checkpoint of this model")
    return ckpt


def check_checkpoint_files(ckpt: Path, num_processes: int | None = None) -> None:
    """A checkpoint's files are whole and were saved by as many processes as this run has (WORLD_SIZE when None)."""
    damage = _damage(ckpt)
    if damage:
        step = int(m.group(1)) if (m := _CHECKPOINT.fullmatch(ckpt.name)) else None
        earlier = [p for p in checkpoints(ckpt.parent) if step is not None and _step_of(p) < step]
        fix = (f"resume from the one before with --resume_from_checkpoint {earlier[-1]}" if earlier else
               "there is no earlier checkpoint: copy it again if it was copied, or start a new run with "
               "--overwrite_output_dir true")
        raise ConfigError(f"checkpoint {ckpt} is corrupt ({damage}): {fix}")
    world = num_processes or int(os.environ.get("WORLD_SIZE", "1"))
    state = ckpt / "state"
    for role_dir in sorted(p for p in state.iterdir() if p.is_dir()):
        ranks = len(list(role_dir.glob("random_states_*.pkl")))
        parts = len(list(role_dir.glob("*/*zero_pp_rank_*_optim_states.pt")))  # in DeepSpeed's tag folder (bf16_ too)
        if (parts and parts != world) or (ranks and ranks < world):
            saved = parts or ranks
            why = (f"DeepSpeed split its optimizer state {saved} ways and cannot split it again" if parts else
                   f"it holds the state of {saved} process{'es' if saved > 1 else ''} only")
            folder = _first_model_folder(ckpt)
            start = f" from its model with --model_name_or_path {ckpt / folder}" if folder else ""
            raise ConfigError(f"checkpoint {ckpt} was saved by {saved} process{'es' if saved > 1 else ''} and this run "
                              f"has {world} ({why}): resume it on {saved} (torchrun --nproc_per_node {saved}, or "
                              f"accelerate launch --num_processes {saved}), or start a new run{start}")


def _damage(ckpt: Path) -> str | None:
    """The first truncated or unreadable file in a checkpoint, as "state/x.pt is truncated"; None: whole."""
    try:
        state = json.loads((ckpt / "state" / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "state/trainer_state.json is not readable JSON"
    if not isinstance(state, dict):
        return "state/trainer_state.json is not a mapping"
    for file in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        name = file.relative_to(ckpt)
        if file.suffix in (".pt", ".bin", ".pkl", ".pth"):
            with open(file, "rb") as f:
                head = f.read(4)
            if not head:
                return f"{name} is empty"
            if head == b"PK\x03\x04":  # torch.save's zip: a cut file lost its central directory at the end
                try:
                    zipfile.ZipFile(file).close()
                except (zipfile.BadZipFile, OSError):
                    return f"{name} is truncated"
        elif file.suffix == ".safetensors":
            problem = checks.safetensors_problem(file)
            if problem:
                return f"{name} {problem}"
        elif file.suffix == ".json":
            try:
                json.loads(file.read_text())
            except (ValueError, UnicodeDecodeError):
                return f"{name} is not whole JSON"
        elif file.name == "latest" and not (file.parent / file.read_text().strip()).is_dir():
            return f"{name} names DeepSpeed tag {file.read_text().strip()!r}, which is not there"
    return None


def _step_of(path: Path) -> int:
    return int(_CHECKPOINT.fullmatch(path.name).group(1))


def _first_model_folder(ckpt: Path) -> str | None:
    """The model folder a checkpoint saved beside ``state/`` ("policy" when there are several)."""
    names = sorted(p.name for p in ckpt.iterdir() if p.is_dir() and p.name != "state")
    return "policy" if "policy" in names else names[0] if names else None


def _read_saved_by(ckpt: Path) -> dict:
    try:
        saved = json.loads((ckpt / "state" / SAVED_BY_FILE).read_text())
    except (OSError, ValueError):
        return {}  # a checkpoint from before posttrain recorded it
    return saved if isinstance(saved, dict) else {}


def _run_setting(ckpt: Path, key: str) -> Any:
    """A setting of the run that wrote ``ckpt``, from its output dir's posttrain_config.json."""
    try:
        return json.loads((ckpt.parent / SETTINGS_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def arch_of(config: Any) -> dict[str, Any]:
    """A model config's shape (``ARCH_KEYS``), from a transformers config or its dict (aliases such as GPT-2's
    ``n_embd`` resolved by transformers)."""
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        values = dict(config)
        try:
            config = AutoConfig.for_model(values.pop("model_type"), **values)
        except (KeyError, ValueError, TypeError):
            return {k: config.get(k) for k in ARCH_KEYS if config.get(k) is not None}
    found = {k: getattr(config, k, None) for k in ARCH_KEYS}
    return {k: v for k, v in found.items() if isinstance(v, (int, str))}


def _arch_of_folder(folder: Path) -> dict[str, Any] | None:
    try:
        return arch_of(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None  # an adapter folder (no config.json) or no model saved


def _saved_by(session: Session, cfg: OutputDirSettings, export: dict[str, Any], trainer: str | None) -> dict:
    """What :func:`check_resume` compares: the trainer, the config class, each saved model's shape and LoRA."""
    models = {}
    for role in export:
        try:
            model = session.unwrap(role)
        except (AttributeError, KeyError):  # a session without engines (tests' stubs)
            continue
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        models[role] = {"peft": hasattr(model, "peft_config"), "arch": arch_of(config) if config is not None else {},
                        "name_or_path": getattr(config, "_name_or_path", None) or None}
    return {"trainer": trainer, "config": type(cfg).__name__, "models": models}


def save_checkpoint(session: Session, cfg: OutputDirSettings, step: int, export: dict[str, Any], extra: dict,
                    trainer: str | None = None, rank_state: Callable[[Path, int], None] | None = None,
                    model_only: bool = False) -> Path:
    """Write ``checkpoint-N/`` (``<role>/`` exports, ``state/``) atomically; prune to ``save_total_limit``.
    ``trainer``: the trainer's name, recorded for :func:`check_resume`; ``rank_state(state_dir, rank)``: what
    each rank writes of its own; ``model_only`` (TRL's ``save_only_model``): the exports and the step, no
    resumable state. A full disk: one sentence, the half-written folder removed and the previous checkpoints
    intact."""
    final = checkpoint_dir(cfg, step)
    tmp = final.with_name(final.name + ".tmp")
    if session.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    session.wait_for_everyone()
    try:
        for role, tokenizer in export.items():
            session.save_pretrained(role, tmp / role, tokenizer=tokenizer)
        if model_only:
            session.wait_for_everyone()  # every rank's exports written
            if session.is_main_process:
                (tmp / "state").mkdir(parents=True, exist_ok=True)
                (tmp / "state" / "trainer_state.json").write_text(json.dumps({"step": step, MODEL_ONLY: True,
                                                                              **extra}, indent=1))
        else:
            if rank_state is not None:  # before save_state, whose trainer_state.json is written last
                (tmp / "state").mkdir(parents=True, exist_ok=True)
                rank_state(tmp / "state", session.process_index)
            session.save_state(tmp / "state", extra={"step": step, **extra})  # returns once every rank has written
        if session.is_main_process:
            (tmp / "state" / SAVED_BY_FILE).write_text(json.dumps(_saved_by(session, cfg, export, trainer), indent=1))
    except Exception as err:
        if not _disk_full(err, final.parent):
            raise
        raise _no_space(session, cfg, tmp, final) from None
    if session.is_main_process:
        if final.exists():  # from an earlier run past the checkpoint this one resumed from
            shutil.rmtree(final)
        os.replace(tmp, final)
        if cfg.save_total_limit:
            for old in checkpoints(cfg.output_dir)[: -cfg.save_total_limit]:
                shutil.rmtree(old)
    session.wait_for_everyone()
    return final


def _disk_full(err: BaseException, folder: Path) -> bool:
    """ENOSPC (or a quota) in the chain; torch's zip writer says neither, so its failure counts on a full disk."""
    seen: BaseException | None = err
    for _ in range(8):  # __context__ chains are short; the bound guards against a cycle
        if seen is None:
            break
        text = str(seen)
        if (isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
                s in text for s in ("No space left on device", "os error 28", "Disk quota exceeded")):
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(err, RuntimeError) and _free_bytes(folder) < _NEARLY_FULL


def _free_bytes(folder: Path) -> int:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _no_space(session: Session, cfg: OutputDirSettings, tmp: Path, final: Path) -> ConfigError:
    """The sentence for a full disk, once the half-written folder is gone (its space is free again)."""
    if session.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(cfg.output_dir)
    need = f"it needs about {_human(_size(previous))}, as much as {previous.name}; " if previous is not None else ""
    limit = (f"lower --save_total_limit (now {cfg.save_total_limit}; a save needs room for one more)"
             if cfg.save_total_limit else "set --save_total_limit N to keep only the newest N")
    kept = (f"; {previous.name} is whole, resume from it with --resume_from_checkpoint latest" if previous is not None
            else "")
    free = _human(_free_bytes(final.parent))
    return ConfigError(f"the disk of {final.parent} is full: {final.name} could not be saved ({need}{free} free): free "
                       f"space there, {limit}, or choose an --output_dir on a larger disk{kept}")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: int) -> str:
    for exponent, unit in ((30, "GB"), (20, "MB"), (10, "KB")):
        if n >= 2**exponent:
            return f"{n / 2**exponent:.1f} {unit}"
    return f"{n} bytes"
