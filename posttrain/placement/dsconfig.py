"""DeepSpeed configs: read with useful errors, every ``"auto"`` filled up front, unfillable ones named."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError

# The presets ship inside the package (package-data), so a name resolves in an installed wheel too.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "presets" / "deepspeed"

# Keys that only make sense for a model that trains.
TRAINING_KEYS = ("optimizer", "scheduler", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size")

# DeepSpeed's defaults for the ZeRO-3 keys accelerate cannot fill (its multi-model guide writes "auto").
ZERO3_DEFAULTS = {"stage3_max_live_parameters": int(1e9), "stage3_max_reuse_distance": int(1e9)}
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

# A trained role's optimizer precision: "fp32" master weights and Adam states beside the bf16 model
# (DeepSpeed's default), or "bf16" ones (TRL's numerics with a bf16 model and no DeepSpeed).
MASTER_WEIGHTS = ("fp32", "bf16")
BF16_STATE_KEYS = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def config_path(name: str) -> Path:
    """A preset name (``zero3_inference``) or a path to a JSON file."""
    path = Path(name)
    if path.suffix != ".json" and not path.exists():
        path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        import difflib

        names = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        near = difflib.get_close_matches(path.stem, names, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"DeepSpeed config {name!r} not found{hint}: give a path to a JSON file or one of: "
                          f"{', '.join(names)}")
    return path


def read_config(source: str | Path | dict) -> dict:
    """A deep copy of a config given as a dict, a preset name or a JSON path."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = config_path(str(source))
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        pos, hint = err.pos, ""
        before = text[: err.pos].rstrip()
        if before.endswith(",") and text[err.pos : err.pos + 1] in "}]":
            pos = len(before) - 1  # point at the comma itself
            hint = " (a trailing comma: JSON does not allow one before '}' or ']'; delete it)"
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        raise ConfigError(f"{path}:{line}:{col}: invalid "
                          f"JSON: {err.msg}{hint}\n    {text.splitlines()[line - 1].strip()}") from None


def get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def zero_stage(cfg: dict) -> int:
    return int(get(cfg, "zero_optimization.stage", 0))


def params_offloaded(cfg: dict) -> bool:
    """Whether ZeRO-3 keeps the parameters off the device (``offload_param.device`` cpu or nvme)."""
    return str(get(cfg, "zero_optimization.offload_param.device", "none") or "none").lower() != "none"


def master_weights(cfg: dict) -> str:
    """"bf16" when the config keeps bf16 master weights (and so bf16 optimizer states), else "fp32"."""
    return "bf16" if get(cfg, "bf16.bf16_master_weights_and_grads", False) else "fp32"


def with_master_weights(cfg: dict, precision: str, where: str) -> dict:
    """A trained role's config with the optimizer precision asked for (a copy)."""
    if precision not in MASTER_WEIGHTS:
        raise ConfigError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}, got {precision!r}")
    cfg = copy.deepcopy(cfg)
    have = master_weights(cfg)
    if precision == "fp32" and have == "bf16":
        raise ConfigError(f"{where}: its DeepSpeed config sets bf16_master_weights_and_grads but master_weights is "
                          "fp32: set master_weights: bf16, or remove the bf16_* keys from the config")
    if precision == "bf16":
        bf16 = cfg.get("bf16")
        cfg["bf16"] = {**(bf16 if isinstance(bf16, dict) else {"enabled": "auto"}), **BF16_STATE_KEYS}
    return cfg


