"""Loop pieces every trainer shares: the base config, the optimizer, data order, logging and the
final save (the output dir, checkpoints and resume: output_dir.py). Each trainer keeps its own
algorithm in its own file."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import checks, interrupt
from ..demo import tiny
from ..dsconfig import ConfigError
from ..jsonrows import dumps_row, read_rows
from ..lora import LoraFields, check_lora_fields, has_adapters, save_merged
from ..modelcard import write_model_card
from ..plain import check_setting as check_engine_setting
from ..roles import DEFAULT_MIX, roles_for
from ..session import Session

# LOCK_FILE, checkpoints, lock_output_dir, resume_dir and save_checkpoint are imported from here too
# (loop.py, scripts/hub.py, tests), as before the output dir had its own module.
from .output_dir import (  # noqa: F401
    LOCK_FILE,
    SETTINGS_FILE,
    checkpoints,
    latest_checkpoint,
    lock_output_dir,
    prepare_output_dir,
    resume_dir,
    save_checkpoint,
)


@dataclass
class TrainConfig:
    """Fields shared by every trainer; names follow ``transformers.TrainingArguments``/TRL."""

    output_dir: str = "runs/posttrain"
    seed: int = 42
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # TRL's is 10 (DPOConfig keeps it); the other trainers log every optimizer step, which their
    # run summaries and tests read. Pass --logging_steps 10 for TRL's cadence.
    logging_steps: int = 1
    eval_steps: int | None = None
    # TRL saves every 500 steps; here a checkpoint holds every trained role's engine and optimizer
    # state (PPO: policy and value), so it is asked for. The final model is always saved.
    save_steps: int | None = None
    report_to: list[str] = field(default_factory=list)
    # "no" | "bf16" | "fp16"; None: accelerate launch's setting, else fp32. TRL turns bf16 on by
    # default; here the same command also runs on CPU, so precision is chosen: --bf16 on GPUs.
    mixed_precision: str | None = None
    # Placement: a mix name (roles.MIXES) and optional per-role DeepSpeed configs (preset name or
    # JSON path; a dict from Python). Set role_configs in the YAML: TrlParser cannot parse a dict flag.
    mix: str = DEFAULT_MIX
    role_configs: dict[str, str] = field(default_factory=dict)
    # Optimizer precision of every trained role: "fp32" keeps fp32 master weights and fp32 Adam
    # states (16 bytes per parameter with the bf16 weights and gradients); "bf16" updates bf16
    # weights with bf16 gradients and Adam states (8 bytes: TRL's footprint with a bf16 model).
    # bf16 needs mixed_precision bf16 and ZeRO stage 1-3 (the zero*_train_bf16_states presets).
    master_weights: str = "fp32"
    # One process: "auto" trains the mix's trained roles without a DeepSpeed engine (posttrain.plain), except
    # fp32 master weights in a run whose rollouts decode a trained role (GRPO, RLOO, PPO, on-policy distillation)
    # or under fp16; "torch" does so for those too, "deepspeed" keeps the engine.
    single_process_engine: str = "auto"
    resume_from_checkpoint: str | None = None  # a checkpoint dir, or "latest" in output_dir
    # A reused output_dir (metrics.jsonl or checkpoints in it) is refused unless this is set (it then
    # clears them) or the run resumes. TrainingArguments' names and meanings.
    overwrite_output_dir: bool = False
    save_total_limit: int | None = None  # keep only the newest N checkpoints; None keeps all
    disable_tqdm: bool = False
    # TrainingArguments' flags, as TRL users pass them. bf16/fp16 set mixed_precision. Evaluation
    # runs when a trainer is given eval data; the scripts give it none under eval_strategy "no"
    # (TRL's scripts do the same) and every eval_steps steps otherwise.
    bf16: bool = False
    fp16: bool = False
    eval_strategy: str = "no"  # "no" | "steps" | "epoch"
    push_to_hub: bool = False  # the scripts upload the final model with huggingface_hub
    hub_model_id: str | None = None  # default: the output dir's name under your account
    hub_private_repo: bool | None = None

    _algorithm = "this trainer"
    _evaluates = True  # False: the trainer has no evaluation, and eval_strategy is refused by name

    def __post_init__(self) -> None:
        validate_train_config(self)


def validate_train_config(cfg: TrainConfig) -> None:
    """Bad values are refused here, before any process group or model, each with the flag to fix;
    bf16/fp16 are folded into mixed_precision and eval_steps defaults to logging_steps (TRL's rule)."""
    if isinstance(cfg, LoraFields):
        check_lora_fields(cfg)
    at_least_one = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                    "logging_steps")
    for name in at_least_one:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {getattr(cfg, name)!r}: set --{name} 1 or more")
    for name in ("eval_steps", "save_steps"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1 or unset, got {value}: set --{name} to a positive number of steps")
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "warmup_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}: set --{name} to 0 or more")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(cfg, name)}: AdamW's default is 0.9 / 0.999")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm < 0:
        raise ConfigError(f"max_grad_norm must be >= 0, got {cfg.max_grad_norm}: set --max_grad_norm 0 to turn clipping off")
    if cfg.max_steps <= 0 and not cfg.num_train_epochs > 0:
        raise ConfigError(f"num_train_epochs is {cfg.num_train_epochs} and max_steps is unset: set one of them")
    if cfg.eval_strategy not in ("no", "steps", "epoch"):
        raise ConfigError(f"eval_strategy must be 'no', 'steps' or 'epoch', got {cfg.eval_strategy!r}")
    if cfg.eval_strategy != "no" and not cfg._evaluates:
        raise ConfigError(f"{cfg._algorithm} does not evaluate (it has no eval dataset), but eval_strategy is "
                          f"{cfg.eval_strategy!r}: set --eval_strategy no")
    if cfg.eval_strategy == "steps" and cfg.eval_steps is None:
        cfg.eval_steps = cfg.logging_steps
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("bf16 and fp16 are both set: keep one of --bf16 / --fp16")
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None
    if precision and cfg.mixed_precision not in (None, precision):
        raise ConfigError(f"--{precision} contradicts mixed_precision {cfg.mixed_precision!r}: keep one of them")
    # Resolved here, so posttrain_config.json records the precision the run uses (accelerate launch's setting
    # when none is given, which the Session would read the same way).
    cfg.mixed_precision = precision or cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if cfg.mixed_precision not in (None, "no", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {cfg.mixed_precision!r}")
    if cfg.master_weights not in ("fp32", "bf16"):
        raise ConfigError(f"master_weights must be 'fp32' or 'bf16', got {cfg.master_weights!r}: set --master_weights fp32 "
                          "(fp32 master weights and Adam states) or bf16")
    if cfg.master_weights == "bf16" and cfg.mixed_precision != "bf16":
        raise ConfigError(f"master_weights bf16 keeps the weights and Adam states in bf16, which needs bf16 mixed precision "
                          f"(mixed_precision is {cfg.mixed_precision!r}): add --bf16 true, or set --master_weights fp32")
    from transformers import SchedulerType

    schedulers = [t.value for t in SchedulerType]
    if cfg.lr_scheduler_type not in schedulers:
        raise ConfigError(f"unknown lr_scheduler_type {cfg.lr_scheduler_type!r}: choose from {', '.join(schedulers)}")


def world_size() -> int:
    """The number of processes, from the launcher's environment: configs and step counts need it
    before the session (and process group) exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def steps_for_rows(cfg: TrainConfig, n_rows: int, noun: str = "rows") -> int:
    """Optimizer steps of a run over ``n_rows`` prepared rows (``max_steps``, else whole global
    batches per epoch times ``num_train_epochs``); fewer rows than one global batch is refused."""
    world = world_size()
    global_batch = cfg.per_device_train_batch_size * world
    if n_rows < global_batch:
        raise ConfigError(f"train_dataset has {n_rows} usable {noun}, fewer than one global batch "
                          f"({cfg.per_device_train_batch_size} per device x {world} processes): lower "
                          f"--per_device_train_batch_size or give more {noun}")
    per_epoch = max(1, n_rows // global_batch // cfg.gradient_accumulation_steps)
    return cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * per_epoch)


def make_session(cfg: TrainConfig, trained: list[str], frozen: list[str], total_steps: int | None = None,
                 decoded: list[str] | tuple[str, ...] = ()) -> Session:
    """The run's Session; ``decoded``: the trained roles its rollout engine decodes from (Role.decoded:
    the trainer's ``roles["decoded"]``, which decides the one-process engine at fp32 master weights)."""
    # Everything the run is given is checked before prepare_output_dir clears anything.
    checks.check_placement(cfg.mix, cfg.role_configs)
    roles = roles_for(trained, frozen, mix=cfg.mix, configs=cfg.role_configs, master_weights=cfg.master_weights,
                      decoded=decoded)
    check_engine_setting(cfg.single_process_engine, world_size=world_size(),
                         mixed_precision=cfg.mixed_precision, own_configs=[r.name for r in roles if r.trains and not r.from_mix])
    checks.check_output_dir(cfg.output_dir)
    checks.check_resume_path(cfg.resume_from_checkpoint, cfg.output_dir)
    prepare_output_dir(cfg)  # before any model loads: a reused dir or a missing checkpoint fails fast
    return Session(
        roles,
        micro_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm,
        mixed_precision=cfg.mixed_precision,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        log_with=cfg.report_to or None,
        project_dir=cfg.output_dir,
        single_process_engine=cfg.single_process_engine,
    )


def given_once(obj: Any, path: Any, what: str, arg: str, field: str) -> Any:
    """A model a trainer takes either as an object (``arg=``) or by its config's ``field``; both
    given is one sentence. Returns the one given (None when neither is)."""
    if obj is not None and path is not None:
        raise ConfigError(f"the {what} is given twice ({arg}= and {field}): give one of them")
    return obj if obj is not None else path


def one_tokenizer(processing_class: Any, tokenizer: Any) -> Any:
    """The tokenizer under TRL's name (``processing_class=``) or this trainer's earlier one
    (``tokenizer=``); both is one sentence."""
    return given_once(processing_class, tokenizer, "tokenizer", "processing_class", "tokenizer=")


def distinct_objects(**models: Any) -> None:
    """Each role needs a model of its own: one object given for two roles would be trained and
    frozen (or trained twice) at once, as TRL refuses ``ref_model is model``."""
    seen: dict[int, str] = {}
    for name, model in models.items():
        if isinstance(model, torch.nn.Module):
            if id(model) in seen:
                raise ConfigError(f"{seen[id(model)]}= and {name}= are the same object: each role needs a model of "
                                  f"its own, so pass a copy (copy.deepcopy) or leave {name} unset")
            seen[id(model)] = name


def policy_source(cfg: Any, model: Any, processing_class: Any,
                  load_tokenizer: Callable[[str], Any] | None = None, *,
                  default: Callable[[], Any] | None = None, what: str = "policy") -> tuple[Any, Any, str]:
    """The policy as a trainer was given it, as TRL's trainers take it: a model object or a hub
    name / local path (``model``, else ``cfg.model_name_or_path``, else ``default()``, the tiny
    default's SFT policy unless given); returns it, its tokenizer (``processing_class``, else
    ``load_tokenizer`` of the path) and its name. ``what`` names the model in refusals."""
    load_tokenizer = load_tokenizer or tiny.load_tokenizer
    model = given_once(model, cfg.model_name_or_path, what, "model", "model_name_or_path")
    if isinstance(model, torch.nn.Module):
        name = str(getattr(model, "name_or_path", "") or "")
        if getattr(cfg, "model_init_kwargs", None):  # TRL warns the same way
            logging.getLogger(__name__).warning("model_init_kwargs is set but the %s is already built (model=): "
                                                "model_init_kwargs is ignored", what)
        if processing_class is None:
            if not (name and Path(name).is_dir()):
                raise ConfigError("a model object needs its tokenizer: pass processing_class=")
            processing_class = load_tokenizer(name)
        return model, processing_class, name or type(model).__name__
    path = str(model or (default or tiny.sft_model_path)())
    return path, processing_class or load_tokenizer(path), path


def model_config(source: Any) -> Any:
    """A model's config, from the object itself or read from its path (nothing loads)."""
    if isinstance(source, torch.nn.Module):
        return source.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source)


