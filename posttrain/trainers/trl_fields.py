"""Every field of TRL's configs, accounted for: it takes effect in posttrain, or a value other than TRL's
default is refused with the reason. The README's table is generated from these (``field_table``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.errors import ConfigError

_DEEPSPEED = "posttrain places every model with its own DeepSpeed plugin: choose the placement with mix or role_configs"
_LOADER = "posttrain collates batches in the training process, without a DataLoader"
_EVAL_LOOP = "posttrain's evaluation reports the trainer's own metrics over the whole eval set"
_HUB = "posttrain uploads the final model once, when push_to_hub is set"
_LOGGING = "posttrain logs every logging_steps from the main process to metrics.jsonl and report_to's trackers"

# transformers.TrainingArguments: the fields that take effect.
TRAINING_ARGUMENTS_WORK = {
    "output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "gradient_checkpointing_kwargs", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "gradient_accumulation_steps", "max_grad_norm", "bf16", "fp16", "tf32", "gradient_checkpointing",
    "logging_strategy", "logging_steps", "logging_first_step",
    "disable_tqdm", "report_to", "run_name", "eval_strategy", "eval_steps", "per_device_eval_batch_size",
    "save_strategy", "save_steps", "save_total_limit", "push_to_hub", "hub_token", "hub_private_repo",
    "hub_model_id", "seed", "resume_from_checkpoint", "remove_unused_columns", "do_train", "do_eval", "do_predict",
    "local_rank", "log_level", "use_cpu", "enable_jit_checkpoint", "save_only_model",
    "torch_empty_cache_steps", "eval_on_start", "data_seed",
    "log_level_replica", "log_on_each_node",
}
# transformers.TrainingArguments: why another value than the default is refused.
TRAINING_ARGUMENTS_REFUSED = {
    "average_tokens_across_devices": "posttrain averages token losses over every process's tokens, TRL's default",
    "use_cache": "the training forward never uses the KV cache; generation runs posttrain's own engine",
    "skip_memory_metrics": "posttrain logs memory in its benchmarks and posttrain plan, not per run",
    "dataloader_drop_last": "posttrain trains every row, as TRL's default",
    "optim_args": "posttrain's optimizer is AdamW (optim adamw_torch or adamw_torch_fused) with the adam_* fields",
    "optim_target_modules": "posttrain's optimizer is AdamW over every trained parameter",
    "label_smoothing_factor": "posttrain's losses are the algorithms' own, without label smoothing",
    "bf16_full_eval": "evaluation runs in the training precision (bf16 or fp16)",
    "fp16_full_eval": "evaluation runs in the training precision (bf16 or fp16)",
    "activation_checkpointing": "use gradient_checkpointing",
    "activation_checkpointing_kwargs": "use gradient_checkpointing",
    "torch_compile": "posttrain compiles its own decoder layers where that pays (compile_layers in GRPO/RLOO)",
    "torch_compile_backend": "posttrain compiles its own decoder layers where that pays",
    "torch_compile_mode": "posttrain compiles its own decoder layers where that pays",
    "use_liger_kernel": "posttrain uses TRL's fused LM head and its own kernels, not Liger's",
    "liger_kernel_config": "posttrain uses TRL's fused LM head and its own kernels, not Liger's",
    "neftune_noise_alpha": "NEFTune's embedding noise runs in SFT (SFTConfig), where TRL's users set it",
    "auto_find_batch_size": "set per_device_train_batch_size (posttrain plan predicts what fits)",
    "logging_nan_inf_filter": _LOGGING,
    "include_num_input_tokens_seen": "posttrain logs num_tokens where TRL does",
    "project": "trackers are named by run_name and report_to",
    "trackio_space_id": "trackers are named by run_name and report_to",
    "trackio_bucket_id": "trackers are named by run_name and report_to",
    "trackio_static_space_id": "trackers are named by run_name and report_to",
    "eval_delay": _EVAL_LOOP,
    "prediction_loss_only": _EVAL_LOOP,
    "eval_do_concat_batches": _EVAL_LOOP,
    "eval_use_gather_object": _EVAL_LOOP,
    "eval_accumulation_steps": _EVAL_LOOP,
    "include_for_metrics": _EVAL_LOOP,
    "batch_eval_metrics": _EVAL_LOOP,
    "save_on_each_node": "the main process writes the checkpoint's model files; DeepSpeed writes its shards",
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "load_best_model_at_end": "posttrain keeps the last model; pick a checkpoint-N folder by its metrics",
    "metric_for_best_model": "posttrain keeps the last model; pick a checkpoint-N folder by its metrics",
    "greater_is_better": "posttrain keeps the last model; pick a checkpoint-N folder by its metrics",
    "ignore_data_skip": "a resumed run always continues the data where it stopped",
    "restore_callback_states_from_checkpoint": "callbacks are not saved in checkpoints",
    "full_determinism": "posttrain seeds every process from seed; deterministic kernels are torch's setting",
    "accelerator_config": _DEEPSPEED,
    "parallelism_config": _DEEPSPEED,
    "dataloader_num_workers": _LOADER,
    "dataloader_pin_memory": _LOADER,
    "dataloader_persistent_workers": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "dataloader_multiprocessing_context": _LOADER,
    "dataloader_in_order": _LOADER,
    "label_names": "posttrain's trainers know their label columns",
    "train_sampling_strategy": "posttrain samples rows as TRL's default random sampler does",
    "length_column_name": "posttrain samples rows as TRL's default random sampler does",
    "ddp_find_unused_parameters": _DEEPSPEED,
    "ddp_bucket_cap_mb": _DEEPSPEED,
    "ddp_broadcast_buffers": _DEEPSPEED,
    "ddp_static_graph": _DEEPSPEED,
    "ddp_backend": _DEEPSPEED,
    "ddp_timeout": _DEEPSPEED,
    "fsdp": _DEEPSPEED,
    "fsdp_config": _DEEPSPEED,
    "deepspeed": _DEEPSPEED,
    "debug": "posttrain has no debug modes: use torch's own (TORCH_DISTRIBUTED_DEBUG)",
}

# Fields of TRL's configs beyond TrainingArguments, shared by several trainers.
_VLLM = "posttrain generates with its own engine (generation_backend), not vLLM"
VLLM_REFUSED = {name: _VLLM for name in (
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged")}
COMMON_REFUSED = {
    "activation_offloading": "activation offloading is not implemented: use gradient_checkpointing",
    "router_aux_loss_coef": "posttrain does not add a mixture-of-experts router loss",
    "dataset_kwargs": "posttrain prepares every dataset itself",
}
def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def trl_fields(config_cls: type) -> dict[str, dataclasses.Field]:
    """The fields ``config_cls`` takes from its TRL (or transformers) base, by name."""
    base = config_cls.trl_config()
    return {f.name: f for f in dataclasses.fields(base)}


def field_status(config_cls: type) -> dict[str, str]:
    """Each TRL field of ``config_cls``: ``""`` if it takes effect, else the reason another value is refused."""
    works = TRAINING_ARGUMENTS_WORK | set(config_cls._trl_works)
    refused = {**TRAINING_ARGUMENTS_REFUSED, **COMMON_REFUSED, **VLLM_REFUSED, **config_cls._trl_refused}
    out = {}
    for name in trl_fields(config_cls):
        if name in works:
            out[name] = ""
        elif name in refused:
            out[name] = refused[name]
        else:
            out[name] = "?"  # a TRL field posttrain has not accounted for: a test fails on it
    return out


def check_trl_fields(cfg: Any) -> None:
    """Refuse a TRL field set to another value than TRL's default where posttrain does not support it."""
    fields = trl_fields(type(cfg))
    for name, reason in field_status(type(cfg)).items():
        if reason and reason != "?":
            value = getattr(cfg, name)
            if not _same(value, _default(fields[name])):
                raise ConfigError(f"{name} is {value!r}, which posttrain does not support ({reason}): drop "
                                  f"--{name} or set it to TRL's default {_default(fields[name])!r}")


