"""The decode engine: KV cache slots, each slot's decode state, the step over a (rows, columns)
bucket, and (on CUDA) that step compiled and captured as one CUDA graph per bucket.

- Slots: the cache holds ``slots`` sequences ([slots, kv_heads, max_len, head_dim] per layer, the
  KV budget). Each slot has its own state (fed token, position, cache column, step, sequence
  index, done), so sequences that entered at different times decode side by side
  (``scheduler.py`` decides who enters, leaves and moves).
- Buckets: the step runs rows ``0..B-1`` over cache columns ``0..L-1``, B from a few batch sizes
  (powers of two from ``smallest_bucket``, and ``slots``), L a multiple of ``length_bucket``. So
  finished rows stop costing (the scheduler compacts live rows into the first slots and picks a
  smaller B) and attention reads only the filled part of the cache (L follows the longest live
  row, not the preallocated length). Why buckets of plain tensors rather than a paged cache or
  ``flex_attention``: a slice ``cache[:B, :, :L]`` is a view, so the step stays dense GEMMs and
  one decode attention that inductor and cuBLAS run as they are, the CPU runs the same code, and a
  new bucket costs one graph capture (about 0.1 s on an H200; inductor compiles once, with dynamic
  shapes), while a block table adds an indirection to every attention read and flex_attention
  would need its block mask rebuilt from the slot state every step. The price: KV memory is held
  per slot for the whole length, and rows sharing a prompt hold copies of its KV, unless the
  prompts are held once in shared prompt slots (``shared_prompt_kv``, ``prompt_cache.py``).
- Compile and capture: ``torch.compile`` (inductor, dynamic shapes, fullgraph) compiles the step's
  prologue (embedding and the first layer's norm, rotary cos/sin once for all layers, mask, where
  each row writes), one decoder layer (reused by every layer: a compile of seconds, not of the
  whole depth; each layer ends with the next one's input norm, so the residual add and that norm
  are one kernel), the sampler and the epilogue. The layer is compiled in two halves around
  eager ``index_copy_`` cache writes (``split_layer``, the default) or whole: then inductor writes
  the new keys and values into the cache input in place (its generated code scatters the rows,
  checked on CPU; it does not copy the cache back). Each bucket's step is then captured by hand
  as a CUDA graph; nothing in it may sync the host (stop tokens are a vocabulary mask, not
  ``torch.isin``). A compile or capture that fails falls back (whole layer -> split layer, SDPA
  -> bmm, float32 -> bf16 scores, compiled -> eager graph -> no graph): never silently, each is
  counted in ``stats`` (``split_fallbacks``, ``sdpa_fallbacks``, ``compile_fallbacks``,
  ``capture_fallbacks``) and logged.
- The step's switches (engine options, each with an environment variable for A/B runs; README
  "Rollouts" has the defaults and their measurement): ``fused`` q|k|v and gate|up GEMMs
  (``POSTTRAIN_ROLLOUT_FUSE``), ``split_layer`` (``POSTTRAIN_ROLLOUT_SPLIT``), ``fp32_scores``
  (``POSTTRAIN_ROLLOUT_SCORES_FP32``), ``sdpa_decode`` (``POSTTRAIN_ROLLOUT_SDPA``),
  ``shared_prompt_kv`` (``POSTTRAIN_ROLLOUT_SHARED_PROMPT``, default off: slower where timed,
  NOTES 21), ``flex_decode`` (``POSTTRAIN_ROLLOUT_FLEX``, default off), ``triton_decode``
  (``POSTTRAIN_ROLLOUT_TRITON``, default on CUDA: posttrain's kernels, which in the split layer also
  rotate the step's query and key and write its key and value into the cache, in place of the
  rotary kernels and the two ``index_copy_``; NOTES 24; and sample, where there is no top-k or
  top-p, with ``triton_sample.py``'s kernel in place of inductor's three reductions, and run
  SiLU-and-multiply and each residual add with its norm as ``triton_pointwise.py``'s; NOTES 26),
  ``cublaslt`` (``POSTTRAIN_ROLLOUT_CUBLASLT``, default on CUDA: cuBLASLt picks the step's GEMMs).
- Weights are read live (``decoder.read_weights`` each rollout): an optimizer step that writes the
  parameters in place is seen with no recapture; a parameter whose storage moved is noticed (data
  pointers compared) and the graphs are captured again (``recaptures``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rollout import decoder, step
from posttrain.rollout.adapters import Adapters
from posttrain.rollout.decoder import DecoderSpec
from posttrain.rollout.prompt_cache import SharedPrompts, bucket_sizes, default_prompt_slots
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.switches import ATTENTION_NAMES, attention_spec, env_choice, env_flag, preferred_blas

logger = logging.getLogger(__name__)

COMPILE_MODES = ("layer", "none")


class Clock:
    """Milliseconds between laps, on the device's clock (CUDA events) or the host's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last = self._mark()

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def lap(self) -> float:
        now = self._mark()
        if self.cuda:
            now.synchronize()
            ms = self.last.elapsed_time(now)
        else:
            ms = (now - self.last) * 1e3
        self.last = now
        return ms