def reference_source(ref_model: Any, policy: Any) -> Any:
    """The reference model's source: its own object or path, else the policy's initial weights (the
    policy's path loaded again, or a copy of a given policy object, taken before it trains or takes
    adapters)."""
    if isinstance(ref_model, torch.nn.Module) or ref_model:
        return ref_model
    return copy.deepcopy(policy) if isinstance(policy, torch.nn.Module) else policy


def optimizer_and_scheduler(model: torch.nn.Module, cfg: TrainConfig, total_steps: int, lr: float | None = None):
    """AdamW over trainable parameters and a transformers LR schedule stepped per optimizer step."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr or cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps,
                          num_training_steps=max(1, total_steps))
    return opt, sched


def enable_gradient_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """Recompute a trained model's activations in backward (TRL's default for DPO, GRPO and RLOO).
    It acts only in a forward with gradients in train mode; no_grad passes (generation, old or
    reference log-probs) run the layers as they are. ``use_reentrant``: TRL's setting for LoRA
    under ZeRO-3 (non-reentrant recomputation meets frozen ZeRO-3 shards, DeepSpeed#4332)."""
    # transformers 5.24 renamed it activation checkpointing; the GPU image's 5.17 may only have the old name.
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def mix_seed(*parts: int | str) -> int:
    """One seed from the run's seed and where it is used (a name, the epoch, step, rank, ...): a
    stable hash, the same in every process and every run, so that data order and sampling depend
    only on that position (a resumed run draws what the uninterrupted one drew)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The same permutation on every rank for a given (seed, epoch): TRL's order, i.e. accelerate's
    ``SeedableRandomSampler`` under transformers' Trainer, a generator seeded with seed + epoch."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_batches(n: int, batch_size: int, seed: int, rank: int, world: int, start: int = 0) -> Iterator[list[int]]:
    """Endless per-rank micro-batches of example indices: each global batch of
    ``batch_size * world`` consecutive examples of an epoch's permutation is split by rank, so the
    data seen does not depend on placement and a resumed run continues at micro-batch ``start``."""
    per_epoch = max(1, n // (batch_size * world))
    step = start
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        base = k * batch_size * world + rank * batch_size
        yield order[base : base + batch_size]
        step += 1


class Phases:
    """Wall time per phase (``time/generate``, ``time/score``, ...), synchronised so that a
    phase's time includes its device work."""

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


def sum_over_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every process (accelerate's reduce, on a copy)."""
    return session.accelerator.reduce(t, reduction="sum") if session.num_processes > 1 else t


def gather_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape on each), concatenated in rank order (accelerate's gather)."""
    return session.accelerator.gather(t.contiguous()) if session.num_processes > 1 else t


def mean_over_ranks(session: Session, values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over processes (one all-reduce)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=session.device)
    return dict(zip(keys, (sum_over_ranks(session, t) / session.num_processes).tolist()))


class RunLog:
    """Progress bar, ``metrics.jsonl`` in the output dir, and accelerate trackers.

    ``shown``: the metrics the progress bar shows (the ones a user watches: the reward for RL
    trainers, loss and accuracy for DPO); with ``disable_tqdm`` they are printed as one line per
    logged row instead (rank 0), as TRL prints its logs then. ``history`` holds the whole run's
    rows: after a resume, the rows kept in ``metrics.jsonl`` up to the checkpoint come first.
    """

    def __init__(self, session: Session, cfg: TrainConfig, total: int, name: str, start: int = 0,
                 shown: tuple[str, ...] = ("loss",)) -> None:
        self.session, self.cfg, self.name = session, cfg, name
        self.out = Path(cfg.output_dir)
        self.main = session.is_main_process
        self.total, self.done, self.shown = total, start, shown
        self.postfix: dict[str, str] = {}
        self.closed = False
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            # Not config.json: the trained model is saved beside it, in output_dir itself (as TRL).
            (self.out / SETTINGS_FILE).write_text(json.dumps(_jsonable(asdict(cfg)), indent=1))
            # A resumed run continues the files at its checkpoint's step: rows the dead run wrote
            # after it are dropped (they are written again).
            truncate_jsonl(self.out / "metrics.jsonl", start)
            truncate_jsonl(self.out / "samples.jsonl", start)
        self.history: list[dict] = []
        if start > 0:
            session.accelerator.wait_for_everyone()  # read once rank 0 has cut the file back
            self.history = read_rows(self.out / "metrics.jsonl")
        if cfg.report_to:
            # Trackers (TensorBoard's hparams) take scalars only.
            scalars = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in asdict(cfg).items()}
            session.accelerator.init_trackers(name, config=scalars)
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
        """The per-row line printed without a progress bar: ``grpo step 3/60  reward 0.51  loss 0.0012 ...``."""
        extra = {k: _short(metrics[k]) for k in ("learning_rate", "lr", "epoch") if k in metrics}
        parts = [f"{self.name} step {step}/{self.total}", *(f"{k} {v}" for k, v in {**shown, **extra}.items())]
        return "  ".join(parts)

    def advance(self) -> None:
        """One optimizer step (update) done."""
        self.done += 1
        self.bar.update(1)

    def interrupted(self) -> str:
        """The line an interrupt prints: the step reached and the checkpoint to resume from."""
        self.bar.close()
        latest = latest_checkpoint(self.cfg.output_dir)
        if latest is not None:
            how = f"resume with --resume_from_checkpoint latest ({latest.name})"
        else:
            how = "no checkpoint yet" + ("" if self.cfg.save_steps else " (--save_steps N writes them)")
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
        # Not accelerator.end_training(): in accelerate 1.15 it also destroys the process group,
        # which saving or evaluating after training still needs.
        for tracker in self.session.accelerator.trackers:
            tracker.finish()
        if self.main:  # as TRL's trainers do: a model card (and the learning curves) in the output dir
            write_model_card(self.out, self.cfg, self.name, self.session)


def _label(key: str) -> str:
    """A metric's name on the progress bar: ``rewards/accuracies`` -> ``accuracies``,
    ``eval/rewards/accuracies`` -> ``eval_accuracies``, ``lm/loss`` -> ``lm_loss``."""
    return key.replace("objective/", "").replace("rewards/", "").replace("/", "_")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def truncate_jsonl(path: Path, step: int) -> int:
    """Keep the rows of a metrics/samples file logged at ``step`` or before (by their "step" or
    "update" key); returns how many were dropped, a line cut short by a killed run among them."""
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
    """config.json's values: JSON types as they are, a non-finite float and anything else as its text."""
    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return repr(v)
        return v if isinstance(v, (int, float, str, bool, list, dict, type(None))) else str(v)

    return {k: plain(v) for k, v in d.items()}


_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def save_trained_model(session: Session, role: str, directory: str | os.PathLike, tokenizer: Any = None,
                       merge_adapters: bool = False) -> Path:
    """A trained role's final model in Hugging Face format in ``directory``: the output dir itself
    for the model a run trains (TRL's layout, so ``from_pretrained(output_dir)`` loads it), and
    ``output_dir/<role>`` for any other trained role. A LoRA role saves its adapter (PEFT format:
    ``PeftModel.from_pretrained(base, directory)`` loads it), or with ``merge_adapters`` the base
    with the adapters merged in, a plain transformers model (its full weights gathered under
    ZeRO-3, written by rank 0). An adapter an earlier run left there would make
    ``from_pretrained`` load it instead of a full model saved over it, so a full save removes it first."""
    path = Path(directory)
    adapted = has_adapters(session.unwrap(role))
    if session.is_main_process and (merge_adapters or not adapted):
        for name in _ADAPTER_FILES:
            (path / name).unlink(missing_ok=True)
    if not (adapted and merge_adapters):
        session.save_pretrained(role, path, tokenizer=tokenizer)
        return path
    state_dict = session.state_dict(role)  # collective; under ZeRO-3 only rank 0 gets the weights
    if session.is_main_process:
        save_merged(session.unwrap(role), state_dict, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    session.accelerator.wait_for_everyone()
    return path
