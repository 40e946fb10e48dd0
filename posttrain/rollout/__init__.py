"""Rollouts: sampling completions from a role's model, fast, for PPO, GRPO/RLOO and on-policy distillation.

One idea per module (nano-vllm's split: sequences' state, the scheduler, the model runner):

- ``api``: ``Rollout`` (``Rollout.from_config`` reads a trainer config's ``RolloutFields``);
- ``sampling``: what to sample (``SamplingParams``), top-k/top-p, keyed Gumbel-max, truncation;
- ``scheduler``: which sequence sits in which slot, and when (continuous batching, compaction);
- ``engine``: the model runner: the step over (rows, columns) buckets, compiled and captured as
  CUDA graphs on CUDA, every fallback counted; sequences in and out as the scheduler decides;
- ``slots``: the KV budget's cache and each slot's decode state, in one object;
- ``prefill``: prompts into the cache, each distinct prompt once;
- ``prompt_cache``: shared prompt slots (a group's prompt held and read once);
- ``step``: the step's parts (prologue, layer halves, sampler, epilogue), eager or compiled;
- ``decoder``: the Llama-family decoder as pure functions of the model's weights (no module calls,
  so it compiles however a trainer prepared the policy); ``weights``: what it reads;
- ``kernels``: posttrain's Triton kernels of the CUDA step (decode attention, which also rotates
  the step's query and key and writes its key and value into the cache; pointwise ops; sampler);
- ``adapters``: peft LoRA adapters as the engine reads them (merged buffers or live terms);
- ``shadow``: a ZeRO-3 model's persistent full copy, gathered once per rollout;
- ``hf``: the ``generate`` backend.
"""

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