def check_master_weights(cfg: dict, where: str, mixed_precision: str) -> None:
    """Refuse, with the fix, the bf16-state configs DeepSpeed would reject with an assert."""
    bf16 = cfg.get("bf16") if isinstance(cfg.get("bf16"), dict) else {}
    master, states = bool(bf16.get("bf16_master_weights_and_grads")), bool(bf16.get("bf16_optimizer_states"))
    if not (master or states):
        return
    offload = str(get(cfg, "zero_optimization.offload_optimizer.device", "none") or "none").lower() != "none"
    if mixed_precision != "bf16":
        raise ConfigError(f"{where}: bf16 master weights and optimizer states need bf16 mixed precision, but it is "
                          f"{mixed_precision!r}: pass --bf16 true (mixed_precision: bf16), or keep master_weights fp32")
    if zero_stage(cfg) not in (1, 2, 3):
        raise ConfigError(f"{where}: DeepSpeed keeps bf16 master weights only under ZeRO stages 1-3, and this config "
                          f"is stage {zero_stage(cfg)}: use zero2_train_bf16_states, or keep master_weights fp32")
    if not (master and states) or offload:
        raise ConfigError(f"{where}: DeepSpeed 0.19 takes bf16 master weights on the device only together with "
                          "bf16_optimizer_states and without offload_optimizer (otherwise it requires DeepSpeedCPUAdam): "
                          "set both bf16_master_weights_and_grads and bf16_optimizer_states and drop offload_optimizer, "
                          "or keep master_weights fp32")


def one_rank(cfg: dict, trains: bool) -> tuple[dict, str | None]:
    """A role's config made cheapest for a one-process world (same numerics), and a note of what changed."""
    stage = zero_stage(cfg)
    if not trains and stage == 3 and not params_offloaded(cfg):
        out = {k: copy.deepcopy(v) for k, v in cfg.items() if k != "zero_optimization"}
        out["zero_optimization"] = {"stage": 0}
        return out, "replicated (stage 0): a ZeRO-3 shard of one rank is the whole model"
    zero = cfg.get("zero_optimization") or {}
    if trains and stage in (1, 2):
        changes = {k: False for k in ("overlap_comm", "reduce_scatter") if zero.get(k, k == "reduce_scatter")}
        if changes:
            out = copy.deepcopy(cfg)
            out["zero_optimization"].update(changes)
            return out, f"ZeRO-{stage} with {', '.join(f'{k}=false' for k in changes)} (nothing to overlap or scatter)"
    return cfg, None


def is_inference_only(cfg: dict) -> bool:
    return not any(key in cfg for key in TRAINING_KEYS)


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "auto" else []


