"""The base config every trainer shares (TRL's ``TrainingArguments`` fields), its checks and Session."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import TrainingArguments

from posttrain import checks
from posttrain.data.order import Schedule, TrainLoader
from posttrain.errors import ConfigError
from posttrain.models.setup import warmup_steps
from posttrain.placement.plain import check_setting as check_engine_setting
from posttrain.placement.ranks import world_size
from posttrain.placement.roles import DEFAULT_MIX, check_placement, roles_for
from posttrain.placement.session import Session
from posttrain.run.output_dir import plan_output_dir
from posttrain.trainers.trl_fields import check_trl_fields


@dataclass
class TrainConfig:
    """posttrain's fields beside TRL's. Each trainer's config subclasses this and TRL's config (TRL's
    fields, names, defaults and help, so ``TrlParser`` takes it beside ``ModelConfig``); its
    ``__post_init__`` is posttrain's: TrainingArguments' would set up devices before the placement is known."""

    mix: str = DEFAULT_MIX  # a placement mix name (roles.MIXES)
    # Per-role DeepSpeed configs (preset name or JSON path); YAML only: TrlParser cannot parse a dict flag.
    role_configs: dict[str, str] = field(default_factory=dict)
    # Trained roles' master weights and Adam states: "fp32", or "bf16" (needs bf16 and ZeRO 1-3).
    master_weights: str = "fp32"
    # One process: "auto" trains without a DeepSpeed engine except fp32 master weights in a run that
    # decodes a trained role, or fp16; "torch" always does, "deepspeed" keeps the engine.
    single_process_engine: str = "auto"
    # "no" | "bf16" | "fp16"; None: bf16/fp16, else accelerate launch's setting, else TRL's default.
    mixed_precision: str | None = None
    overwrite_output_dir: bool = False  # else a reused output_dir is refused unless the run resumes
    # Final save: False keeps the PEFT adapter (as TRL); True saves a plain model with adapters merged in.
    merge_adapters: bool = False

    _algorithm: ClassVar[str] = "this trainer"
    _evaluates: ClassVar[bool] = True  # False: no evaluation, and eval_strategy is refused by name
    _epochs: ClassVar[bool] = True  # False: no epochs of optimizer steps, and save_strategy epoch is refused
    _trl_works: ClassVar[tuple[str, ...]] = ()  # the TRL config's own fields that take effect
    _trl_refused: ClassVar[dict[str, str]] = {}  # the TRL config's own fields refused, with the reason

    @classmethod
    def trl_config(cls) -> type:
        """The TRL (or transformers) config this one extends."""
        return next(b for b in cls.__mro__ if issubclass(b, TrainingArguments) and not issubclass(b, TrainConfig))

    def __post_init__(self) -> None:
        resolve_training_arguments(self)
        check_trl_fields(self)
        validate_train_config(self)


_DICT_FIELDS = ("model_init_kwargs", "ref_model_init_kwargs", "teacher_model_init_kwargs", "generation_kwargs",
                "chat_template_kwargs", "role_configs", "lr_scheduler_kwargs", "gradient_checkpointing_kwargs")


@dataclass
class LoopConfig(TrainConfig, TrainingArguments):
    """TrainingArguments plus posttrain's fields: the config of a loop that has no TRL counterpart."""


def resolve_training_arguments(cfg: Any) -> None:
    """TrainingArguments' own resolutions that posttrain reads: output dir, trackers, progress bar."""
    if cfg.output_dir is None:
        cfg.output_dir = "trainer_output"  # TrainingArguments' default
    cfg.output_dir = str(cfg.output_dir)
    report = cfg.report_to
    report = [report] if isinstance(report, str) else list(report or [])
    cfg.report_to = [] if report in ([], ["none"]) else report
    cfg.disable_tqdm = bool(cfg.disable_tqdm)
    for name in ("logging_steps", "eval_steps", "save_steps"):  # TrainingArguments types them float (ratios)
        value = getattr(cfg, name)
        if isinstance(value, float) and value.is_integer():
            setattr(cfg, name, int(value))
    for name in _DICT_FIELDS:  # a JSON string from the command line, as TrainingArguments takes it
        value = getattr(cfg, name, None)
        if isinstance(value, str):
            try:
                setattr(cfg, name, json.loads(value))
            except json.JSONDecodeError as err:
                raise ConfigError(f"{name} {value!r} is not a JSON dict ({err.msg}): write it as "
                                  f"--{name} '{{\"dtype\": \"bfloat16\"}}'") from None
    cfg.gradient_checkpointing = bool(cfg.gradient_checkpointing)
    for name in ("logging_strategy", "save_strategy", "eval_strategy", "lr_scheduler_type", "optim"):
        value = getattr(cfg, name, None)  # TrlParser and YAML give strings; transformers' enums also work
        setattr(cfg, name, getattr(value, "value", value))
    if cfg.tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    # transformers' should_log: the main process of each node (log_on_each_node) or of the run logs at log_level,
    # the others at log_level_replica
    main = int(os.environ.get("LOCAL_RANK" if cfg.log_on_each_node else "RANK", "0")) == 0
    level = cfg.log_level if main else cfg.log_level_replica
    if level != "passive":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(hf_logging.get_log_levels_dict()[level])


