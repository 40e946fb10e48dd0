"""GRPO's config (TRL 1.16's ``GRPOConfig`` plus posttrain's fields) and the checks GRPO and RLOO share, as TRL
keeps ``grpo_config.py`` beside ``grpo_trainer.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trl

from posttrain.errors import ConfigError
from posttrain.rollout.api import RolloutFields, check_rollout_fields
from posttrain.rollout.sampling import check_min_p, check_repetition_penalty, generation_overrides
from posttrain.trainers import off_policy
from posttrain.trainers import tools as agents
from posttrain.trainers.config import TrainConfig
from posttrain.trainers.entropy_bonus import ENTROPY_FIELDS, entropy_checks
from posttrain.trainers.grpo_loss import LOSS_TYPES
from posttrain.trainers.streaming import StreamingFields, check_streaming_config, training_processes

# TRL config fields GRPO and RLOO share (TRL's RLOOConfig has them too): those that take effect...
ONLINE_WORKS = (
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "num_generations", "num_generations_eval",
    "max_completion_length", "ds3_gather_for_generation", "shuffle_dataset", "generation_batch_size",
    "steps_per_generation", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs",
    "chat_template_kwargs", "beta", "num_iterations",
    "epsilon", "epsilon_high", "reward_weights", "mask_truncated_completions", "sync_ref_model",
    "ref_model_mixup_alpha", "ref_model_sync_steps", "log_completions", "num_completions_to_print", "log_unique_prompts",
    "log_multimodal",  # text models only: nothing multimodal is ever logged
    "vllm_enable_sleep_mode",  # posttrain's engine frees its KV cache and graphs while the policy trains
)
# ... and those refused at another value than TRL's default, with the reason.
ONLINE_REFUSED = {
    "pad_to_multiple_of": "posttrain pads each batch to its longest prompt and completion (padding changes no "
                          "number)",
    "cache_implementation": "posttrain's engine keeps its own KV cache (generation_kv_slots)",
}


@dataclass
class OnlineFields(StreamingFields, RolloutFields):
    """posttrain's own fields of the GRPO and RLOO configs, beside TRL's."""

    # Prompts kept to their last max_prompt_length tokens (TRL before 1.0 had it); None: TRL 1.16's whole prompt.
    max_prompt_length: int | None = None
    compile_layers: bool | None = None  # compile the policy's decoder layers (None: where it applies)
    dynamic_sampling: bool = False  # DAPO's (verl's filter_groups): posttrain.trainers.dynamic_sampling
    dynamic_sampling_max_rounds: int = 4  # extra generation batches one may draw (verl's max_num_gen_batches)
    padding_free: bool = True  # training forwards on packed rows (exact, no compute on padding); TRL's has none
    reference_model: str = field(default="", init=False)  # what the KL is measured against (not a flag)

    _loss_types = LOSS_TYPES

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon


@dataclass
class GRPOConfig(TrainConfig, OnlineFields, trl.GRPOConfig):
    """``trl.GRPOConfig`` (its fields, names and defaults) plus posttrain's placement and rollout fields."""

    _algorithm = "GRPO"
    _trl_works = (*ONLINE_WORKS, "delta", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
                  "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "importance_sampling_level",
                  "multi_objective_aggregation", "scale_rewards", "loss_type", "top_entropy_quantile",
                  "use_bias_correction_kl", "off_policy_mask_threshold", *off_policy.CORRECTION_FIELDS,
                  "max_tool_calling_iterations", *ENTROPY_FIELDS)
    _trl_refused = {
        **ONLINE_REFUSED,
        "cast_lm_head_to_fp32": "posttrain's fused LM head computes the log-probs in float32 from the model's dtype",
        "log_completions_hub_repo": "completions are logged to samples.jsonl in the output dir (log_completions)",
    }

    def __post_init__(self) -> None:
        check_online_config(self)
        off_policy.check_correction_config(self)