def _set_if_auto(cfg: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    if node.get(leaf) == "auto":
        node[leaf] = value


def resolve(cfg: dict, *, role: str, trains: bool, micro_batch_size: int, gradient_accumulation_steps: int,
            world_size: int, mixed_precision: str, max_grad_norm: float | None = None,
            learning_rate: float | None = None, weight_decay: float | None = None,
            warmup_steps: int | None = None, total_steps: int | None = None,
            memory_efficient_linear: bool = False) -> dict:
    """Fill model-free ``"auto"``s (hidden sizes: :func:`resolve_hidden_size`); make frozen configs safe."""
    cfg = copy.deepcopy(cfg)
    where = f"role {role!r}"
    zero = cfg.setdefault("zero_optimization", {})
    if not trains:
        for key in ("optimizer", "scheduler"):
            if key in cfg:
                raise ConfigError(f"{where} is frozen but its DeepSpeed config has an {key!r} block: remove "
                                  "the block, or declare the role with trains=True")
        # accelerate copies the prepared plugin's accumulation into the process-wide state.
        cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
        cfg["gradient_accumulation_steps"] = gradient_accumulation_steps
        cfg.pop("train_batch_size", None)
        cfg.pop("gradient_clipping", None)
        # DeepSpeed's memory-efficient linear patches F.linear process-wide, slowing the policy too.
        if zero_stage(cfg) == 3 and not memory_efficient_linear:
            zero.setdefault("memory_efficient_linear", False)
    elif is_inference_only(cfg):
        raise ConfigError(f"{where} trains but its DeepSpeed config is inference-only (none "
                          f"of {', '.join(TRAINING_KEYS)}): use a training config such as the preset "
                          f"'zero2_train' ({CONFIG_DIR / 'zero2_train.json'}), or declare the role frozen")

    check_leaf_modules(cfg, where)
    check_master_weights(cfg, where, mixed_precision)
    for key, value in ZERO3_DEFAULTS.items():
        _set_if_auto(cfg, f"zero_optimization.{key}", value)
    half = {"bf16": mixed_precision == "bf16", "fp16": mixed_precision == "fp16"}
    for key, on in half.items():
        _set_if_auto(cfg, f"{key}.enabled", on)
    fills = {"train_micro_batch_size_per_gpu": micro_batch_size,
             "gradient_accumulation_steps": gradient_accumulation_steps,
             "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
             "gradient_clipping": max_grad_norm if max_grad_norm is not None else 1.0,
             "optimizer.params.lr": learning_rate, "optimizer.params.weight_decay": weight_decay,
             "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": learning_rate,
             "scheduler.params.warmup_num_steps": max(1, warmup_steps or 0) if warmup_steps is not None
             else None, "scheduler.params.total_num_steps": total_steps}
    for dotted, value in fills.items():
        if value is not None:
            _set_if_auto(cfg, dotted, value)
    # A hard-coded value other than the trainer's would break DeepSpeed's batch arithmetic.
    for key, want in (("train_micro_batch_size_per_gpu", micro_batch_size),
                      ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if trains and cfg.get(key, want) != want:
            raise ConfigError(f"{where}: {key} is {cfg.get(key)} in the DeepSpeed config but the trainer "
                              f"uses {want}: set it to \"auto\" or to {want}")
    check_auto(cfg, role, allow=HIDDEN_SIZE_KEYS)
    return cfg


def check_leaf_modules(cfg: dict, where: str) -> None:
    """Refuse ZeRO-3 leaf modules by size on GPU: DeepSpeed 0.19 skips record_stream (benchmarks/NOTES.md)."""
    import torch

    zero = cfg.get("zero_optimization") or {}
    threshold = zero.get("stage3_module_granularity_threshold", zero.get("module_granularity_threshold", 0))
    if zero_stage(cfg) == 3 and isinstance(threshold, (int, float)) and threshold > 0 and torch.cuda.is_available():
        raise ConfigError(f"{where}: stage3_module_granularity_threshold={threshold} makes DeepSpeed 0.19's "
                          "ZeRO-3 release gathered parameters while the GPU may still read them (wrong "
                          "outputs, see benchmarks/NOTES.md): remove the key; for a fast frozen ZeRO-3 "
                          "model keep posttrain's default fast_frozen path")


def resolve_hidden_size(cfg: dict, hidden_size: int | None, role: str) -> None:
    """Fill the bucket sizes from the model's hidden size, in place (accelerate's formulas)."""
    if hidden_size is not None:
        h = int(hidden_size)
        _set_if_auto(cfg, "zero_optimization.reduce_bucket_size", h * h)
        _set_if_auto(cfg, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h))
        _set_if_auto(cfg, "zero_optimization.stage3_param_persistence_threshold", 10 * h)
    check_auto(cfg, role)


def check_auto(cfg: dict, role: str, allow: tuple[str, ...] = ()) -> None:
    left = [p for p in _auto_paths(cfg) if p.split(".")[-1] not in allow]
    if left:
        raise ConfigError(f"role {role!r}: nothing can fill the DeepSpeed config value(s) {', '.join(left)} "
                          "set to \"auto\": replace each with a number (DeepSpeed's documentation gives the "
                          "defaults)")


def hidden_size_of(model_config: Any) -> int | None:
    if hasattr(model_config, "hidden_size"):
        return int(model_config.hidden_size)
    if hasattr(model_config, "hidden_sizes"):
        return int(max(model_config.hidden_sizes))
    if hasattr(model_config, "get_text_config"):
        text = model_config.get_text_config()
        if text is not model_config:
            return hidden_size_of(text)
    return None
