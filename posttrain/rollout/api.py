"""``Rollout``: sampling completions from a role's model with the engine (``"posttrain"``) or transformers'
``generate`` (``"hf"``, also the logged fallback)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.rollout import adapters, scheduler, weights
from posttrain.rollout.adapters import LORA_MODES
from posttrain.rollout.decoder import unsupported_reason
from posttrain.rollout.engine import RUN_COUNTERS, DecodeEngine
from posttrain.rollout.hf import generation_model, hf_generate
from posttrain.rollout.sampling import RolloutOutput, SamplingParams, finish
from posttrain.rollout.shadow import ShadowModel
from posttrain.rollout.turns import TurnEnd, TurnOutput, Turns, hf_turns

if TYPE_CHECKING:
    from posttrain.rollout.stream import Stream

logger = logging.getLogger(__name__)

BACKENDS = ("posttrain", "hf")


@dataclass
class RolloutFields:
    """posttrain's own rollout settings, a mixin for trainer configs; read by :meth:`Rollout.from_config`."""

    # "posttrain" (the rollout engine) | "hf" (transformers' generate).
    generation_backend: str = "posttrain"
    # The KV budget in sequences (prompt + completion each); more stream through as slots free.
    # None: one slot per sequence of the per-process generation batch (fastest, most memory).
    generation_kv_slots: int | None = None
    # q|k|v and gate|up as one GEMM each also where the weights do not lie end to end, from copies
    # rewritten each rollout (`posttrain plan --generation-fused-projections` counts them).
    generation_fused_projections: bool = False
    # Each prompt's keys and values held once for its num_generations rows: prompt KV memory divided
    # by the group size (a memory setting; `posttrain plan --generation-shared-prompt-kv` counts it).
    generation_shared_prompt_kv: bool = False
    # How LoRA adapters decode: "grouped" (the base read in place, the adapters' A rows appended to its
    # GEMMs), "merged" (merged copies), "live" (low-rank terms, no copy); "auto": grouped where the base can
    # be appended to (live weights, or a ZeRO-3 policy's gathered copy laid out for it); see rollout/adapters.py.
    generation_lora_mode: str = "auto"
    # TRL's sampling settings (temperature, top_p, top_k, max_completion_length) and
    # ds3_gather_for_generation (gather a ZeRO-3 model whole; False: per-layer hooks, less memory,
    # slow, always transformers' generate) are the TRL config's own fields.


def check_rollout_fields(cfg: RolloutFields) -> None:
    """Refuse an impossible rollout setting by its flag before anything loads."""
    if cfg.generation_backend not in BACKENDS:
        raise ConfigError(f"generation_backend must be one of {BACKENDS}, got {cfg.generation_backend!r}: set "
                          "--generation_backend posttrain|hf")
    slots = cfg.generation_kv_slots
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ConfigError(f"generation_kv_slots must be a whole number >= 1 or null (one slot per sequence of a "
                          f"generation batch), got {slots!r}: set --generation_kv_slots")
    for name in ("generation_fused_projections", "generation_shared_prompt_kv", "ds3_gather_for_generation"):
        if not isinstance(getattr(cfg, name, True), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(cfg, name)!r}: set --{name} true|false")
    if cfg.generation_lora_mode not in LORA_MODES:
        raise ConfigError(f"generation_lora_mode must be one of {LORA_MODES}, got {cfg.generation_lora_mode!r}: set "
                          f"--generation_lora_mode {'|'.join(LORA_MODES)}")


def engine_options(cfg: RolloutFields, group_size: int | None = None) -> dict[str, Any]:
    """The :class:`DecodeEngine` options a trainer's config asks for."""
    options: dict[str, Any] = {"lora_mode": cfg.generation_lora_mode}
    if cfg.generation_fused_projections:
        options["fused"] = True
    if cfg.generation_shared_prompt_kv:
        options.update(shared_prompt_kv=True,
                       group_size=group_size if group_size is not None else getattr(cfg, "num_generations", 1))
    return options


# Rollout stats counting a fast path lost to a fallback.
SLOW_FALLBACKS = ("compile_fallbacks", "capture_fallbacks", "adapter_fallbacks", "fused_fallbacks",
                  "triton_fallbacks", "lora_fallbacks")


def slowed(stats: dict[str, Any]) -> bool:
    """Whether rollout ``stats`` count a fallback that slows generation (any ``*_fallbacks`` counter)."""
    return any(v for k, v in stats.items() if k.endswith("_fallbacks"))