# "auto" is TRL's only such default (pad_to_multiple_of), which means none off Neuron devices.
_UNSET = (None, False, "no", "none", "", "auto", (), [], {})


def _same(value: Any, default: Any) -> bool:
    """Equal, or both an "off" value (argparse gives False for TrainingArguments' "no", and so on)."""
    value, default = getattr(value, "value", value), getattr(default, "value", default)
    return value == default or (value in _UNSET and default in _UNSET)


def field_table(config_classes: list[type]) -> str:
    """A markdown table: each TRL config field, and for each trainer whether it works or why it is refused."""
    rows: dict[str, list[str]] = {}
    for i, cls in enumerate(config_classes):
        for name, reason in field_status(cls).items():
            rows.setdefault(name, ["-"] * len(config_classes))[i] = "yes" if not reason else "refused"
    reasons = {}
    for cls in config_classes:
        reasons.update({n: r for n, r in field_status(cls).items() if r})
    head = "| field | " + " | ".join(c.__name__ for c in config_classes) + " | when refused, why |"
    lines = [head, "|" + "---|" * (len(config_classes) + 2)]
    for name in sorted(rows):
        lines.append(f"| `{name}` | " + " | ".join(rows[name]) + f" | {reasons.get(name, '')} |")
    return "\n".join(lines)


README_START, README_END = "<!-- trl-fields:start -->", "<!-- trl-fields:end -->"


def readme_table() -> str:
    """The table of every exported trainer config, as the README shows it."""
    import posttrain

    configs = [getattr(posttrain, name) for name in posttrain._TRAINERS if name.endswith("Config")]
    return field_table([c for c in configs if c.trl_config().__module__.startswith("trl")])


def write_readme(path: str) -> None:
    """Replace the README's table (between its markers) with :func:`readme_table`'s."""
    from pathlib import Path

    text = Path(path).read_text()
    head, rest = text.split(README_START, 1)
    tail = rest.split(README_END, 1)[1]
    Path(path).write_text(f"{head}{README_START}\n{readme_table()}\n{README_END}{tail}")


if __name__ == "__main__":  # python -m posttrain.trainers.trl_fields README.md
    import sys

    write_readme(sys.argv[1])
