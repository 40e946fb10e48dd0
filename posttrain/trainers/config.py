"""The base config every trainer shares (TRL's ``TrainingArguments`` fields), its checks and Session."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from posttrain import checks
from posttrain.errors import ConfigError
from posttrain.models.lora import LoraFields, check_lora_fields
from posttrain.placement.plain import check_setting as check_engine_setting
from posttrain.placement.ranks import world_size
from posttrain.placement.roles import DEFAULT_MIX, check_placement, roles_for
from posttrain.placement.session import Session
from posttrain.run.output_dir import prepare_output_dir


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
    logging_steps: int = 1  # TRL's is 10 (DPOConfig keeps it); the run summaries read every step
    eval_steps: int | None = None
    save_steps: int | None = None  # checkpoints are large (every trained role's state): asked for
    report_to: list[str] = field(default_factory=list)
    # "no" | "bf16" | "fp16"; None: accelerate launch's setting, else fp32 (the same command runs on CPU).
    mixed_precision: str | None = None
    mix: str = DEFAULT_MIX  # a placement mix name (roles.MIXES)
    # Per-role DeepSpeed configs (preset name or JSON path); YAML only: TrlParser cannot parse a dict flag.
    role_configs: dict[str, str] = field(default_factory=dict)
    # Trained roles' master weights and Adam states: "fp32", or "bf16" (needs bf16 and ZeRO 1-3).
    master_weights: str = "fp32"
    # One process: "auto" trains without a DeepSpeed engine except fp32 master weights in a run that
    # decodes a trained role, or fp16; "torch" always does, "deepspeed" keeps the engine.
    single_process_engine: str = "auto"
    resume_from_checkpoint: str | None = None  # a checkpoint dir, or "latest" in output_dir
    overwrite_output_dir: bool = False  # else a reused output_dir is refused unless the run resumes
    save_total_limit: int | None = None  # keep only the newest N checkpoints; None keeps all
    disable_tqdm: bool = False
    # TrainingArguments' flags: bf16/fp16 set mixed_precision.
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
    """Refuse bad values before any process group or model, each with the flag to fix; fold bf16/fp16
    into mixed_precision and default eval_steps to logging_steps (TRL's rule)."""
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
    # Resolved here so that posttrain_config.json records the precision the run uses.
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


def steps_for_rows(cfg: TrainConfig, n_rows: int, noun: str = "rows") -> int:
    """Optimizer steps of a run over ``n_rows`` rows; fewer rows than one global batch is refused."""
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
    """The run's Session; ``decoded``: the trained roles its rollout engine decodes from."""
    # Everything is checked before prepare_output_dir clears anything.
    check_placement(cfg.mix, cfg.role_configs)
    roles = roles_for(trained, frozen, mix=cfg.mix, configs=cfg.role_configs, master_weights=cfg.master_weights,
                      decoded=decoded)
    check_engine_setting(cfg.single_process_engine, world_size=world_size(),
                         mixed_precision=cfg.mixed_precision, own_configs=[r.name for r in roles if r.trains and not r.from_mix])
    checks.check_output_dir(cfg.output_dir)
    checks.check_resume_path(cfg.resume_from_checkpoint, cfg.output_dir)
    prepare_output_dir(cfg)  # before any model loads: a reused dir or a missing checkpoint fails fast
    return Session(roles, micro_batch_size=cfg.per_device_train_batch_size,
                   gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                   max_grad_norm=cfg.max_grad_norm, mixed_precision=cfg.mixed_precision,
                   learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                   warmup_steps=cfg.warmup_steps, total_steps=total_steps, log_with=cfg.report_to or None,
                   project_dir=cfg.output_dir, single_process_engine=cfg.single_process_engine)