def _static_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` with their first (rows) dimension marked static for the compile. inductor gives
    flex_attention its decoding kernel (the keys split over thread blocks, for a few queries a
    head) only where the batch size is known when it compiles (``_use_flex_decoding``); a dynamic
    one gets its general kernel. Static rows: one compile a rows bucket."""
    import torch._dynamo

    for t in tensors:
        torch._dynamo.mark_static(t, 0)
    return tensors


def _as_they_are(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


def _release_cublas_workspaces() -> None:
    """Free cuBLAS's workspaces (it keeps one per stream it ran on, allocated through torch's
    allocator and held for the whole run: a warm-up stream's or a capture's would otherwise stay
    allocated beside training, as inductor's CUDA graph trees also avoid). Matmuls allocate them
    again on first use (from the allocator's cache); a captured graph's stays in its pool."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class DecodeEngine:
    """Cache slots, their state, the bucketed step and its graphs. See the module docstring."""

    def __init__(self, model: torch.nn.Module, sampling: SamplingParams, slots: int, max_prompt_len: int, *,
                 use_graphs: bool | None = None, sync_every: int = 16, smallest_bucket: int = 8,
                 length_bucket: int = 128, share_prefix: bool = True, prefill_tokens: int = 16384,
                 admit_min: int | None = None, compile_mode: str | None = None,
                 compile_backend: str = "inductor", lora_mode: str | None = None,
                 tensor: Callable[[torch.Tensor], torch.Tensor] | None = None, fused: bool | None = None,
                 split_layer: bool | None = None, fp32_scores: bool | None = None,
                 sdpa_decode: bool | None = None, flex_decode: bool | None = None,
                 triton_decode: bool | None = None, cublaslt: bool | None = None,
                 shared_prompt_kv: bool | None = None, group_size: int = 1,
                 prompt_slots: int | None = None) -> None:
        self.model, self.sampling = model, sampling
        self.slots, self.prompt_len = slots, max_prompt_len
        self.max_new = sampling.max_new_tokens
        self.length = max_prompt_len + self.max_new
        # How the weights are read: peft's wrappers and LoRA (``lora_mode`` "merged" or "live",
        # adapters.py), and ``tensor``: a ZeRO-3 shadow's copy of each parameter (shadow.py).
        self.adapters = Adapters(model, lora_mode, tensor)
        self.lora_mode = self.adapters.mode if self.adapters.lora else None
        embed = self.adapters.tensor(self.adapters.module(model.model.embed_tokens).weight)
        dev, self.dtype = embed.device, embed.dtype
        self.device = dev
        self.spec = DecoderSpec.of(model, self.dtype, dev)
        # The step's variants (README "Rollouts"; NOTES section 13 has their A/B):
        # ``fused`` (POSTTRAIN_ROLLOUT_FUSE): q|k|v and gate|up as one GEMM each. Default: where
        # the weights lie end to end (decoder.fused_views: DeepSpeed's flat buffers, the ZeRO-3
        # shadow), views of them; True: else copies refreshed every rollout (decoder.fused_buffers);
        # False: never.
        # ``split_layer`` (POSTTRAIN_ROLLOUT_SPLIT): the layer compiled in two halves around eager
        # cache writes; off, one compiled layer writes the cache in place (decoder.decode_layer).
        # ``fp32_scores`` (POSTTRAIN_ROLLOUT_SCORES_FP32): decode attention scores in float32
        # (on CUDA a bf16 bmm with a float32 output), off: a bf16 bmm, then float32.
        # ``sdpa_decode`` (POSTTRAIN_ROLLOUT_SDPA, default on): decode attention as one SDPA call,
        # the training forward's own attention (log-probs as close to it as generate's; off: bmm,
        # softmax, bmm). ``flex_decode`` (POSTTRAIN_ROLLOUT_FLEX, default off: slower than SDPA where
        # timed, NOTES 21): flex_attention instead (rows static for its decoding kernel; shared
        # prompt slots' parts too); ``triton_decode`` (POSTTRAIN_ROLLOUT_TRITON, default on where
        # switches.triton_by_default: CUDA, Triton, a head size the kernels take) triton_decode.py's,
        # before both.
        fuse = env_choice("POSTTRAIN_ROLLOUT_FUSE", fused)
        views = decoder.fused_views(model, self.adapters) if fuse is not False else None
        self.fuse_views = views is not None
        self.fused = decoder.fused_buffers(model, self.adapters) if fuse and views is None else None
        self.split_layer = env_flag("POSTTRAIN_ROLLOUT_SPLIT", split_layer, True)
        self.spec = attention_spec(self.spec, dev, fp32_scores, sdpa_decode, flex_decode, triton_decode)
        # ``cublaslt`` (POSTTRAIN_ROLLOUT_CUBLASLT, default on CUDA): the step's GEMMs chosen by
        # cuBLASLt's heuristics (switches.preferred_blas, scoped to the engine's compile, warm-up and
        # capture): at 128 rows it takes the down projection without split-K and its reduction
        # kernel (NOTES 26).
        self.blas = "cublaslt" if dev.type == "cuda" and env_flag("POSTTRAIN_ROLLOUT_CUBLASLT", cublaslt, True) else None
        self.weights = decoder.read_weights(model, views or self.fused, self.adapters)
        spec = self.spec
        layers = len(self.weights["layers"])
        # ``shared_prompt_kv`` (POSTTRAIN_ROLLOUT_SHARED_PROMPT): each prompt's keys and values once,
        # in prompt slots of ``group_size`` rows (prompt_cache.py); the rows' cache then holds only
        # their completions. ``prompt_slots`` bounds the prompts in flight (default_prompt_slots).
        self.prompts: SharedPrompts | None = None
        self.cache_len = self.length
        if env_flag("POSTTRAIN_ROLLOUT_SHARED_PROMPT", shared_prompt_kv, False):
            if group_size < 1 or (prompt_slots is not None and prompt_slots < 1):
                raise ConfigError(f"group_size ({group_size}) and prompt_slots ({prompt_slots}) must be >= 1")
            capacity = prompt_slots or default_prompt_slots(slots, group_size)
            self.prompts = SharedPrompts(spec, layers, capacity, group_size, max_prompt_len, slots, self.dtype, dev)
            self.cache_len = self.max_new
        shape = (slots, spec.kv_heads, self.cache_len, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)]
        self.sync_every, self.length_bucket = sync_every, max(1, length_bucket)
        self.share_prefix, self.prefill_tokens = share_prefix, prefill_tokens
        self.admit_min = admit_min if admit_min is not None else max(1, slots // 8)
        self.batch_buckets = bucket_sizes(smallest_bucket, slots)
        self.use_graphs = (dev.type == "cuda") if use_graphs is None else use_graphs
        # What torch.compile covers (POSTTRAIN_ROLLOUT_COMPILE): "layer" (default on CUDA) the parts
        # above, "none" nothing (eager kernels captured as they are; CPU's default). ``compile_backend``
        # "aot_eager": tracing without code generation (CPU tests of what CUDA compiles).
        default = os.environ.get("POSTTRAIN_ROLLOUT_COMPILE", "layer") if self.use_graphs else "none"
        self.compile_mode = compile_mode or default
        self.compile_backend = compile_backend
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"POSTTRAIN_ROLLOUT_COMPILE={self.compile_mode!r}: use one of {COMPILE_MODES}")
        n = self.max_new
        # Per-slot state (the graphs hold these addresses: written in place only).
        self.last = torch.zeros(slots, dtype=torch.long, device=dev)  # the token fed to the step
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # its position id
        self.col = torch.zeros(slots, dtype=torch.long, device=dev)  # the cache column it is written to
        self.step = torch.zeros(slots, dtype=torch.long, device=dev)  # index of the token chosen next
        self.seq = torch.zeros(slots, dtype=torch.long, device=dev)  # the sequence's index in the rollout
        self.done = torch.ones(slots, dtype=torch.bool, device=dev)
        self.key_valid = torch.zeros(slots, self.cache_len, dtype=torch.bool, device=dev)  # prompt mask, then ones
        self.out_tokens = torch.zeros(slots, n, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros(slots, n, dtype=torch.float32, device=dev)
        self.row_ids = torch.arange(slots, device=dev)
        self.cols = torch.arange(self.cache_len, device=dev)
        self.key = torch.zeros((), dtype=torch.long, device=dev)  # sampling key of this rollout
        self.limit = torch.full((), n, dtype=torch.long, device=dev)  # this rollout's max_new_tokens
        self.stop_ids = (torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
                         if sampling.stop_token_ids else None)
        self.stop_mask = (torch.zeros(self.spec.vocab, dtype=torch.bool, device=dev).index_fill_(0, self.stop_ids, True)
                          if self.stop_ids is not None else None)
        # Knobs the graph reads (set_knobs changes them, no recompile); the rest is in graph_key.
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.do_sample = torch.ones((), dtype=torch.float32, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.min_new = torch.zeros((), dtype=torch.long, device=dev)
        self.top_k, self.use_top_p = sampling.top_k, sampling.top_p < 1.0
        self.set_knobs(sampling)
        self.width = max_prompt_len  # this rollout's prompt width (set by begin)
        self.prompt_width = 0  # the prompt slots' columns the step reads (shared_prompt_kv; set by begin)
        self.prompt_rows = 0  # the prompt slots the step reads (set by run)
        self.graphs: dict[tuple[int, ...], Any] = {}
        self.pool: Any = None
        self._side: Any = None  # the CUDA stream warm-ups run on
        self.ptrs: list[int] = []  # the weights' addresses the graphs read
        self.stats: dict[str, Any] = {"captures": 0, "recaptures": 0, "capture_s": 0.0, "compile_fallbacks": 0,
                                      "capture_fallbacks": 0, "storage_moves": 0, "graph_pool_bytes": 0,
                                      "prefill_rows": 0, "prefill_sequences": 0, "admissions": 0,
                                      "compactions": 0, "decode_steps": 0, "row_steps": 0,
                                      "cache_cells_read": 0, "split_fallbacks": 0, "sdpa_fallbacks": 0,
                                      "flex_fallbacks": 0, "triton_fallbacks": 0, "fused_fallbacks": 0,
                                      "prompt_compactions": 0, "prompt_joins": 0, "prompt_waits": 0,
                                      "shared_prompt_kv": self.prompts is not None,
                                      "prompt_kv_bytes": self.prompts.nbytes if self.prompts else 0}
        self.fallback_reasons: list[str] = []
        self._prepared = False
        self._captured_keys: set[tuple[int, ...]] = set()
        self._eager_parts()

    # -- knobs and weights ---------------------------------------------------------------------
    @staticmethod
    def graph_key(sampling: SamplingParams) -> tuple:
        """What a compiled step is specialised on; other knobs are buffers."""
        return (sampling.top_k, sampling.top_p < 1.0, tuple(sampling.stop_token_ids), sampling.pad_token_id)

    def set_knobs(self, sampling: SamplingParams) -> None:
        if self.graph_key(sampling) != self.graph_key(self.sampling):
            raise ValueError("set_knobs: top_k, top-p on/off, stop tokens and pad are fixed per engine")
        self.temperature.fill_(sampling.temperature)
        self.do_sample.fill_(1.0 if sampling.do_sample else 0.0)
        self.top_p.fill_(sampling.top_p)
        self.min_new.fill_(sampling.min_new_tokens)
        self.sampling = sampling

    @property
    def cache_nbytes(self) -> int:
        """The KV cache's bytes: the rows' slots and the shared prompt slots."""
        rows = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        return rows + (self.prompts.nbytes if self.prompts else 0)

    @property
    def fused_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.fused or [] for t in e.values() if t is not None)

    @property
    def fused_projections(self) -> str:
        """How q|k|v and gate|up run: "views" (fused, no copy), "copies" (fused) or "off"."""
        return "views" if self.fuse_views else "copies" if self.fused else "off"

    @property
    def lora_nbytes(self) -> int:
        """Bytes of LoRA's merged buffers (mode "merged"; 0 otherwise)."""
        return self.adapters.nbytes

    def _weight_ptrs(self) -> list[int]:
        def flat(x: Any) -> list[int]:
            if isinstance(x, torch.Tensor):
                return [x.data_ptr()]
            if isinstance(x, dict):
                return [p for v in x.values() for p in flat(v)]
            if isinstance(x, (list, tuple)):
                return [p for v in x for p in flat(v)]
            return []

        return flat({k: v for k, v in self.weights.items() if k != "inv_freq"})

    def begin(self, key: int, max_new_tokens: int, width: int) -> None:
        """A new rollout: its key, length limit and prompt width; re-read the weights (live)."""
        if width > self.prompt_len:
            raise ConfigError(f"prompts of {width} tokens exceed the engine's max_prompt_len={self.prompt_len}; "
                              "build the Rollout larger")
        if max_new_tokens > self.max_new:
            raise ConfigError(f"max_new_tokens={max_new_tokens} exceeds the {self.max_new} the Rollout was built "
                              "for; build it with the largest max_new_tokens")
        self.adapters.refresh()  # LoRA: merged buffers or scalings, in place
        if self.fused:
            decoder.refresh_fused(self.model, self.fused, self.adapters)
        fused = self.fused
        if self.fuse_views:
            fused = decoder.fused_views(self.model, self.adapters)
            if fused is None:  # a parameter was re-allocated apart from its group: unfused from now on
                self.fuse_views = False
                self.stats["fused_fallbacks"] += 1
                self._fall_back("fused q|k|v and gate|up views", RuntimeError("a weight no longer lies beside its group"))
        self.weights = decoder.read_weights(self.model, fused, self.adapters)
        ptrs = self._weight_ptrs()
        if self.ptrs and ptrs != self.ptrs:
            # A parameter's storage moved (replaced, not written in place): graphs would read the old
            # addresses, so they are captured again on use (an eager step reads the new ones).
            self.stats["storage_moves"] += 1
            logger.info("rollout: a parameter's storage moved since the last rollout%s",
                        "; recapturing" if self.graphs else "")
            self.graphs.clear()
        self.ptrs = ptrs
        self.key.fill_(key)
        self.limit.fill_(max_new_tokens)
        self.width = width
        if self.prompts is not None:
            self.prompts.reset()
            self.prompt_width = min(self.prompt_len, math.ceil(max(1, width) / self.length_bucket) * self.length_bucket)
        self.done.fill_(True)

    def columns(self, new_tokens: int) -> int:
        """The row cache's columns that hold a row with ``new_tokens`` completion tokens."""
        return new_tokens if self.prompts is not None else self.width + new_tokens

    def done_flags(self, rows: int) -> list[bool]:
        return self.done[:rows].tolist()  # one host sync

    # -- the step ------------------------------------------------------------------------------
    def _eager_parts(self) -> None:
        self._inputs_fn: Callable = step.inputs
        self._qkv_fn: Callable = decoder.project_qkv
        self._post_fn: Callable = decoder.decode_layer_post
        self._out_fn: Callable = decoder.decode_layer_out
        self._layer_fn: Callable = decoder.decode_layer
        self._sample_fn: Callable = step.sample
        self._record_fn: Callable = step.record
        self._prompt_fn: Callable = step.prompt_inputs

    def compile_parts(self, backend: str = "inductor") -> None:
        """``torch.compile`` the prologue, a decoder layer (whole, or its two halves with
        ``split_layer``), the sampler and the epilogue (fullgraph: a graph break raises, and
        _prepare falls back, counted). Dynamic shapes: one compile serves every (rows, columns)
        bucket. Inductor emulates the eager forward's casts to the model dtype
        (``emulate_precision_casts``), so fusing changes no rounding."""
        import torch._dynamo

        # Each engine (and knob set) is a recompile of the same functions: keep clear of the limit,
        # past which dynamo would run them eagerly without a word.
        limit = max(64, getattr(torch._dynamo.config, "recompile_limit", 8))
        torch._dynamo.config.recompile_limit = limit
        if hasattr(torch._dynamo.config, "cache_size_limit"):
            torch._dynamo.config.cache_size_limit = max(limit, torch._dynamo.config.cache_size_limit)
        options: dict[str, Any] = dict(fullgraph=True, dynamic=True, backend=backend)
        if backend == "inductor":
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "emulate_precision_casts"):
                options["options"] = {"emulate_precision_casts": True}
        self._inputs_fn = torch.compile(step.inputs, **options)
        if self.split_layer:
            self._qkv_fn = torch.compile(decoder.project_qkv, **options)
            self._post_fn = torch.compile(decoder.decode_layer_post, **options)
            self._out_fn = torch.compile(decoder.decode_layer_out, **options)
        else:
            self._layer_fn = torch.compile(decoder.decode_layer, **options)
        self._sample_fn = torch.compile(step.sample, **options)
        self._record_fn = torch.compile(step.record, **options)
        self._prompt_fn = torch.compile(step.prompt_inputs, **options)

    def _step(self, rows: int, length: int) -> None:
        """One token for rows ``:rows`` over cache columns ``:length`` (and, with shared prompt
        slots, slots ``:prompt_rows`` over their columns ``:prompt_width``)."""
        spec, w, layers = self.spec, self.weights, self.weights["layers"]
        x, h, cos, sin, bias, where = self._inputs_fn(spec, self.last[:rows], self.pos[:rows], self.col[:rows],
                                                      self.key_valid[:rows, :length], self.cols[:length], w["embed"],
                                                      layers[0]["ln1"], w["inv_freq"], self.cache_len)
        sp, s, pw = self.prompts, self.prompt_rows, self.prompt_width
        if sp is not None:
            pbias, members, place = self._prompt_fn(sp.valid[:s, :pw], sp.members[:s], sp.place[:rows], x.dtype)
        static = _static_rows if spec.flex_decode and self.compile_mode != "none" else _as_they_are
        d = spec.head_dim
        for i, lw in enumerate(layers):
            # Each layer ends with the next one's input norm (the final norm after the last).
            next_norm = layers[i + 1]["ln1"] if i + 1 < len(layers) else w["norm"]
            prompt = None if sp is None else static(sp.keys[i][:s, :, :pw], sp.values[i][:s, :, :pw], pbias, members,
                                                    place)
            if not self.split_layer:
                x, h, bias = static(x, h, bias)
                x, h = self._layer_fn(spec, lw, x, h, cos, sin, self.keys[i], self.values[i], where, bias, next_norm,
                                      prompt)
                continue
            if spec.triton_decode:  # the kernel rotates q and k and writes k and v into the cache as it attends
                from posttrain.rollout.kernels import decode_attention as triton_decode

                rotate = triton_decode.ROTATE
                q, k, v = self._qkv_fn(spec, lw, h, cos, sin, not rotate)
                attn = triton_decode.attend_step(q, k, v, self.keys[i][:rows, :, :length],
                                                 self.values[i][:rows, :, :length], bias, self.col[:rows],
                                                 cos if rotate else None, sin if rotate else None, spec.scaling, prompt)
                x, h = self._out_fn(spec, lw, x, attn, next_norm)
                continue
            q, k, v = self._qkv_fn(spec, lw, h, cos, sin)
            # One index_copy per cache: row r's head h goes to flat row (r * kv_heads + h) * max_len + col.
            self.keys[i].view(-1, d).index_copy_(0, where, k.reshape(-1, d))
            self.values[i].view(-1, d).index_copy_(0, where, v.reshape(-1, d))
            x, q, keys, values, bias = static(x, q, self.keys[i][:rows, :, :length], self.values[i][:rows, :, :length],
                                              bias)
            x, h = self._post_fn(spec, lw, x, q, keys, values, bias, next_norm, prompt)
        tokens, logprobs = self._sample_fn(spec, h, w["head"], w["head_bias"], w["head_lora"], self.step[:rows],
                                           self.seq[:rows], self.key, self.temperature, self.do_sample, self.top_p,
                                           self.min_new, self.top_k, self.use_top_p, self.stop_ids, self.stop_mask,
                                           self.sampler_kernel())
        self._record_fn(self.done, self.step, self.last, self.pos, self.col, self.out_tokens, self.out_logprobs,
                        tokens, logprobs, self.limit, self.stop_mask, self.sampling.pad_token_id)

    def sampler_kernel(self) -> bool:
        """Whether the step samples with posttrain's Triton sampler: with the Triton decode kernels,
        where the sampling has no top-k or top-p (``triton_sample.ENABLED`` off: never)."""
        if not self.spec.triton_decode or self.top_k or self.use_top_p:
            return False
        from posttrain.rollout.kernels import sample as triton_sample

        return triton_sample.ENABLED

    def run(self, rows: int, length: int, steps: int) -> None:
        """``steps`` decode steps of bucket (rows, length): graph replays on CUDA, else the step."""
        self.stats["decode_steps"] += steps
        self.stats["row_steps"] += steps * rows
        self.stats["cache_cells_read"] += steps * rows * length
        if self.prompts is not None:
            self.prompt_rows = self.prompts.bucket()
            self.stats["cache_cells_read"] += steps * self.prompt_rows * self.prompt_width
        if not self._prepared:
            self._prepare(rows, length)
        graph = self.graphs.get(self._graph_key(rows, length))
        if graph is None and self.use_graphs:
            graph = self._capture(rows, length)
        with torch.no_grad():
            if graph is not None:
                for _ in range(steps):
                    graph.replay()
                return
            with preferred_blas(self.blas):
                for _ in range(steps):
                    self._step(rows, length)

    # -- compile and capture -------------------------------------------------------------------
    def _graph_key(self, rows: int, length: int) -> tuple[int, ...]:
        return (rows, length, self.prompt_rows, self.prompt_width) if self.prompts is not None else (rows, length)

    def _state(self) -> list[torch.Tensor]:
        return [self.last, self.pos, self.col, self.step, self.done, self.out_tokens, self.out_logprobs]

    def _warm_up(self, rows: int, length: int) -> None:
        """Run the step on the real buffers (restored after): compile, autotune and allocate
        outside capture; on CUDA three times on a side stream, as capture requires."""
        saved = [t.clone() for t in self._state()]
        try:
            with torch.no_grad(), preferred_blas(self.blas):
                if self.device.type == "cuda":
                    if self._side is None:  # one side stream for every warm-up
                        self._side = torch.cuda.Stream()
                    self._side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self._side):
                        for _ in range(3):
                            self._step(rows, length)
                    torch.cuda.current_stream().wait_stream(self._side)
                    _release_cublas_workspaces()
                else:
                    self._step(rows, length)
        finally:
            for t, s in zip(self._state(), saved):
                t.copy_(s)

    def _fall_back(self, what: str, err: Exception) -> None:
        reason = f"{what} ({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''})"
        self.fallback_reasons.append(reason)
        logger.warning("rollout: %s; the decode step is now slower (counted in rollout stats)", reason)

    def _prepare(self, rows: int, length: int) -> None:
        """Compile the step's parts (``compile_mode`` "layer") and run it once. A whole layer that
        fails to compile is retried split (``stats["split_fallbacks"]``), flex_attention with SDPA
        (``stats["flex_fallbacks"]``; the Triton kernels likewise, ``triton_fallbacks``), SDPA decode
        attention with bmm and softmax (``stats["sdpa_fallbacks"]``), a compile that fails is
        retried with bf16 attention scores if it had float32 ones (``stats["fp32_scores"]``
        says which ran), then falls back to the eager parts: logged, and counted in
        ``stats["compile_fallbacks"]``."""
        tick = time.perf_counter()
        self._prepared = True
        self.stats["fp32_scores"] = self.spec.fp32_scores
        self.stats["split_layer"] = self.split_layer
        self.stats["sdpa_decode"] = self.spec.sdpa_decode
        self.stats["flex_decode"] = self.spec.flex_decode
        self.stats["triton_decode"] = self.spec.triton_decode
        self.stats["triton_sampler"] = self.sampler_kernel()
        self.stats["triton_pointwise"] = self.spec.triton_pointwise
        self.stats["blas"] = self.blas or "default"
        if self.compile_mode == "none":
            return
        while True:
            self.compile_parts(self.compile_backend)
            try:
                self._warm_up(rows, length)
                break
            except Exception as err:  # noqa: BLE001 - e.g. something dynamo cannot trace in one graph
                if not self.split_layer:
                    self._fall_back("torch.compile of the whole layer (cache writes inside) failed; compiling it "
                                    "in two halves", err)
                    self.split_layer, self.stats["split_layer"] = True, True
                    self.stats["split_fallbacks"] += 1
                    continue
                # The decode attention's switches, first on first off: Triton -> flex -> SDPA -> bmm.
                on = next((f for f in ("triton_decode", "flex_decode", "sdpa_decode") if getattr(self.spec, f)), None)
                if on is not None:
                    self.spec = dataclasses.replace(self.spec, **{on: False}, triton_pointwise=False)
                    instead = ("flex_attention" if self.spec.flex_decode else "SDPA" if self.spec.sdpa_decode
                               else "bmm and softmax")
                    self._fall_back(f"torch.compile of the step with {ATTENTION_NAMES[on]} failed; retrying with "
                                    f"{instead}", err)
                    self.stats[on] = False
                    self.stats[on.replace("_decode", "_fallbacks")] += 1
                    self.stats["triton_sampler"] = self.sampler_kernel()
                    self.stats["triton_pointwise"] = self.spec.triton_pointwise
                    continue
                if self.spec.fp32_scores and self.dtype != torch.float32 and self.device.type == "cuda":
                    self._fall_back("torch.compile of the step with float32 attention scores failed; retrying "
                                    "with bf16 scores", err)
                    self.spec = dataclasses.replace(self.spec, fp32_scores=False)
                    self.stats["fp32_scores"] = False
                    continue
                self._fall_back("torch.compile of the decode step failed; running the eager step", err)
                self.stats["compile_fallbacks"] += 1
                self.compile_mode = "none"
                self._eager_parts()
                break
        self.stats["capture_s"] += time.perf_counter() - tick

    def _capture(self, rows: int, length: int) -> Any:
        """Capture bucket (rows, length) as a CUDA graph (after a warm-up); a capture that fails
        leaves the engine without graphs, logged and counted in ``stats["capture_fallbacks"]``."""
        tick = time.perf_counter()
        self._warm_up(rows, length)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        saved = [t.clone() for t in self._state()]
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        try:
            with torch.cuda.graph(graph, pool=self.pool), torch.no_grad(), preferred_blas(self.blas):
                self._step(rows, length)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: no graph
            self._fall_back("CUDA graph capture of the decode step failed; decoding without a graph", err)
            self.stats["capture_fallbacks"] += 1
            torch.cuda.synchronize()
            graph, self.use_graphs = None, False
        _release_cublas_workspaces()
        self.stats["graph_pool_bytes"] += torch.cuda.memory_reserved() - reserved
        for t, s in zip(self._state(), saved):
            t.copy_(s)
        if graph is not None:
            key = self._graph_key(rows, length)
            if key in self._captured_keys:
                self.stats["recaptures"] += 1
            self._captured_keys.add(key)
            self.graphs[key] = graph
            self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - tick
        return graph

    # -- buckets ---------------------------------------------------------------------------------
    def rows_bucket(self, rows: int) -> int:
        return next(b for b in self.batch_buckets if b >= rows)

    def length_bucket_for(self, columns: int) -> int:
        return min(self.cache_len, math.ceil(columns / self.length_bucket) * self.length_bucket)