def check_online_config(cfg: Any) -> None:
    """TrainConfig's checks, then TRL's checks of the GRPO/RLOO config as sentences, before anything loads."""
    TrainConfig.__post_init__(cfg)
    check_rollout_fields(cfg)
    agents.check_config(cfg)
    world = training_processes(cfg)  # generation ranks (generation_processes) take no batch
    grpo = hasattr(cfg, "loss_type")  # TRL's RLOOConfig has none of GRPO's loss options
    check_min_p(cfg.min_p)
    check_repetition_penalty(cfg.repetition_penalty)
    generation_overrides(cfg.generation_kwargs, [], cfg.temperature)
    if grpo:
        cfg.scale_rewards = {True: "group", False: "none", "true": "group", "false": "none"}.get(
            cfg.scale_rewards, cfg.scale_rewards)
    checks = [
        (cfg.compile_layers in (None, True, False),
         f"compile_layers must be true, false or null (on a GPU where it applies); got {cfg.compile_layers!r}"),
        (cfg.num_generations >= 2,
         f"{cfg._algorithm} needs num_generations >= 2 to compare completions of one prompt; got "
         f"{cfg.num_generations}"),
        (cfg.num_generations_eval is None or cfg.num_generations_eval >= 1,
         f"num_generations_eval must be >= 1, or null for num_generations; got {cfg.num_generations_eval}"),
        (cfg.max_completion_length >= 1,
         f"max_completion_length must be >= 1 (new tokens per completion); got {cfg.max_completion_length}"),
        (cfg.max_prompt_length is None or cfg.max_prompt_length >= 1,
         f"max_prompt_length must be >= 1, or null for no truncation; got {cfg.max_prompt_length}"),
        (cfg.beta >= 0.0, f"beta (the KL coefficient) must be >= 0; got {cfg.beta}"),
        (cfg.temperature > 0.0,
         f"temperature must be > 0 (sampling; the loss divides logits by it); got {cfg.temperature}"),
        (cfg.num_iterations >= 1, "num_iterations must be >= 1"),
        (cfg.dynamic_sampling_max_rounds >= 0,
         f"dynamic_sampling_max_rounds must be >= 0 (extra generation batches); got {cfg.dynamic_sampling_max_rounds}"),
        (not cfg.sync_ref_model or cfg.beta != 0.0,
         "sync_ref_model needs a reference model, and beta: 0 loads none: set beta > 0 or drop sync_ref_model"),
        (not cfg.sync_ref_model or (cfg.ref_model_sync_steps >= 1 and 0.0 < cfg.ref_model_mixup_alpha <= 1.0),
         "sync_ref_model needs ref_model_sync_steps >= 1 and 0 < ref_model_mixup_alpha <= 1"),
    ]
    if grpo:
        checks += [
            (cfg.loss_type in cfg._loss_types,
             f"loss_type must be one of {', '.join(cfg._loss_types)}; got {cfg.loss_type!r}"),
            (cfg.importance_sampling_level in ("token", "sequence"),
             f"importance_sampling_level must be 'token' or 'sequence'; got {cfg.importance_sampling_level!r}"),
            (cfg.scale_rewards in ("group", "batch", "none"),
             f"scale_rewards must be 'group', 'batch' or 'none'; got {cfg.scale_rewards!r}"),
            (cfg.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
             "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum'"),
            (0.0 < cfg.top_entropy_quantile <= 1.0, "top_entropy_quantile must be in (0, 1]"),
            *entropy_checks(cfg),
        ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    # TRL's batch arithmetic: a generation batch is steps_per_generation micro-batches per process.
    per_step = cfg.per_device_train_batch_size * world
    if cfg.generation_batch_size is not None and cfg.steps_per_generation is not None:
        if cfg.generation_batch_size != per_step * cfg.steps_per_generation:
            raise ConfigError("set generation_batch_size or steps_per_generation, not both (they disagree: "
                              f"{cfg.generation_batch_size} != {per_step} x {cfg.steps_per_generation})")
    elif cfg.generation_batch_size is None:
        cfg.steps_per_generation = cfg.steps_per_generation or cfg.gradient_accumulation_steps
        cfg.generation_batch_size = per_step * cfg.steps_per_generation
    elif cfg.generation_batch_size % per_step:
        raise ConfigError(f"generation_batch_size ({cfg.generation_batch_size}) must be a multiple of "
                          f"per_device_train_batch_size x processes ({per_step})")
    else:
        cfg.steps_per_generation = cfg.generation_batch_size // per_step
    if cfg.generation_batch_size % cfg.num_generations:
        raise ConfigError(f"the generation batch ({cfg.generation_batch_size} completions = "
                          f"per_device_train_batch_size x processes x steps_per_generation) must be a multiple of "
                          f"num_generations ({cfg.num_generations}): every prompt's group has to be complete")
    check_streaming_config(cfg, world)
    eval_generations = cfg.num_generations_eval or cfg.num_generations
    if cfg.eval_strategy != "no" and (cfg.per_device_eval_batch_size * world) % eval_generations:
        raise ConfigError(f"the eval batch (per_device_eval_batch_size {cfg.per_device_eval_batch_size} x {world} "
                          f"processes) must be a multiple of num_generations_eval ({eval_generations}), TRL's rule: "
                          "set --per_device_eval_batch_size or --num_generations_eval")


def check_reference(cfg: Any, adapters: bool) -> None:
    """Refuse what a LoRA run's reference (the base, adapters disabled) cannot do; record ``cfg.reference_model``."""
    if adapters and "reference" in cfg.role_configs:
        raise ConfigError("a LoRA run (peft_config) has no reference role (the reference is the policy's base with "
                          "adapters disabled), so role_configs' 'reference' entry places nothing: drop it from "
                          "role_configs")
    if adapters and cfg.sync_ref_model:
        raise ConfigError("sync_ref_model needs a reference model of its own, and a LoRA run (peft_config) has none "
                          "(the reference is the base with adapters disabled): drop sync_ref_model, or train "
                          "without LoRA")
    cfg.reference_model = ("none (beta 0)" if cfg.beta == 0.0 else
                           "the policy's base model with its LoRA adapters disabled" if adapters else
                           "the policy's initial weights")
