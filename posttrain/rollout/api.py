"""``Rollout``: sampling completions from a role's model for PPO, GRPO/RLOO and on-policy distillation.

Built once per run for a trained (or frozen) role of a Session; ``generate`` samples. Two
backends: ``"posttrain"`` (default; the engine of ``engine.py`` driven by ``scheduler.py``) and
``"hf"`` (transformers' ``generate``, ``hf.py``). Architectures the engine cannot run fall back to
``"hf"`` with one log line saying why (``stats["fallback"]``).

Same seed, same samples: each ``generate`` draws one 62-bit key from torch's default CPU generator
(seeded by the run's seed, saved and restored with a checkpoint's RNG state), mixed with the
process rank; the noise of a sequence's token is a hash of (key, step, sequence index, token), so
the same key gives the same samples on CPU and GPU, in either backend, in any slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.rollout import adapters, scheduler
from posttrain.rollout.decoder import unsupported_reason
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.hf import generation_model, hf_generate
from posttrain.rollout.sampling import RolloutOutput, SamplingParams, finish
from posttrain.rollout.shadow import ShadowModel

logger = logging.getLogger(__name__)

BACKENDS = ("posttrain", "hf")


@dataclass
class RolloutFields:
    """The engine's settings for a trainer's config (a mixin, as ``posttrain.models.lora.LoraFields``);
    the trainer passes ``generation_kv_slots`` as :class:`Rollout`'s ``kv_slots``."""

    # The KV budget in sequences: the engine's cache holds this many sequences of prompt +
    # completion tokens; a generation batch with more streams through as slots free (same samples).
    # None: one slot per sequence of the trainer's generation batch (its per-process
    # generation_batch_size in GRPO/RLOO), the fastest and the most memory. Named after
    # generation_backend / generation_batch_size; TRL has no such setting (its vLLM server's
    # counterpart is max_num_seqs).
    generation_kv_slots: int | None = None
    # The decode step runs q|k|v and gate|up as one GEMM each wherever those weights lie end to end
    # (DeepSpeed's ZeRO-1/2 flat buffers, the ZeRO-3 shadow: views, no copy). True: elsewhere too
    # (separately allocated parameters, biases between the matrices, LoRA), from copies rewritten
    # once per rollout: about 57% of the model's bf16 bytes more (none with LoRA's merged buffers,
    # which become its slices); `posttrain plan --generation-fused-projections` counts that copy.
    generation_fused_projections: bool = False
    # Each prompt's keys and values held once for the rows that continue it (a GRPO/RLOO group's
    # num_generations rows) instead of once per row: the prompts' KV memory / num_generations, and
    # decode attention reads each prompt once a step for its whole group. The rows' cache then holds
    # only completions, and the engine one prompt slot per group of its KV budget (plus one where
    # the budget is not whole groups). `posttrain plan --generation-shared-prompt-kv` counts it.
    # A memory setting: where timed (1.1B, one H200, before its parts ran on SDPA kernels) the
    # rollout ran at 0.73x the default's speed.
    generation_shared_prompt_kv: bool = False
    # Decode attention by posttrain's Triton kernels (rollout/triton_decode.py), which also write the
    # step's keys and values into the cache. None: on CUDA where Triton imports and the head size
    # is a power of two from 16 to 256, else SDPA. false: SDPA's kernel (steps 1.23-1.46x slower
    # on an H200; log-probs as close to a forward's either way; README "Rollouts"). true: required
    # (a clear error without Triton).
    generation_triton_decode: bool | None = None


def check_rollout_fields(cfg: RolloutFields) -> None:
    """Refuse an impossible KV budget or switch by its flag before anything loads."""
    slots = cfg.generation_kv_slots
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ConfigError(f"generation_kv_slots must be a whole number >= 1 or null (one slot per sequence of a "
                          f"generation batch), got {slots!r}: set --generation_kv_slots")
    for name in ("generation_fused_projections", "generation_shared_prompt_kv", "generation_triton_decode"):
        value = getattr(cfg, name)
        if not isinstance(value, bool) and not (value is None and name == "generation_triton_decode"):
            raise ConfigError(f"{name} must be true or false, got {value!r}: set --{name} true|false")


def engine_options(cfg: RolloutFields) -> dict[str, Any]:
    """The :class:`DecodeEngine` options a trainer's config asks for (unset ones leave the engine's
    defaults and their POSTTRAIN_ROLLOUT_* variables in charge)."""
    options: dict[str, Any] = {"fused": True} if cfg.generation_fused_projections else {}
    if cfg.generation_shared_prompt_kv:
        options["shared_prompt_kv"] = True
    if cfg.generation_triton_decode is not None:
        options["triton_decode"] = cfg.generation_triton_decode
    if hasattr(cfg, "num_generations"):  # GRPO/RLOO: the group size of shared prompt slots (also when
        options["group_size"] = cfg.num_generations  # POSTTRAIN_ROLLOUT_SHARED_PROMPT turns them on)
    return options


