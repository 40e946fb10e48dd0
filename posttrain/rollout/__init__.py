"""Rollouts: sampling completions from a role's model for PPO, GRPO/RLOO and on-policy distillation
(``api.Rollout``)."""

from posttrain.rollout.adapters import LORA_MODES
from posttrain.rollout.api import BACKENDS, Rollout, RolloutFields, check_rollout_fields
from posttrain.rollout.decoder import SUPPORTED_MODEL_TYPES, unsupported_reason
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.sampling import (
    RolloutOutput,
    SamplingParams,
    choose_tokens,
    filter_logits,
    finish,
    gumbel_noise,
    token_logprobs,
)
from posttrain.rollout.shadow import ShadowModel

__all__ = ["BACKENDS", "LORA_MODES", "SUPPORTED_MODEL_TYPES", "DecodeEngine", "Rollout", "RolloutFields",
           "RolloutOutput", "SamplingParams", "ShadowModel", "check_rollout_fields", "choose_tokens",
           "filter_logits", "finish", "gumbel_noise", "token_logprobs", "unsupported_reason"]