class Rollout:
    """Samples completions for a role of a Session. ``kv_slots``: the KV budget in sequences (default
    ``max_batch``; more stream through); ``model``: a bare module without a session (tests, benchmarks)."""

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
        self._bare = model
        self.gather = ds3_gather_for_generation
        self.stats: dict[str, Any] = {"backend": backend, "fallback": None, "captures": 0, "recaptures": 0,
                                      "capture_s": 0.0, "compile_fallbacks": 0, "capture_fallbacks": 0,
                                      "adapter_fallbacks": 0, "kv_cache_bytes": 0}
        self._retired = dict.fromkeys(RUN_COUNTERS, 0)  # the run's counters of engines replaced since
        self.backend = backend
        self.engine: DecodeEngine | None = None
        self.shadow: ShadowModel | None = None
        self.rollouts = 0
        self.stream: Stream | None = None  # rollout/stream.py, once opened
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

    @classmethod
    def from_config(cls, cfg: RolloutFields, session: Any, role: str, sampling: SamplingParams, *, max_batch: int,
                    max_prompt_len: int, group_size: int | None = None, model: nn.Module | None = None
                    ) -> Rollout:
        """The rollout a trainer's config asks for (every :class:`RolloutFields` setting)."""
        missing = [f.name for f in fields(RolloutFields) if not hasattr(cfg, f.name)]
        if missing:
            raise ConfigError(f"{type(cfg).__name__} lacks the rollout settings {missing}: mix "
                              "posttrain.rollout.RolloutFields into it (and check_rollout_fields in __post_init__)")
        check_rollout_fields(cfg)
        return cls(session, role, sampling, max_batch=max_batch, max_prompt_len=max_prompt_len,
                   backend=cfg.generation_backend,
                   ds3_gather_for_generation=getattr(cfg, "ds3_gather_for_generation", True),
                   model=model, kv_slots=cfg.generation_kv_slots,
                   engine_options=engine_options(cfg, group_size))

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: captures, Triton use, :data:`SLOW_FALLBACKS` counters, backend fallback."""
        st = self.stats
        out = {"rollout/captures": st["captures"], "rollout/recaptures": st["recaptures"],
               "rollout/capture_s": st["capture_s"], "rollout/sleeps": st.get("sleeps", 0),
               "rollout/triton_decode": float(bool(st.get("triton_decode"))),
               "rollout/triton_sampler": float(bool(st.get("triton_sampler"))),
               "rollout/backend_fallback": float(st["fallback"] is not None)}
        out.update({f"rollout/{name}": st.get(name, 0) for name in SLOW_FALLBACKS})
        return out

    @property
    def degraded(self) -> bool:
        """Whether generation runs slower than it should (:func:`slowed`)."""
        return slowed(self.stats)

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
        # The run's seed fixes the draw (restored on resume); the rank makes ranks sample differently.
        draw = int(torch.randint(0, 2**31 - 1, (1,)).item())
        rank = 0 if self._bare is not None else self.session.process_index
        return (draw ^ (rank * 0x3C6EF372)) & 0x7FFFFFFF

    def _engine_model(self) -> tuple[nn.Module, Any]:
        """The model the engine decodes and, for ZeRO-3, the refreshed shadow's ``view``."""
        model = adapters.unwrap(self._module())
        if not self._zero3():
            return model, None
        if self.shadow is None:
            fast = self.session.fast_frozen.get(self.role)
            grouped = self.engine_options.get("lora_mode", "auto") in ("auto", "grouped")
            self.shadow = ShadowModel(self._module(), fast, weights.appended_layout(model) if grouped else ())
        self.shadow.refresh()
        return model, self.shadow.view

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
        self._check_not_streaming()
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

    def generate_turns(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, on_turn_end: TurnEnd,
                       sampling: SamplingParams | None = None) -> TurnOutput:
        """Multi-turn completions of left-padded prompts [B, P]: when a sequence's turn ends (a stop token, or
        its budget), ``on_turn_end(seq, completion_ids, room)`` returns the tokens to append (a tool's rendered
        output, at most ``room``) or None; the completion's budget is ``max_new_tokens`` in all."""
        sampling = sampling or self.sampling
        b, p = prompt_ids.shape
        if p > self.max_prompt_len:
            raise ConfigError(f"prompts of {p} tokens exceed this Rollout's max_prompt_len={self.max_prompt_len}; "
                              "build it larger")
        if sampling.max_new_tokens > self.sampling.max_new_tokens and self.backend == "posttrain":
            raise ConfigError(f"max_new_tokens={sampling.max_new_tokens} exceeds the {self.sampling.max_new_tokens} "
                              "this Rollout was built for (its cache is sized for it); build it with the largest")
        if self.engine_options.get("shared_prompt_kv"):
            raise ConfigError("multi-turn generation does not run with generation_shared_prompt_kv: set it false")
        self._check_not_streaming()
        key = self._seed_key()
        self.rollouts += 1
        turns = Turns(on_turn_end, sampling.max_new_tokens)
        backend = self.backend
        if backend == "posttrain" and adapters.unsupported_reason(self._module()) is not None:
            self.stats["adapter_fallbacks"] += 1
            backend = "hf"
        if backend == "hf":
            with generation_model(self.session, self.role, self._bare, self._zero3(), self.gather) as (model, synced):
                if synced:
                    raise ConfigError("multi-turn generation with transformers' generate needs the whole model on "
                                      "each rank: set ds3_gather_for_generation true")
                tokens, logprobs = hf_turns(model, prompt_ids, prompt_mask, sampling, key, turns)
        else:
            tokens, logprobs = self._engine_generate(prompt_ids, prompt_mask, sampling, key, turns)
        return turns.output(tokens.to(prompt_ids.device), logprobs.to(prompt_ids.device), sampling.pad_token_id)

    def sleep(self) -> None:
        """Free the engine's KV cache and decode graphs until the next rollout, for training to use (TRL's
        ``vllm_enable_sleep_mode``); the next rollout allocates them again and re-captures its graphs. The
        ``hf`` backend holds its cache only while generating: nothing to free."""
        if self.engine is None or self.backend != "posttrain":
            return
        self._check_not_streaming()
        self.engine.sleep()
        self.update_stats()

    def _check_not_streaming(self) -> None:
        if self.stream is not None and not self.stream.idle:
            raise RuntimeError("the engine is streaming: drain the stream before a rollout of its own")

    def _engine_generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
                         key: int, turns: Turns | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engine_for(sampling)
        tokens, logprobs, self.timings = scheduler.generate(engine, prompt_ids, prompt_mask, key,
                                                            sampling.max_new_tokens, profile=self.profile,
                                                            turns=turns)
        self.update_stats()
        return tokens, logprobs

    def engine_for(self, sampling: SamplingParams) -> DecodeEngine:
        """The engine for ``sampling`` over the role's current weights (a new one when its compiled knobs
        change; a ZeRO-3 role's shadow refreshed)."""
        model, tensor = self._engine_model()
        knobs = replace(sampling, max_new_tokens=self.sampling.max_new_tokens)
        same = (self.engine is not None and self.engine.model is model
                and DecodeEngine.graph_key(self.engine.sampling) == DecodeEngine.graph_key(knobs))
        if same:
            self.engine.set_knobs(knobs)  # temperature, do_sample, top_p, min_new_tokens: buffers
        else:
            if self.engine is not None:  # new knobs: a new engine, its graphs counted with the old ones'
                old = self.engine.stats()
                for k in RUN_COUNTERS:
                    self._retired[k] += old[k]
                self.engine = None
            self.engine = DecodeEngine(model, knobs, self.kv_slots, self.max_prompt_len, tensor=tensor,
                                       layout=self.shadow if tensor is not None else None, **self.engine_options)
        return self.engine

    def update_stats(self) -> None:
        """The engine's counters into ``stats`` (with those of engines it replaced)."""
        st = self.engine.stats()
        for k in RUN_COUNTERS:
            st[k] += self._retired[k]
        self.stats.update(st, capture_s=round(st["capture_s"], 3))

    def open_stream(self, group_size: int = 1) -> Stream:
        """A :class:`~posttrain.rollout.stream.Stream` of generation batches over this rollout's engine
        (one per Rollout; refused where only transformers' generate runs); ``group_size``: rows admitted a
        whole group at a time."""
        from posttrain.rollout.stream import Stream

        if self.backend != "posttrain":
            raise ConfigError(f"streaming rollouts decode in posttrain's engine, and role {self.role!r} generates "
                              f"with transformers' generate ({self.stats['fallback'] or 'generation_backend hf'}): "
                              "set generation_backend posttrain and a model the engine runs, or async_generation false")
        if self.engine_options.get("shared_prompt_kv"):
            raise ConfigError("streaming rollouts do not run with generation_shared_prompt_kv: set it false")
        if self.stream is None:
            self.stream = Stream(self, group_size)
        return self.stream
