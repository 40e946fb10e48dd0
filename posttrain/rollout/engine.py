"""The decode engine (nano-vllm's model runner): slots and the step over (rows, columns) buckets, compiled
and captured as CUDA graphs on CUDA; every fallback logged and counted."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rollout import kernels, prefill, weights
from posttrain.rollout.adapters import Adapters
from posttrain.rollout.decoder import DecoderSpec
from posttrain.rollout.prompt_cache import SharedPrompts, bucket_sizes, default_prompt_slots
from posttrain.rollout.sampling import SamplingParams, choose_tokens, seen_tokens
from posttrain.rollout.slots import Slots
from posttrain.rollout.step import Parts

logger = logging.getLogger(__name__)

# Counters that add up over a run (a Rollout carries them over when it builds a new engine).
RUN_COUNTERS = ("captures", "recaptures", "capture_s", "compile_fallbacks", "capture_fallbacks", "storage_moves",
                "sleeps")
COUNTERS = (*RUN_COUNTERS, "triton_fallbacks", "fused_fallbacks", "lora_fallbacks", "graph_pool_bytes", "prefill_rows",
            "prefill_sequences", "admissions", "compactions", "decode_steps", "row_steps", "cache_cells_read",
            "prompt_compactions", "prompt_joins", "prompt_waits")


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


@contextlib.contextmanager
def preferred_blas(name: str | None) -> Iterator[None]:
    """torch's preferred BLAS library ``name`` inside (None: unchanged), the previous after."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _release_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces so warm-ups don't hold them beside training."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class DecodeEngine:
    """Cache slots, state, bucketed step and graphs. ``compile_backend`` None: inductor on CUDA, else eager;
    ``triton_decode`` None: Triton on CUDA, True: required, False: SDPA."""

    def __init__(self, model: torch.nn.Module, sampling: SamplingParams, slots: int, max_prompt_len: int, *,
                 tensor: Callable[[torch.Tensor], torch.Tensor] | None = None, layout: Any = None,
                 lora_mode: str = "auto",
                 fused: bool = False, shared_prompt_kv: bool = False, group_size: int = 1,
                 prompt_slots: int | None = None, sync_every: int = 16, smallest_bucket: int = 8,
                 length_bucket: int = 128, prefill_tokens: int = 16384, admit_min: int | None = None,
                 compile_backend: str | Callable | None = None, triton_decode: bool | None = None) -> None:
        self.model, self.sampling = model, sampling
        self.prompt_len, self.max_new = max_prompt_len, sampling.max_new_tokens
        self.length = max_prompt_len + self.max_new
        self.adapters = Adapters(model, lora_mode, tensor, layout)
        self.lora_mode = self.adapters.mode if self.adapters.lora else None
        embed = self.adapters.tensor(self.adapters.module(model.model.embed_tokens).weight)
        self.device, self.dtype = embed.device, embed.dtype
        self._stats: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        self._stats["capture_s"] = 0.0
        self.fallback_reasons: list[str] = []
        self.spec = self._attention(DecoderSpec.of(model), triton_decode)
        self.blas = "cublaslt" if self.device.type == "cuda" else None
        # Fused q|k|v and gate|up: views where possible, else copies if ``fused``, else separate GEMMs.
        views = weights.fused_views(model, self.adapters)
        self.fuse_views = views is not None
        # Appended LoRA buffers already fuse each group (no copy of the base to make).
        copies = fused and views is None and not self.adapters.appends
        self.fused = weights.fused_buffers(model, self.adapters) if copies else None
        self.weights = weights.read_weights(model, views or self.fused, self.adapters)
        if self.adapters.mode == "grouped" and self.adapters.groups:
            self._fall_back(f"LoRA mode grouped: {len(self.adapters.groups)} projection group(s) run separate low-rank "
                            "products, not the appended GEMM (a trainable base weight, or unlike base weights)",
                            counter="lora_fallbacks")
        layers = len(self.weights["layers"])
        self.prompts: SharedPrompts | None = None
        cache_len = self.length
        if shared_prompt_kv:
            if group_size < 1 or (prompt_slots is not None and prompt_slots < 1):
                raise ConfigError(f"group_size ({group_size}) and prompt_slots ({prompt_slots}) must be >= 1")
            capacity = prompt_slots or default_prompt_slots(slots, group_size)
            self.prompts = SharedPrompts(self.spec, layers, capacity, group_size, max_prompt_len, slots, self.dtype,
                                         self.device)
            cache_len = self.max_new  # the rows' cache holds only their completions
        self.use_penalty = sampling.repetition_penalty != 1.0
        self.slots = Slots(slots, layers, self.spec.kv_heads, self.spec.head_dim, cache_len, self.max_new,
                           self.dtype, self.device, vocab=self.spec.vocab if self.use_penalty else None)
        self.sync_every, self.length_bucket = sync_every, max(1, length_bucket)
        self.prefill_tokens = prefill_tokens
        self.admit_min = admit_min if admit_min is not None else max(1, slots // 8)
        self.batch_buckets = bucket_sizes(smallest_bucket, slots)
        self.use_graphs = self.device.type == "cuda"
        self.compile_backend = ("inductor" if compile_backend is None and self.device.type == "cuda"
                                else compile_backend)
        self.compiled = compile_backend is not None
        self.parts = Parts.eager()
        self._prepared = False
        # Scalars the graphs read: written in place only; set_knobs changes the knobs, graph_key the rest.
        dev = self.device
        self.key = torch.zeros((), dtype=torch.long, device=dev)  # sampling key of this rollout
        self.limit = torch.full((), self.max_new, dtype=torch.long, device=dev)  # this rollout's max_new_tokens
        self.stop_ids = (torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
                         if sampling.stop_token_ids else None)
        self.stop_mask = (torch.zeros(self.spec.vocab, dtype=torch.bool, device=dev).index_fill_(0, self.stop_ids, True)
                          if self.stop_ids is not None else None)
        self.temperature, self.do_sample, self.top_p, self.min_p, self.penalty = (
            torch.ones((), dtype=torch.float32, device=dev) for _ in range(5))
        self.min_new = torch.zeros((), dtype=torch.long, device=dev)
        self.top_k, self.use_top_p, self.use_min_p = sampling.top_k, sampling.top_p < 1.0, sampling.min_p is not None
        self.set_knobs(sampling)
        self.width = max_prompt_len  # this rollout's prompt width (set by begin)
        self.prompt_width = 0  # the prompt slots' columns the step reads (shared_prompt_kv; set by begin)
        self.prompt_rows = 0  # the prompt slots the step reads (set by run)
        self.graphs: dict[tuple[int, ...], Any] = {}
        self.pool: Any = None
        self._side: Any = None  # the CUDA stream warm-ups run on
        self.ptrs: list[int] = []  # the weights' addresses the graphs read
        self._captured_keys: set[tuple[int, ...]] = set()

    def _attention(self, spec: DecoderSpec, triton_decode: bool | None) -> DecoderSpec:
        """``spec`` with the Triton kernels where they run, else SDPA (counted on CUDA)."""
        if triton_decode is False or (triton_decode is None and self.device.type != "cuda"):
            return spec
        why = kernels.unavailable(self.device, spec.head_dim)
        if why is None:
            return dataclasses.replace(spec, triton=True)
        if triton_decode:
            raise ConfigError(f"triton_decode: {why}")
        self._fall_back(f"{why}; decode attention by SDPA", counter="triton_fallbacks")
        return spec

    @staticmethod
    def graph_key(sampling: SamplingParams) -> tuple:
        """What a compiled step is specialised on; other knobs are buffers."""
        return (sampling.top_k, sampling.top_p < 1.0, sampling.min_p is not None, tuple(sampling.stop_token_ids),
                sampling.pad_token_id, sampling.repetition_penalty != 1.0)

    def set_knobs(self, sampling: SamplingParams) -> None:
        if self.graph_key(sampling) != self.graph_key(self.sampling):
            raise ValueError("set_knobs: top_k, top-p, min-p and the repetition penalty on/off, stop tokens and pad "
                             "are fixed per engine")
        self.temperature.fill_(sampling.temperature)
        self.do_sample.fill_(1.0 if sampling.do_sample else 0.0)
        self.top_p.fill_(sampling.top_p)
        self.min_p.fill_(sampling.min_p or 0.0)
        self.penalty.fill_(sampling.repetition_penalty)
        self.min_new.fill_(sampling.min_new_tokens)
        self.sampling = sampling

    @property
    def cache_nbytes(self) -> int:
        """The KV cache's bytes: the rows' slots and the shared prompt slots."""
        return self.slots.nbytes + (self.prompts.nbytes if self.prompts else 0)

    def sampler_kernel(self) -> bool:
        """Whether the step uses the Triton sampler (Triton kernels, no top-k, top-p, min-p or repetition penalty)."""
        return (self.spec.triton and not self.top_k and not self.use_top_p and not self.use_min_p
                and not self.use_penalty)

    def stats(self) -> dict[str, Any]:
        """The engine's counters, what it runs and each fallback's reason."""
        return {**self._stats, "capture_s": round(self._stats["capture_s"], 3), "triton_decode": self.spec.triton,
                "triton_sampler": self.sampler_kernel(), "compiled": self.compiled, "graphs": len(self.graphs),
                "blas": self.blas or "default", "shared_prompt_kv": self.prompts is not None,
                "prompt_kv_bytes": self.prompts.nbytes if self.prompts else 0, "kv_cache_bytes": self.cache_nbytes,
                "fused_weight_bytes": sum(t.numel() * t.element_size() for e in self.fused or [] for t in e.values()
                                          if t is not None),
                "fused_projections": "views" if self.fuse_views else "copies" if self.fused else "off",
                "lora_mode": self.lora_mode, "lora_merged_bytes": self.adapters.nbytes,
                "lora_appended_groups": len(self.adapters.appended), "lora_repointed": self.adapters.repointed,
                "fallback_reasons": list(self.fallback_reasons)}

    def _fall_back(self, reason: str, err: Exception | None = None, counter: str | None = None) -> None:
        if err is not None:
            reason += f" ({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''})"
        self.fallback_reasons.append(reason)
        if counter is not None:
            self._stats[counter] += 1
        logger.warning("rollout: %s; the decode step is now slower (counted in rollout stats)", reason)

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

    def sleep(self) -> None:
        """Free the KV cache and the decode graphs until the next rollout (TRL's ``vllm_enable_sleep_mode``): the
        memory goes to training; the next rollout allocates the cache again and captures its graphs anew."""
        self.graphs.clear()
        self._captured_keys.clear()  # captured again after waking: not recaptures
        self.pool = None
        self.ptrs = []
        self.slots.sleep()
        if self.prompts is not None:
            self.prompts.sleep()
        self._stats["sleeps"] += 1

    def begin(self, key: int, max_new_tokens: int, width: int) -> None:
        """A new rollout: its key, length limit and widest prompt; every slot free; re-read the weights."""
        if width > self.prompt_len:
            raise ConfigError(f"prompts of {width} tokens exceed the engine's max_prompt_len={self.prompt_len}; "
                              "build the Rollout larger")
        if max_new_tokens > self.max_new:
            raise ConfigError(f"max_new_tokens={max_new_tokens} exceeds the {self.max_new} the Rollout was built "
                              "for; build it with the largest max_new_tokens")
        self.slots.wake()
        if self.prompts is not None:
            self.prompts.wake()
        self.refresh()
        self.key.fill_(key)
        self.limit.fill_(max_new_tokens)
        self.width = width
        if self.prompts is not None:
            self.prompts.reset()
            self.prompt_width = min(self.prompt_len, math.ceil(max(1, width) / self.length_bucket) * self.length_bucket)
        self.slots.reset()

    def refresh(self) -> None:
        """Re-read the weights after they changed (LoRA: merged buffers or scalings, in place); the slots and
        their sequences stay (a stream's rows decode on under the new weights)."""
        self.adapters.refresh()
        if self.fused:
            weights.refresh_fused(self.model, self.fused, self.adapters)
        fused = self.fused
        if self.fuse_views:
            fused = weights.fused_views(self.model, self.adapters)
            if fused is None:  # a parameter was re-allocated apart from its group: unfused from now on
                self.fuse_views = False
                self._fall_back("fused q|k|v and gate|up views: a weight no longer lies beside its group",
                                counter="fused_fallbacks")
        self.weights = weights.read_weights(self.model, fused, self.adapters)
        ptrs = self._weight_ptrs()
        if self.ptrs and ptrs != self.ptrs:
            # A parameter was replaced, not written in place: graphs would read the old addresses.
            self._stats["storage_moves"] += 1
            logger.info("rollout: a parameter's storage moved since the last rollout%s",
                        "; recapturing" if self.graphs else "")
            self.graphs.clear()
        self.ptrs = ptrs

    @torch.no_grad()
    def admit(self, slots: list[int], seq_ids: list[int], ids: torch.Tensor, mask: torch.Tensor,
              groups: list[int] | None = None, key: int | None = None) -> None:
        """Prefill sequences (left-padded ``ids`` of at most ``max_prompt_len`` columns) into ``slots`` and choose
        their first token; ``key``: their sampling key (default the rollout's)."""
        dev, p = self.device, ids.shape[1]
        if p > self.prompt_len or (self.prompts is not None and p != self.width):
            raise ConfigError(f"prompts of {p} columns do not fit this rollout (max_prompt_len={self.prompt_len}"
                              f"{'' if self.prompts is None else f', shared prompts of {self.width}'})")
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        seq_t = torch.tensor(seq_ids, dtype=torch.long, device=dev)
        ids, mask = ids.to(dev), mask.to(dev).long()
        valid = torch.ones(len(slots), self.slots.length, dtype=torch.bool, device=dev)
        if self.prompts is not None:
            groups = groups if groups is not None else list(range(len(slots)))
            logits, prefilled, joins = prefill.into_prompt_slots(self.spec, self.weights, self.prompts, slots, ids,
                                                                 mask, groups, self.prefill_tokens, self.dtype)
            self._stats["prompt_joins"] += joins
        else:
            logits, prefilled = prefill.into_rows(self.spec, self.weights, self.slots, slot_t, ids, mask,
                                                  self.prefill_tokens, self.dtype)
            valid[:, :p] = mask.bool()
        keys = self.key.expand(len(slots)).clone() if key is None else torch.full_like(seq_t, key)
        seen = seen_tokens(ids, mask, self.spec.vocab) if self.use_penalty else None
        tokens, logprobs = choose_tokens(
            logits, torch.zeros(len(slots), dtype=torch.long, device=dev), keys, seq=seq_t,
            temperature=self.temperature, do_sample=self.do_sample, top_k=self.top_k, top_p=self.top_p,
            use_top_p=self.use_top_p, min_new_tokens=self.min_new, stop_ids=self.stop_ids, min_p=self.min_p,
            use_min_p=self.use_min_p, seen=seen, penalty=self.penalty)
        done = self.limit <= 1
        if self.stop_ids is not None:
            done = done | self.stop_mask[tokens]
        col = 0 if self.prompts is not None else p  # the first completion token's cache column
        self.slots.admit(slot_t, seq_t, keys, tokens, logprobs, mask.sum(1), valid, col, done,
                         self.sampling.pad_token_id, seen)
        self._stats["prefill_rows"] += prefilled
        self._stats["prefill_sequences"] += len(slots)
        self._stats["admissions"] += 1

    def fits(self, groups: list[int]) -> int:
        """How many of the next sequences the shared prompt slots take now (a wait is counted)."""
        if self.prompts is None:
            return len(groups)
        fit = self.prompts.fits(groups)
        self._stats["prompt_waits"] += fit < len(groups)
        return fit

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Sequences from slots ``src`` to free slots ``dst`` (compaction; cache columns ``:length``)."""
        self.slots.move(src, dst, length)
        if self.prompts is not None:
            self.prompts.move_rows(src, dst)
        self._stats["compactions"] += 1

    def compact_prompts(self) -> None:
        """Move shared prompt slots down where that lets the step read fewer."""
        if self.prompts is not None and self.prompts.compact(self.width):
            self._stats["prompt_compactions"] += 1

    def free(self, slots: list[int]) -> None:
        """Drop the sequences in ``slots`` unfinished; the slots free."""
        self.slots.free(slots)
        if self.prompts is not None:
            self.prompts.leave(slots)

    def harvest(self, slots: list[int], seq_ids: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Finished slots' outputs into the rollout's results; the slots free."""
        self.slots.harvest(slots, seq_ids, tokens, logprobs)
        if self.prompts is not None:
            self.prompts.leave(slots)

    def columns(self, new_tokens: int, width: int | None = None) -> int:
        """The row cache's columns that hold a row of a ``width``-column prompt (default the rollout's) with
        ``new_tokens`` completion tokens."""
        return new_tokens if self.prompts is not None else (self.width if width is None else width) + new_tokens

    def done_flags(self, rows: int) -> list[bool]:
        return self.slots.done_flags(rows)

    def _step(self, rows: int, length: int) -> None:
        """One token for rows ``:rows`` over cache columns ``:length``."""
        spec, w, layers, parts, st = self.spec, self.weights, self.weights["layers"], self.parts, self.slots
        x, h, cos, sin, bias, where = parts.inputs(spec, st.last[:rows], st.pos[:rows], st.col[:rows],
                                                   st.key_valid[:rows, :length], st.cols[:length], w["embed"],
                                                   layers[0]["ln1"], w["inv_freq"], st.length)
        sp, s, pw = self.prompts, self.prompt_rows, self.prompt_width
        if sp is not None:
            pbias, members, place = parts.prompt(sp.valid[:s, :pw], sp.members[:s], sp.place[:rows], x.dtype)
        d = spec.head_dim
        for i, lw in enumerate(layers):
            # Each layer ends with the next one's input norm (the final norm after the last).
            next_norm = layers[i + 1]["ln1"] if i + 1 < len(layers) else w["norm"]
            prompt = None if sp is None else (sp.keys[i][:s, :, :pw], sp.values[i][:s, :, :pw], pbias, members, place)
            keys, values = st.keys[i][:rows, :, :length], st.values[i][:rows, :, :length]
            if spec.triton:  # the kernel rotates q and k and writes k and v into the cache as it attends
                from posttrain.rollout.kernels import decode_attention

                q, k, v = parts.qkv(spec, lw, h, cos, sin, False)
                attn = decode_attention.attend_step(q, k, v, keys, values, bias, st.col[:rows], cos, sin,
                                                    spec.scaling, prompt)
                x, h = parts.out(spec, lw, x, attn, next_norm)
                continue
            q, k, v = parts.qkv(spec, lw, h, cos, sin)
            st.keys[i].view(-1, d).index_copy_(0, where, k.reshape(-1, d))
            st.values[i].view(-1, d).index_copy_(0, where, v.reshape(-1, d))
            x, h = parts.post(spec, lw, x, q, keys, values, bias, next_norm, prompt)
        tokens, logprobs = parts.sample(spec, h, w["head"], w["head_bias"], w["head_lora"], st.step[:rows],
                                        st.seq[:rows], st.sample_key[:rows], self.temperature, self.do_sample, self.top_p,
                                        self.min_new, self.top_k, self.use_top_p, self.stop_ids, self.stop_mask,
                                        self.sampler_kernel(), self.min_p, self.use_min_p,
                                        None if st.seen is None else st.seen[:rows], self.penalty)
        st.record(tokens, logprobs, self.limit, self.stop_mask, self.sampling.pad_token_id, parts.record)

    def run(self, rows: int, length: int, steps: int) -> None:
        """``steps`` decode steps of bucket (rows, length): graph replays on CUDA, else the step."""
        self._stats["decode_steps"] += steps
        self._stats["row_steps"] += steps * rows
        self._stats["cache_cells_read"] += steps * rows * length
        if self.prompts is not None:
            self.prompt_rows = self.prompts.bucket()
            self._stats["cache_cells_read"] += steps * self.prompt_rows * self.prompt_width
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

    def _graph_key(self, rows: int, length: int) -> tuple[int, ...]:
        return (rows, length, self.prompt_rows, self.prompt_width) if self.prompts is not None else (rows, length)

    def _warm_up(self, rows: int, length: int) -> None:
        """Run the step on the real buffers (restored after), outside capture."""
        saved = [t.clone() for t in self.slots.written_by_step()]
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
            for t, s in zip(self.slots.written_by_step(), saved):
                t.copy_(s)

    def _prepare(self, rows: int, length: int) -> None:
        """Compile the step's parts and run it once, falling back (counted) on failure."""
        tick = time.perf_counter()
        self._prepared = True
        if not self.compiled:
            return
        while True:
            self.parts = Parts.compiled(self.compile_backend)
            try:
                self._warm_up(rows, length)
                break
            except Exception as err:  # noqa: BLE001 - e.g. something dynamo cannot trace in one graph
                if self.spec.triton:
                    self.spec = dataclasses.replace(self.spec, triton=False)
                    self._fall_back("the decode step with the Triton decode kernels failed; retrying with SDPA", err,
                                    counter="triton_fallbacks")
                    continue
                self._fall_back("torch.compile of the decode step failed; running the eager step", err,
                                counter="compile_fallbacks")
                self.compiled = False
                self.parts = Parts.eager()
                break
        self._stats["capture_s"] += time.perf_counter() - tick

    def _capture(self, rows: int, length: int) -> Any:
        """Capture bucket (rows, length) as a CUDA graph, or fall back (counted)."""
        tick = time.perf_counter()
        self._warm_up(rows, length)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        saved = [t.clone() for t in self.slots.written_by_step()]
        torch.cuda.synchronize()
        # torch.cuda.graph empties the cache on entry: empty it first, so only the pool's growth is counted.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        try:
            with torch.cuda.graph(graph, pool=self.pool), torch.no_grad(), preferred_blas(self.blas):
                self._step(rows, length)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: no graph
            self._fall_back("CUDA graph capture of the decode step failed; decoding without a graph", err,
                            counter="capture_fallbacks")
            torch.cuda.synchronize()
            graph, self.use_graphs = None, False
        _release_cublas_workspaces()
        self._stats["graph_pool_bytes"] += torch.cuda.memory_reserved() - reserved
        for t, s in zip(self.slots.written_by_step(), saved):
            t.copy_(s)
        if graph is not None:
            key = self._graph_key(rows, length)
            if key in self._captured_keys:
                self._stats["recaptures"] += 1
            self._captured_keys.add(key)
            self.graphs[key] = graph
            self._stats["captures"] += 1
        self._stats["capture_s"] += time.perf_counter() - tick
        return graph

    def rows_bucket(self, rows: int) -> int:
        return next(b for b in self.batch_buckets if b >= rows)

    def length_bucket_for(self, columns: int) -> int:
        return min(self.slots.length, math.ceil(columns / self.length_bucket) * self.length_bucket)
