"""Rollouts: sampling completions from a role's model, fast, for PPO, GRPO/RLOO and on-policy distillation.

One idea per module:

- ``sampling``: what to sample (``SamplingParams``), top-k/top-p, keyed Gumbel-max, truncation;
- ``decoder``: the Llama-family decoder as pure functions of the model's weights (no module calls,
  so it compiles however a trainer prepared the policy);
- ``step``: the step's other compiled parts: prologue, LM head and sampler, epilogue;
- ``engine``: KV cache slots, the step over (rows, columns) buckets, compiled and captured as CUDA
  graphs, every fallback counted;
- ``switches``: the step's switches (engine options, their environment variables) and which
  decode attention runs;
- ``triton_decode``: posttrain's decode-attention kernels (the default on CUDA), which also rotate
  the step's query and key and write its key and value into the cache;
- ``scheduler``: continuous batching over the slots (refill, compaction, prefix sharing);
- ``admission``: sequences into and out of the slots (prefill, moves, harvest), as the scheduler decides;
- ``prompt_cache``: shared prompt slots (a group's prompt held and read once);
- ``adapters``: peft LoRA adapters as the engine reads them (merged buffers or live terms);
- ``shadow``: a ZeRO-3 model's persistent full copy, gathered once per rollout;
- ``hf``: the ``generate`` backend;
- ``api``: ``Rollout``, what the trainers call.
"""

from posttrain.rollout.adapters import LORA_MODES
from posttrain.rollout.api import BACKENDS, Rollout, RolloutFields, check_rollout_fields
from posttrain.rollout.decoder import SUPPORTED_MODEL_TYPES, unsupported_reason
from posttrain.rollout.engine import COMPILE_MODES, DecodeEngine
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

__all__ = ["BACKENDS", "COMPILE_MODES", "LORA_MODES", "SUPPORTED_MODEL_TYPES", "DecodeEngine", "Rollout",
           "RolloutFields", "RolloutOutput", "SamplingParams", "ShadowModel", "check_rollout_fields",
           "choose_tokens", "filter_logits", "finish", "gumbel_noise", "token_logprobs", "unsupported_reason"]