# The rollout stats' counters of a path lost to a fallback: a compile, capture, flex, Triton-kernel,
# SDPA or fused-views fallback, or a rollout that ran ``generate`` for its adapters' state.
SLOW_FALLBACKS = ("compile_fallbacks", "capture_fallbacks", "adapter_fallbacks", "fused_fallbacks",
                  "sdpa_fallbacks", "flex_fallbacks", "triton_fallbacks")


def slowed(stats: dict[str, Any]) -> bool:
    """Whether rollout ``stats`` (:attr:`Rollout.stats`, or a rank's copy of them) count a fallback
    that makes generation slower than it should be."""
    return any(stats.get(k) for k in SLOW_FALLBACKS)


class Rollout:
    """``max_batch``: the sequences a rollout usually has, and the default KV budget; a rollout may
    pass more (they stream through the slots). ``kv_slots``: the KV budget in sequences (the cache
    is ``kv_slots x (max_prompt_len + max_new_tokens)``); default ``max_batch``.
    ``ds3_gather_for_generation`` (TRL's name): a ZeRO-3 model is gathered whole for generation;
    False generates through DeepSpeed's per-layer hooks (less memory, slow; always ``generate``).
    ``sampling``: the run's settings; ``generate(..., sampling=...)`` may change temperature and
    the other knobs per call (new top-k, top-p on/off or stop tokens make a new engine: keep them
    fixed in a run) and take up to the built ``max_new_tokens``. ``engine_options``: keyword
    arguments of :class:`DecodeEngine` (buckets, sync interval, prefix sharing, ``lora_mode``
    "merged" or "live" for a peft model's LoRA adapters: ``adapters.py``; the step's switches
    ``fused``, ``split_layer``, ``fp32_scores``, ``sdpa_decode``, ``flex_decode``, ``triton_decode``, ``cublaslt``:
    ``engine.py``; tests and benchmarks).
    A peft model (``get_peft_model``) decodes with its active adapters, as its forward would."""

    def __init__(self, session: Any, role: str, sampling: SamplingParams, *, max_batch: int, max_prompt_len: int,
                 backend: str = "posttrain", ds3_gather_for_generation: bool = True,
                 model: nn.Module | None = None, kv_slots: int | None = None,
                 engine_options: dict[str, Any] | None = None) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"generation_backend must be one of {BACKENDS}, got {backend!r}")
        if max_batch < 1 or max_prompt_len < 1 or (kv_slots is not None and kv_slots < 1):
            raise ConfigError(f"max_batch, max_prompt_len and kv_slots must be positive, got {max_batch}, "
                              f"{max_prompt_len} and {kv_slots}")
        self.session, self.role, self.sampling = session, role, sampling
        self.max_batch, self.max_prompt_len = max_batch, max_prompt_len
        self.kv_slots = kv_slots or max_batch
        self.engine_options = dict(engine_options or {})
        # ``model``: a bare module without a session (benchmarks, tests): no ZeRO, this process only.
        self._bare = model
        self.gather = ds3_gather_for_generation
        self.stats: dict[str, Any] = {"backend": backend, "fallback": None, "captures": 0, "recaptures": 0,
                                      "capture_s": 0.0, "compile_fallbacks": 0, "capture_fallbacks": 0,
                                      "adapter_fallbacks": 0, "kv_cache_bytes": 0}
        self.backend = backend
        self.engine: DecodeEngine | None = None
        self.shadow: ShadowModel | None = None
        self.rollouts = 0
        self.timings: dict[str, float] = {}
        self.profile = False  # time prefill and decode separately (syncs; benchmarks only)
        if backend == "posttrain":
            module = self._module()
            reason = (adapters.unsupported_reason(module)
                      or unsupported_reason(adapters.unwrap(module), max_prompt_len + sampling.max_new_tokens))
            if reason is None and self._zero3() and not self.gather:
                reason = "ds3_gather_for_generation=False: the engine needs the whole weights on each rank"
            if reason is not None:
                self._fall_back(reason)

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: graph captures so far, recaptures (0 after warm-up), capture seconds,
        whether the decode attention and the sampler ran on posttrain's Triton kernels (the sampler
        does where there is no top-k or top-p), and every loss of speed:
        each counter of :data:`SLOW_FALLBACKS` (compile, capture, the attention kernels' and fused
        views' fallbacks, the rollouts that ran ``generate`` because of the adapters' state at that
        time) and 1 if the backend fell back to ``generate`` for an unsupported model (or peft
        adapters the engine cannot run)."""
        st = self.stats
        out = {"rollout/captures": st["captures"], "rollout/recaptures": st["recaptures"],
               "rollout/capture_s": st["capture_s"], "rollout/triton_decode": float(bool(st.get("triton_decode"))),
               "rollout/triton_sampler": float(bool(st.get("triton_sampler"))),
               "rollout/backend_fallback": float(st["fallback"] is not None)}
        out.update({f"rollout/{name}": st.get(name, 0) for name in SLOW_FALLBACKS})
        return out

    @property
    def degraded(self) -> bool:
        """Whether generation runs slower than it should (:func:`slowed`)."""
        return slowed(self.stats)

    # -- where the weights are ---------------------------------------------------------------------
    def _module(self) -> nn.Module:
        if self._bare is not None:
            return self._bare
        return self.session.engines[self.role].module

    def _zero3(self) -> bool:
        return self._bare is None and self.session.zero_stage(self.role) == 3

    def _fall_back(self, reason: str) -> None:
        logger.warning("rollout: role %r generates with transformers' generate: %s", self.role, reason)
        self.backend = "hf"
        self.stats.update(backend="hf", fallback=reason)

    def _seed_key(self) -> int:
        # One draw from the default generator per rollout (the run's seed; restored on resume),
        # mixed with the rank so that ranks sample differently.
        draw = int(torch.randint(0, 2**31 - 1, (1,)).item())
        rank = 0 if self._bare is not None else self.session.process_index
        return (draw ^ (rank * 0x3C6EF372)) & 0x7FFFFFFF

    def _engine_model(self) -> tuple[nn.Module, Any]:
        """The transformers model the engine decodes (a peft model's, adapters in place) and, for
        ZeRO-3, the shadow's copy of each parameter (gathered now, once per rollout)."""
        model = adapters.unwrap(self._module())
        if not self._zero3():
            return model, None
        if self.shadow is None:
            fast = self.session.fast_frozen.get(self.role)
            self.shadow = ShadowModel(self._module(), fast)
        self.shadow.refresh()
        return model, self.shadow.view

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sampling: SamplingParams | None = None) -> RolloutOutput:
        """Sample completions of left-padded prompts [B, P] (``prompt_mask`` 1 on real tokens)."""
        sampling = sampling or self.sampling
        if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
            raise ConfigError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                              "must be the same [batch, length] shape")
        b, p = prompt_ids.shape
        if p > self.max_prompt_len:  # checked before any collective gather
            raise ConfigError(f"prompts of {p} tokens exceed this Rollout's max_prompt_len={self.max_prompt_len}; "
                              "build it larger")
        if sampling.max_new_tokens > self.sampling.max_new_tokens and self.backend == "posttrain":
            raise ConfigError(f"max_new_tokens={sampling.max_new_tokens} exceeds the {self.sampling.max_new_tokens} "
                              "this Rollout was built for (its cache is sized for it); build it with the largest")
        key = self._seed_key()
        self.rollouts += 1
        backend = self.backend
        if backend == "posttrain":
            # Adapter state the engine cannot run (merged and disabled): this rollout generates.
            reason = adapters.unsupported_reason(self._module())
            if reason is not None:
                self.stats["adapter_fallbacks"] += 1
                logger.warning("rollout: role %r generates this rollout with transformers' generate: %s (counted "
                               "in rollout/adapter_fallbacks)", self.role, reason)
                backend = "hf"
        if backend == "hf":
            with generation_model(self.session, self.role, self._bare, self._zero3(), self.gather) as (model, synced):
                completion, logprobs = hf_generate(model, synced, prompt_ids, prompt_mask, sampling, key)
        else:
            completion, logprobs = self._engine_generate(prompt_ids, prompt_mask, sampling, key)
        completion, mask, logprobs = finish(completion, logprobs, sampling)
        return RolloutOutput(sequences=torch.cat([prompt_ids, completion.to(prompt_ids.device)], 1),
                             completion_ids=completion, completion_mask=mask, logprobs=logprobs)

    def _engine_generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
                         key: int) -> tuple[torch.Tensor, torch.Tensor]:
        model, tensor = self._engine_model()
        knobs = replace(sampling, max_new_tokens=self.sampling.max_new_tokens)
        same = (self.engine is not None and self.engine.model is model
                and DecodeEngine.graph_key(self.engine.sampling) == DecodeEngine.graph_key(knobs))
        if same:
            self.engine.set_knobs(knobs)  # temperature, do_sample, top_p, min_new_tokens: buffers
        else:
            old = self.engine
            self.engine = DecodeEngine(model, knobs, self.kv_slots, self.max_prompt_len, tensor=tensor,
                                       **self.engine_options)
            if old is not None:  # new knobs: a new engine, its graphs counted with the old ones'
                for k in ("captures", "recaptures", "capture_s", "compile_fallbacks", "capture_fallbacks",
                          "storage_moves"):
                    self.engine.stats[k] += old.stats[k]
                del old
            self.stats["kv_cache_bytes"] = self.engine.cache_nbytes
            self.stats["fused_weight_bytes"] = self.engine.fused_nbytes
            self.stats["lora_mode"] = self.engine.lora_mode
        tokens, logprobs, self.timings = scheduler.generate(self.engine, prompt_ids, prompt_mask, key,
                                                            sampling.max_new_tokens, profile=self.profile)
        est = self.engine.stats
        self.stats.update({k: v for k, v in est.items()}, capture_s=round(est["capture_s"], 3),
                          compile=self.engine.compile_mode, graphs=len(self.engine.graphs),
                          lora_merged_bytes=self.engine.lora_nbytes, fused_projections=self.engine.fused_projections,
                          fallback_reasons=list(self.engine.fallback_reasons))
        return tokens, logprobs