def pad_multiple(value: Any) -> int | None:
    """TRL's ``pad_to_multiple_of``: "auto" (128 on Neuron devices only) -> None; the command line's string -> int."""
    if isinstance(value, str):
        if value == "auto" or value.lower() in ("none", "null"):
            return None
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"pad_to_multiple_of must be a whole number or none, got {value!r}") from None
    if value is not None and value < 1:
        raise ConfigError(f"pad_to_multiple_of must be >= 1 or none, got {value}")
    return value


def validate_train_config(cfg: TrainConfig) -> None:
    """Refuse bad values before any process group or model, each with the flag to fix; fold bf16/fp16
    into mixed_precision and default eval_steps to logging_steps (TRL's rule)."""
    if hasattr(cfg, "pad_to_multiple_of"):
        cfg.pad_to_multiple_of = pad_multiple(cfg.pad_to_multiple_of)
    at_least_one = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                    "logging_steps")
    for name in at_least_one:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {getattr(cfg, name)!r}: set --{name} 1 or more")
    for name in ("eval_steps", "save_steps"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1 or unset, got {value}: set --{name} to a positive number of steps")
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "warmup_steps"):  # warmup_steps < 1: a ratio
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}: set --{name} to 0 or more")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(cfg, name)}: AdamW's default is 0.9 / 0.999")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm < 0:
        raise ConfigError(f"max_grad_norm must be >= 0, got {cfg.max_grad_norm}: set --max_grad_norm 0 to turn clipping off")
    if cfg.max_steps <= 0 and not cfg.num_train_epochs > 0:
        raise ConfigError(f"num_train_epochs is {cfg.num_train_epochs} and max_steps is unset: set one of them")
    if cfg.use_cpu and torch.cuda.is_available():
        raise ConfigError("use_cpu is set but this machine has a GPU, which posttrain uses: hide it with "
                          "CUDA_VISIBLE_DEVICES='' to train on the CPU, or drop --use_cpu")
    for name, allowed in (("logging_strategy", ("steps",)), ("save_strategy", ("steps", "epoch", "no")),
                          ("optim", ("adamw_torch", "adamw_torch_fused"))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} {getattr(cfg, name)!r} is not supported: posttrain takes "
                              f"{' or '.join(map(repr, allowed))}")
    if cfg.eval_strategy not in ("no", "steps", "epoch"):
        raise ConfigError(f"eval_strategy must be 'no', 'steps' or 'epoch', got {cfg.eval_strategy!r}")
    if cfg.eval_strategy != "no" and not cfg._evaluates:
        raise ConfigError(f"{cfg._algorithm} does not evaluate (it has no eval dataset), but eval_strategy is "
                          f"{cfg.eval_strategy!r}: set --eval_strategy no")
    if cfg.save_strategy == "epoch" and not cfg._epochs:
        raise ConfigError(f"{cfg._algorithm} steps over whole global batches, not epochs, but save_strategy is 'epoch': "
                          "set --save_strategy steps with --save_steps N")
    if cfg.eval_on_start and not cfg._evaluates:
        raise ConfigError(f"{cfg._algorithm} does not evaluate (it has no eval dataset), but eval_on_start is set: "
                          "drop --eval_on_start")
    if cfg.eval_strategy == "steps" and cfg.eval_steps is None:
        cfg.eval_steps = cfg.logging_steps
    empty = cfg.torch_empty_cache_steps
    if empty is not None and (isinstance(empty, bool) or not isinstance(empty, int) or empty < 1):
        raise ConfigError(f"torch_empty_cache_steps must be a whole number >= 1 or unset, got {empty!r}")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("bf16 and fp16 are both set: keep one of --bf16 / --fp16")
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None
    if precision and cfg.mixed_precision not in (None, precision):
        raise ConfigError(f"--{precision} contradicts mixed_precision {cfg.mixed_precision!r}: keep one of them")
    # TRL's default (bf16 unset) is bf16; on a device without bf16, where TRL refuses to start, fp32.
    default = "bf16" if cfg.bf16 is None and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # Resolved here so that posttrain_config.json records the precision the run uses.
    cfg.mixed_precision = (precision or cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")
                           or default)
    cfg.bf16, cfg.fp16 = cfg.mixed_precision == "bf16", cfg.mixed_precision == "fp16"
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
    check_scheduler_kwargs(cfg)


def check_eval_data(cfg: TrainConfig, eval_dataset: Any) -> None:
    """transformers' Trainer's rule, which TRL's trainers keep: evaluation asked for needs an eval_dataset."""
    if eval_dataset is None and (cfg.eval_strategy != "no" or cfg.eval_on_start):
        asked = f"eval_strategy is {cfg.eval_strategy!r}" if cfg.eval_strategy != "no" else "eval_on_start is set"
        raise ConfigError(f"{asked} but no eval_dataset was given: pass eval_dataset=, or set --eval_strategy no"
                          + (" and drop --eval_on_start" if cfg.eval_on_start else ""))


def check_scheduler_kwargs(cfg: Any) -> None:
    """``lr_scheduler_kwargs`` as transformers' Trainer passes them (``scheduler_specific_kwargs``), tried on a
    stand-in optimizer so that a missing or unknown one (``cosine_with_min_lr`` without ``min_lr_rate``) is one
    sentence before anything loads."""
    from transformers import get_scheduler

    kwargs = getattr(cfg, "lr_scheduler_kwargs", None) or None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"lr_scheduler_kwargs must be a dict, got {kwargs!r}: write it as --lr_scheduler_kwargs "
                          "'{\"min_lr_rate\": 0.1}'")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=1, num_training_steps=2,
                      scheduler_specific_kwargs=kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"lr_scheduler_type {cfg.lr_scheduler_type!r} with lr_scheduler_kwargs {kwargs!r}: {err}; "
                          "set the kwargs that schedule takes (transformers' get_scheduler)") from None


def row_schedule(cfg: TrainConfig, n_rows: int, noun: str = "rows", shuffle: bool = True
                 ) -> tuple[TrainLoader, Schedule]:
    """TRL's Trainer order over ``n_rows`` rows (``shuffle`` False: in order; seeded by ``data_seed`` or else
    ``seed``) and its optimizer steps (an epoch's leftover rows trained as a short last step, as TRL does); an
    empty dataset is refused."""
    if n_rows < 1:
        raise ConfigError(f"train_dataset has no usable {noun}: give at least one")
    # transformers' sampler draws with data_seed where set (TRL's GRPO, RLOO and distillation samplers do not)
    seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
    loader = TrainLoader.rows(n_rows, cfg.per_device_train_batch_size, world_size(), seed, shuffle)
    schedule = loader.schedule(cfg.gradient_accumulation_steps, cfg.num_train_epochs, cfg.max_steps)
    epoch_steps(cfg, schedule.steps_per_epoch)
    return loader, schedule


def epoch_steps(cfg: TrainConfig, steps_per_epoch: int) -> None:
    """``eval_strategy``/``save_strategy`` "epoch" as the loop runs them: ``eval_steps``/``save_steps`` set to the
    trainer's optimizer steps per epoch (TRL's count), so an evaluation or checkpoint follows each epoch's end."""
    if cfg.eval_strategy == "epoch":
        cfg.eval_steps = steps_per_epoch
    if cfg.save_strategy == "epoch":
        cfg.save_steps = steps_per_epoch


def saves(cfg: TrainConfig) -> bool:
    """Whether the run writes checkpoints (TrainingArguments' save_strategy and save_steps; under "epoch" the
    trainer sets save_steps to its steps per epoch)."""
    return cfg.save_strategy in ("steps", "epoch") and bool(cfg.save_steps)


def make_session(cfg: TrainConfig, trained: list[str], frozen: list[str], total_steps: int | None = None,
                 decoded: list[str] | tuple[str, ...] = ()) -> Session:
    """The run's Session; ``decoded``: the trained roles its rollout engine decodes from."""
    # Everything is checked before anything in the output dir is cleared (at train()).
    check_placement(cfg.mix, cfg.role_configs)
    roles = roles_for(trained, frozen, mix=cfg.mix, configs=cfg.role_configs, master_weights=cfg.master_weights,
                      decoded=decoded)
    generation_processes = getattr(cfg, "generation_processes", 0)  # GRPO/RLOO: ranks that only generate
    check_engine_setting(cfg.single_process_engine, world_size=world_size() - generation_processes,
                         mixed_precision=cfg.mixed_precision, own_configs=[r.name for r in roles if r.trains and not r.from_mix])
    checks.check_output_dir(cfg.output_dir)
    checks.check_resume_path(cfg.resume_from_checkpoint, cfg.output_dir)
    plan_output_dir(cfg)  # checked before any model loads; claimed (cleared, locked) only when train() starts
    return Session(roles, micro_batch_size=cfg.per_device_train_batch_size,
                   gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                   max_grad_norm=cfg.max_grad_norm, mixed_precision=cfg.mixed_precision,
                   learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                   warmup_steps=warmup_steps(cfg, total_steps), total_steps=total_steps, log_with=cfg.report_to or None,
                   project_dir=cfg.output_dir, single_process_engine=cfg.single_process_engine,
                   generation_processes=generation_processes)
