"""Rollouts: sampling completions from a role's model, fast, for PPO, GRPO and on-policy distillation.

Two backends behind one API (:class:`Rollout`):

- ``"hf"``: Hugging Face ``generate`` (a ZeRO-3 policy gathered once per rollout with TRL's
  ``unwrap_model_for_generation``, as TRL's online trainers do);
- ``"posttrain"`` (default): a decode engine in the style of gpt-fast. It runs the decoder itself from
  the model's own modules (embeddings, norms, projections, MLPs, rotary embedding, head), over a KV
  cache preallocated once for the run's largest batch and length:

  * prefill: one forward of the (left-padded) prompts with SDPA, writing the cache;
  * decode: one token for the whole batch per call of a fixed-shape step that reads only static
    buffers (last token, positions, cache slot, key mask, done flags) and samples inside itself
    (temperature, top-k, top-p, min_new_tokens by masking stop tokens; greedy = argmax; sampling =
    Gumbel-max with noise from a counter-based hash, so it needs no generator state and is
    capturable), writing the token and its log-prob into output buffers;
  * on CUDA, ``torch.compile`` (inductor, no cudagraphs mode) compiles one decoder layer, reused by
    every layer since they share shapes (a compile of seconds, not of the whole depth), and the
    sampler (``POSTTRAIN_ROLLOUT_COMPILE=step`` compiles the whole step instead, ``none`` nothing);
    the step is then captured by hand as one CUDA graph, replayed per token, with a host sync only
    every ``sync_every`` tokens to stop early once every row is done (none without stop tokens).
    A compile or capture that fails falls back (compiled -> eager graph -> no graph) with a log
    line. On CPU the same step runs eagerly, so CPU tests exercise it.
  * one bucket: the batch padded to ``max_batch`` and the prompts to ``max_prompt_len`` (decoding
    reads every weight once per token whatever the batch; each bucket would cost a compile).

Why not transformers' ``StaticCache`` and the model's own forward: the cache and forward signatures
changed within 5.x (``past_key_values``/``cache_position`` in 5.17, ``cache`` and an internal
write counter in 5.24), while the module attributes read here (``q_proj``, ``input_layernorm``,
``rotary_emb``...) are the same in every release of the supported families (Llama, Qwen2, Qwen3,
Mistral without a sliding window). Any other architecture falls back to ``generate`` with one log
line saying why.

Weights are read live: the graph reads the parameters' storage, so an optimizer step (which writes
DeepSpeed's bf16 parameters in place: tested) is seen with no recapture; if a parameter's storage
ever moves, the next rollout notices (data pointers are compared) and recaptures, counted in
``stats["recaptures"]``. A ZeRO-3 model (trained, or frozen with posttrain.frozen's fast path) is
gathered once per rollout into a persistent buffer that a shadow copy of the module views, so the
graph's addresses never change.

Same seed, same samples: each ``generate`` draws one 62-bit key from torch's default CPU generator
(seeded by the run's seed, saved and restored with a checkpoint's RNG state), mixed with the
process rank; the noise of token ``t`` in row ``b`` at vocabulary entry ``v`` is a hash of
(key, t, b, v). The same key gives the same samples on CPU and GPU for the same logits.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LogitsProcessor

from .dsconfig import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("posttrain", "hf")
COMPILE_MODES = ("layer", "step", "none")
# Architectures whose decoder this engine runs (module layout of transformers' Llama family).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class SamplingParams:
    """What to sample; names as in transformers' GenerationConfig / TRL configs."""

    max_new_tokens: int
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # EOS and stop tokens
    do_sample: bool = True  # False: greedy

    def __post_init__(self) -> None:
        # None means "off", as in TRL's configs (top_k: None in some versions).
        self.top_k = 0 if self.top_k is None else int(self.top_k)
        self.top_p = 1.0 if self.top_p is None else float(self.top_p)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}; use do_sample=False for greedy")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.min_new_tokens < 0:
            raise ConfigError(f"top_k and min_new_tokens must be >= 0, got {self.top_k} and {self.min_new_tokens}")
        self.stop_token_ids = list(self.stop_token_ids)


@dataclass
class RolloutOutput:
    sequences: torch.Tensor  # [B, P+N] prompt (left-padded, as given) + completion
    completion_ids: torch.Tensor  # [B, N]; after the first stop token: pad (the stop token itself kept)
    completion_mask: torch.Tensor  # [B, N] 1 up to and including the first stop token
    logprobs: torch.Tensor  # [B, N] float32, under the temperature-scaled distribution; 0 where masked


# -- sampling (shared by both backends and the engine's step) --------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at ``tokens``, in float32: the distribution before top-k/top-p
    filtering and min_new_tokens masking, i.e. what a forward pass over the sequence gives."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float | torch.Tensor, use_top_p: bool | None = None
                  ) -> torch.Tensor:
    """transformers' TopKLogitsWarper then TopPLogitsWarper (keep at least one token), without
    data-dependent shapes: removed entries become -inf. ``top_p`` may be a 0-d tensor (a graph
    input); ``use_top_p`` then says whether to sort at all."""
    if top_k > 0 and top_k < scaled.size(-1):
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if use_top_p if use_top_p is not None else top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (Wellons' lowbias32) on int64 tensors holding values < 2**32.
    Products stay below 2**63 (constants < 2**31), so nothing overflows on any backend."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def gumbel_noise(key: torch.Tensor, step: torch.Tensor, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab] as a pure function of (key, step, row, token): a
    counter-based generator (as Philox is), so a captured graph needs no generator state."""
    row = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    tok = torch.arange(vocab, device=device, dtype=torch.int64).unsqueeze(0)
    base = _hash32(_hash32(key ^ (step * 0x2545F491)) + row * 0x5851F42D)
    bits = _hash32(base ^ _hash32(tok + 0x9E3779B))
    u = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def choose_tokens(logits: torch.Tensor, step: torch.Tensor, key: torch.Tensor, *,
                  temperature: float | torch.Tensor, do_sample: bool | torch.Tensor, top_k: int = 0,
                  top_p: float | torch.Tensor = 1.0, use_top_p: bool | None = None,
                  min_new_tokens: int | torch.Tensor = 0, stop_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob, from raw logits [B, V]. ``step`` (0-d int64 tensor) is
    the index of the token being chosen; stop tokens are barred while step < min_new_tokens.
    Temperature, do_sample, top_p and min_new_tokens may be 0-d tensors: the engine's graph reads
    them, so changing them needs no recompile; top_k, whether to sort for top-p and the stop
    tokens are fixed per graph."""
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    pick = scaled
    if stop_ids is not None:
        barred = torch.zeros(scaled.size(-1), dtype=torch.bool, device=scaled.device).index_fill(0, stop_ids, True)
        pick = pick.masked_fill(barred & (step < min_new_tokens), float("-inf"))
    if isinstance(do_sample, bool):
        if do_sample:  # greedy ignores top-k/top-p, as transformers does (argmax is kept by both)
            pick = filter_logits(pick, top_k, top_p, use_top_p)
            pick = pick + gumbel_noise(key, step, pick.size(0), pick.size(1), pick.device)
    else:
        pick = filter_logits(pick, top_k, top_p, use_top_p)
        pick = pick + gumbel_noise(key, step, pick.size(0), pick.size(1), pick.device) * do_sample
    tokens = pick.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def finish(completion: torch.Tensor, logprobs: torch.Tensor, sampling: SamplingParams
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's truncate_response for several stop tokens: pad after the first stop token (kept), the
    mask 1 up to and including it, log-probs 0 where masked."""
    n = completion.size(1)
    if sampling.stop_token_ids:
        stops = torch.tensor(sampling.stop_token_ids, device=completion.device)
        is_stop = torch.isin(completion, stops)
        first = torch.where(is_stop.any(1), is_stop.int().argmax(1), torch.full_like(is_stop[:, 0], n, dtype=torch.long))
    else:
        first = torch.full((completion.size(0),), n, device=completion.device, dtype=torch.long)
    mask = torch.arange(n, device=completion.device).unsqueeze(0) <= first.unsqueeze(1)
    completion = completion.masked_fill(~mask, sampling.pad_token_id)
    return completion, mask.long(), logprobs.float().masked_fill(~mask, 0.0)


# -- the decoder, run from the model's own modules --------------------------------------------------
def unsupported_reason(model: nn.Module, cache_len: int | None = None) -> str | None:
    """Why the engine cannot run ``model`` (then ``generate`` is used), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "the model has no transformers config"
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} has no posttrain decode path (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: sliding-window or hybrid attention is not supported"
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        if cache_len is None or window < cache_len:
            return f"sliding-window attention (window {window}) is not supported"
    if getattr(cfg, "pretraining_tp", 1) > 1:
        return "pretraining_tp > 1 is not supported"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rope scaling changes with the sequence length; not supported"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Llama-family layout (model.embed_tokens/layers/norm/rotary_emb)"
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    for layer in base.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return "a decoder layer does not have the Llama-family attention layout"
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "a decoder layer does not have the Llama-family layout"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderRunner:
    """The Llama-family decoder over a preallocated KV cache: ``prefill``, then ``decode_inputs``, ``decode_layers`` and ``head`` per token.

    Holds the cache ([max_batch, kv_heads, max_len, head_dim] per layer, model dtype) and reads the
    model's modules on every call (their parameters are the live weights)."""

    def __init__(self, model: nn.Module, max_batch: int, max_len: int, fuse: bool = False) -> None:
        self.model = model
        base = model.model
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.heads = attn.q_proj.out_features // self.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.vocab = model.lm_head.out_features
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        shape = (max_batch, self.kv_heads, max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in base.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in base.layers]
        self.max_batch, self.max_len = max_batch, max_len
        self.layer_fn = self.decode_layer  # torch.compile'd by the engine on CUDA
        # Optional fused decode weights: q|k|v and gate|up concatenated, so a token needs 4 GEMMs
        # per layer instead of 7 (fewer, larger kernels for skinny batches). Copies of the live
        # weights, refreshed by refresh_fused() before every rollout: costs their memory.
        self.fused: list[dict[str, torch.Tensor | None]] = []
        if fuse:
            for layer in base.layers:
                attn, mlp = layer.self_attn, layer.mlp
                projs = [attn.q_proj, attn.k_proj, attn.v_proj]
                entry: dict[str, torch.Tensor | None] = {
                    "qkv": self._empty_cat([m.weight for m in projs]),
                    "qkv_bias": self._empty_cat([m.bias for m in projs]) if projs[0].bias is not None else None,
                    "gate_up": None}
                if all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) and \
                        mlp.gate_proj.bias is None:
                    entry["gate_up"] = self._empty_cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                self.fused.append(entry)
            self.refresh_fused()

    @staticmethod
    def _empty_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
        return torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)

    @torch.no_grad()
    def refresh_fused(self) -> None:
        """Copy the live weights into the fused buffers (in place: the graph keeps their addresses)."""
        for layer, entry in zip(self.model.model.layers, self.fused):
            attn, mlp = layer.self_attn, layer.mlp
            projs = [attn.q_proj, attn.k_proj, attn.v_proj]
            torch.cat([m.weight for m in projs], out=entry["qkv"])
            if entry["qkv_bias"] is not None:
                torch.cat([m.bias for m in projs], out=entry["qkv_bias"])
            if entry["gate_up"] is not None:
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=entry["gate_up"])

    @property
    def fused_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.fused for t in e.values() if t is not None)

    @property
    def cache_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _qkv(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             qkv: torch.Tensor | None = None, qkv_bias: torch.Tensor | None = None):
        attn = layer.self_attn
        b, t, _ = h.shape
        if qkv is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = F.linear(h, qkv, qkv_bias).split(
                [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], dim=-1)
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = v.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _mlp_block(self, layer: nn.Module, x: torch.Tensor, attn_out: torch.Tensor,
                   gate_up: torch.Tensor | None = None) -> torch.Tensor:
        b, t = attn_out.shape[0], attn_out.shape[2]
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        h = layer.post_attention_layernorm(x)
        if gate_up is None:
            return x + layer.mlp(h)
        gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts [b, P] (left-padded; ``key_mask`` [b, P] 1 on real tokens) into cache slots
        0..P-1 of rows 0..b-1; returns the last position's logits [b, V]."""
        base = self.model.model
        b, p = ids.shape
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        allowed = causal.unsqueeze(0) & key_mask.bool().unsqueeze(1)
        # A padding query attends to itself, so no row is all -inf (SDPA would give NaN there).
        allowed = (allowed | torch.eye(p, dtype=torch.bool, device=ids.device)).unsqueeze(1)
        x = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(x, positions)
        groups = self.heads // self.kv_heads
        for i, layer in enumerate(base.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.keys[i][:b, :, :p] = k
            self.values[i][:b, :, :p] = v
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                 attn_mask=allowed, scale=self.scaling)
            x = self._mlp_block(layer, x, out)
        return self.model.lm_head(base.norm(x[:, -1:]))[:, 0]

    def decode_inputs(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings, rotary cos/sin and the additive attention mask [b, 1, 1, length] of one
        token per row (``allowed`` [b, length]: the cache positions it may attend to)."""
        base = self.model.model
        x = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(x, positions)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=ids.device).masked_fill(~allowed, float("-inf"))
        return x, cos, sin, bias.view(allowed.shape[0], 1, 1, allowed.shape[1])

    def decode_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
        """Every decoder layer for one token per row, written to cache ``slot`` (0-d tensor)."""
        b, length = x.shape[0], bias.shape[-1]
        for i, layer in enumerate(self.model.model.layers):
            keys, values = self.keys[i][:b, :, :length], self.values[i][:b, :, :length]
            fused = self.fused[i] if self.fused else {}
            x = self.layer_fn(layer, x, cos, sin, keys, values, slot, bias, fused.get("qkv"), fused.get("qkv_bias"),
                              fused.get("gate_up"))
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x))[:, 0]

    def decode_layer(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, bias: torch.Tensor,
                     qkv: torch.Tensor | None = None, qkv_bias: torch.Tensor | None = None,
                     gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer for one token per row. Every layer has the same shapes, so compiled
        once (``layer_fn``) it serves them all: the compile costs one layer, not the whole model."""
        b = x.shape[0]
        q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin, qkv, qkv_bias)
        keys.index_copy_(2, slot.view(1), k)
        values.index_copy_(2, slot.view(1), v)
        # Grouped-query attention for one query: the query heads of a group share one read of
        # their key/value head (no repeat_interleave copy of the cache per token).
        qg = q.view(b, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scaling + bias
        probs = scores.softmax(dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).view(b, self.heads, 1, self.head_dim)
        return self._mlp_block(layer, x, out, gate_up)


class _Clock:
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


# -- the engine -------------------------------------------------------------------------------------
class DecodeEngine:
    """Static buffers, the decode step over them and (on CUDA) its compiled, captured graph.

    One bucket: the batch is padded to ``max_batch`` rows and the prompt to ``max_prompt_len``
    columns. Decoding reads every weight once per token whatever the batch, so padding rows costs
    little, while each extra bucket would cost a full compile (tens of seconds at 1B)."""

    def __init__(self, model: nn.Module, sampling: SamplingParams, max_batch: int, max_prompt_len: int,
                 *, use_graphs: bool | None = None, sync_every: int = 16) -> None:
        self.sampling = sampling
        self.max_batch, self.prompt_len = max_batch, max_prompt_len
        self.max_new = sampling.max_new_tokens
        self.length = max_prompt_len + self.max_new
        # POSTTRAIN_ROLLOUT_FUSE=1: fused q|k|v and gate|up decode weights (see DecoderRunner).
        self.runner = DecoderRunner(model, max_batch, self.length,
                                    fuse=os.environ.get("POSTTRAIN_ROLLOUT_FUSE", "0") == "1")
        dev = self.runner.device
        self.device = dev
        self.use_graphs = (dev.type == "cuda") if use_graphs is None else use_graphs
        # What torch.compile covers before capture (POSTTRAIN_ROLLOUT_COMPILE): "layer" (default) one
        # decoder layer, reused by every layer, plus the sampler: a compile of seconds; "step" the
        # whole step (cross-layer fusion, a compile as long as the model is deep); "none" eager
        # kernels captured as they are.
        self.compile_mode = os.environ.get("POSTTRAIN_ROLLOUT_COMPILE", "layer") if self.use_graphs else "none"
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"POSTTRAIN_ROLLOUT_COMPILE={self.compile_mode!r}: use one of {COMPILE_MODES}")
        self._compiled = False
        self.sync_every = sync_every
        b, n = max_batch, self.max_new
        # The step's static inputs and outputs (their addresses are baked into the graph).
        self.last = torch.zeros(b, 1, dtype=torch.long, device=dev)  # the token fed to the step
        self.position = torch.zeros(b, 1, dtype=torch.long, device=dev)  # its position id
        self.step_idx = torch.zeros((), dtype=torch.long, device=dev)  # index of the token chosen next
        self.key_valid = torch.zeros(b, self.length, dtype=torch.bool, device=dev)  # prompt mask, then ones
        self.key = torch.zeros((), dtype=torch.long, device=dev)  # sampling key of this rollout
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(b, n, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(b, n, dtype=torch.float32, device=dev)
        self.stop_ids = (torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
                         if sampling.stop_token_ids else None)
        # Knobs the graph reads (change them with set_knobs, no recompile); the rest is in graph_key.
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.do_sample = torch.ones((), dtype=torch.float32, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.min_new = torch.zeros((), dtype=torch.long, device=dev)
        self.top_k, self.use_top_p = sampling.top_k, sampling.top_p < 1.0  # in the graph key
        self.set_knobs(sampling)
        self.cols = torch.arange(self.length, device=dev)
        self.graph: Any = None
        self.pool: Any = None
        self.ptrs: list[int] = []  # the parameters' addresses the last rollout (and graph) read
        self.storage_moves = 0
        self.captures = self.recaptures = 0
        self.capture_s = 0.0
        self.graph_pool_bytes = 0  # torch.cuda.memory_reserved() growth across the captures
        self.profile = False  # time prefill and decode separately (syncs; benchmarks only)
        self.timings: dict[str, float] = {}
        # The step's parts; "layer" compiles each (the layers share one compiled function).
        self._step_fn, self._inputs_fn, self._finish_fn = self._step, self._inputs, self._finish

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

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Reads only constants fixed per engine and tensors: new knobs do not recompile.
        return choose_tokens(logits, self.step_idx, self.key, temperature=self.temperature, do_sample=self.do_sample,
                             top_k=self.top_k, top_p=self.top_p, use_top_p=self.use_top_p, min_new_tokens=self.min_new,
                             stop_ids=self.stop_ids)

    # -- the step: a fixed-shape function of the buffers above --------------------------------
    def _record(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        tokens = torch.where(self.done, self.sampling.pad_token_id, tokens)
        logprobs = torch.where(self.done, 0.0, logprobs)
        col = self.step_idx.view(1)
        self.tokens.index_copy_(1, col, tokens.unsqueeze(1))
        self.logprobs.index_copy_(1, col, logprobs.unsqueeze(1))
        if self.stop_ids is not None:
            self.done.logical_or_(torch.isin(tokens, self.stop_ids))
        self.last.copy_(tokens.unsqueeze(1))

    def _step(self) -> None:
        x, cos, sin, bias, slot = self._inputs_fn()
        self._finish_fn(self.runner.decode_layers(x, cos, sin, slot, bias))

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's prologue: embeddings, rotary, attention mask and cache slot of the fed token."""
        slot = self.step_idx + (self.prompt_len - 1)
        allowed = self.key_valid & (self.cols <= slot)
        return (*self.runner.decode_inputs(self.last, self.position, allowed), slot)

    def _finish(self, x: torch.Tensor) -> None:
        """The step's epilogue: norm, head, sampling, outputs, counters."""
        tokens, logprobs = self._choose(self.runner.head(x))
        self._record(tokens, logprobs)
        self.position.add_(1)
        self.step_idx.add_(1)

    # -- host side ------------------------------------------------------------------------------
    def _param_ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.runner.model.parameters()]

    def compile_parts(self, mode: str, backend: str = "inductor") -> None:
        """``torch.compile`` what ``mode`` covers ("layer": prologue, one decoder layer reused by
        all, epilogue; "step": the whole step; "none": nothing). fullgraph: a graph break raises
        (then _capture falls back to the eager step). Inductor's default mode: no cudagraphs inside."""
        self._compiled = True
        options: dict[str, Any] = dict(fullgraph=True, dynamic=False, backend=backend)
        if mode == "step":
            self._step_fn = torch.compile(self._step, **options)
        elif mode == "layer":
            self.runner.layer_fn = torch.compile(self.runner.decode_layer, **options)
            self._inputs_fn = torch.compile(self._inputs, **options)
            self._finish_fn = torch.compile(self._finish, **options)

    def _warm_up(self) -> None:
        """Run the step a few times on a side stream: compile, autotune and allocate outside capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                self.step_idx.fill_(1)  # writes cache slot prompt_len, which decoding rewrites first
                self._step_fn()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self) -> None:
        """Compile the step (first time) and capture it as a CUDA graph. The state buffers are
        scribbled on by warm-up; every rollout rewrites them before replaying."""
        tick = time.perf_counter()
        if not self._compiled:
            self.compile_parts(self.compile_mode)
        saved = [t.clone() for t in (self.last, self.position, self.step_idx, self.done)]
        try:
            self._warm_up()
        except Exception as err:  # noqa: BLE001 - e.g. a module dynamo cannot trace in one graph
            logger.warning("rollout: torch.compile of the decode step failed (%s: %s); capturing the eager step",
                           type(err).__name__, str(err).splitlines()[0][:300] if str(err) else "")
            self.compile_mode = "none"
            self._step_fn, self.runner.layer_fn = self._step, self.runner.decode_layer
            self._inputs_fn, self._finish_fn = self._inputs, self._finish
            self._warm_up()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        try:
            with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
                self._step_fn()
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: run the step without a graph
            logger.warning("rollout: CUDA graph capture of the decode step failed (%s: %s); decoding without a "
                           "graph", type(err).__name__, str(err).splitlines()[0][:300] if str(err) else "")
            torch.cuda.synchronize()
            graph, self.use_graphs = None, False
        self.graph_pool_bytes += torch.cuda.memory_reserved() - reserved
        for t, s in zip((self.last, self.position, self.step_idx, self.done), saved):
            t.copy_(s)
        if graph is None:
            self.graph = None
            self.capture_s += time.perf_counter() - tick
            return
        if self.graph is not None:
            self.recaptures += 1
        self.graph = graph
        self.captures += 1
        self.ptrs = self._param_ptrs()
        self.capture_s += time.perf_counter() - tick

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, key: int, max_new_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion tokens and log-probs [b, max_new_tokens] (pad and 0 after a row is done)."""
        b, p = prompt_ids.shape
        if b > self.max_batch or p > self.prompt_len:
            raise ConfigError(f"a rollout of {b} prompts x {p} tokens exceeds the engine's max_batch="
                              f"{self.max_batch} x max_prompt_len={self.prompt_len}; build the Rollout larger")
        if max_new_tokens > self.max_new:
            raise ConfigError(f"max_new_tokens={max_new_tokens} exceeds the {self.max_new} the Rollout was built "
                              "for; build it with the largest max_new_tokens")
        dev, pad = self.device, self.sampling.pad_token_id
        rows, width = self.max_batch, self.prompt_len
        ids = torch.full((rows, width), pad, dtype=torch.long, device=dev)
        mask = torch.zeros(rows, width, dtype=torch.long, device=dev)
        ids[:b, width - p:] = prompt_ids.to(dev)
        mask[:b, width - p:] = prompt_mask.to(dev).long()
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        # In-place writes only: the graph holds these buffers' addresses.
        self.key_valid[:, :width].copy_(mask.bool())
        self.key_valid[:, width:].fill_(True)
        self.key.fill_(key)
        self.done.fill_(False)
        self.done[b:].fill_(True)
        self.step_idx.zero_()
        clock = _Clock(dev) if self.profile else None
        if self.runner.fused:
            self.runner.refresh_fused()
        logits = self.runner.prefill(ids.masked_fill(mask == 0, 0), positions, mask)
        tokens, logprobs = self._choose(logits)
        self._record(tokens, logprobs)
        self.position.copy_(positions[:, -1:] + 1)
        self.step_idx.fill_(1)
        ptrs = self._param_ptrs()
        if self.ptrs and ptrs != self.ptrs:
            # A parameter's storage moved (the weights were replaced, not written in place): a
            # graph would read the old addresses, so it is captured again (an eager step just
            # reads the new ones). Counted either way.
            self.storage_moves += 1
            logger.info("rollout: a parameter's storage moved since the last rollout%s",
                        "; recapturing" if self.graph is not None else "")
            if self.graph is not None:
                self._capture()
        self.ptrs = ptrs
        if self.use_graphs and self.graph is None:
            self._capture()
        if clock is not None:
            self.timings["prefill_ms"] = clock.lap()
        written = max_new_tokens
        for t in range(1, max_new_tokens):
            # Every sync_every tokens (one host sync) see whether every row is done.
            if self.stop_ids is not None and t % self.sync_every == 0 and bool(self.done.all()):
                written = t
                break
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step_fn()
        if clock is not None:
            self.timings["decode_ms"] = clock.lap()
            self.timings["decode_tokens"] = written - 1
        tokens = self.tokens[:b, :max_new_tokens].clone()
        logprobs = self.logprobs[:b, :max_new_tokens].clone()
        tokens[:, written:] = pad  # columns not decoded (all rows were done): padding
        logprobs[:, written:] = 0.0
        return tokens, logprobs


# -- ZeRO-3: a persistent full copy per rollout ----------------------------------------------------
class ShadowModel:
    """A module of the same class whose parameters view one persistent flat buffer, refreshed from
    a ZeRO-3 model once per rollout (collective), chunk by chunk so that at most about 1/16 of the
    model is gathered beside the buffer. Its addresses never change, so graphs need no recapture."""

    def __init__(self, module: nn.Module, fast_frozen: Any = None) -> None:
        self.source, self.fast = module, fast_frozen
        named = list(module.named_parameters())
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for _, p in named]
        dtype = named[0][1].dtype
        device = getattr(named[0][1], "ds_tensor", named[0][1]).device
        numels = [math.prod(s) for s in shapes]
        self.flat = torch.empty(sum(numels), dtype=dtype, device=device)
        with torch.device("meta"):
            shadow = type(module)(module.config)
        views, offset = {}, 0
        for (name, _), shape, n in zip(named, shapes, numels):
            views[name] = self.flat[offset : offset + n].view(shape)
            offset += n
        # Tied parameters: the shadow shares them as the source does (named_parameters lists one).
        first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        for name, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            sub = shadow.get_submodule(owner) if owner else shadow
            setattr(sub, attr, nn.Parameter(views[first[id(p)]], requires_grad=False))
        for name, buf in module.named_buffers():
            owner, _, attr = name.rpartition(".")
            sub = shadow.get_submodule(owner) if owner else shadow
            sub._buffers[attr] = buf.detach().clone()
        self.names = [n for n, _ in named]
        self.module = shadow.eval()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the current weights in (collective: every rank calls it)."""
        shadow = dict(self.module.named_parameters())
        params = list(self.source.named_parameters())
        if self.fast is not None:
            with self.fast.gathered():
                for name, p in params:
                    shadow[name].copy_(p.data)
            return
        import deepspeed

        budget = max(max(p.ds_numel for _, p in params), sum(p.ds_numel for _, p in params) // 16)
        chunk: list[tuple[str, Any]] = []
        size = 0
        for i, (name, p) in enumerate(params):
            chunk.append((name, p))
            size += p.ds_numel
            if size >= budget or i == len(params) - 1:
                with deepspeed.zero.GatheredParameters([q for _, q in chunk], modifier_rank=None):
                    for n, q in chunk:
                        shadow[n].copy_(q.data)
                chunk, size = [], 0


class _GumbelSampling(LogitsProcessor):
    """A transformers logits processor that turns greedy search into the engine's sampler:
    temperature, top-k, top-p, then Gumbel noise keyed like the engine's."""

    def __init__(self, sampling: SamplingParams, key: int, prompt_len: int) -> None:
        self.sampling, self.key, self.prompt_len = sampling, key, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = torch.tensor(input_ids.shape[1] - self.prompt_len, device=scores.device)
        key = torch.tensor(self.key, device=scores.device)
        pick = filter_logits(scores.float() / self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
        return pick + gumbel_noise(key, step, scores.size(0), scores.size(1), scores.device)


# -- the API ----------------------------------------------------------------------------------------
class Rollout:
    """Built once per run for a trained (or frozen) role of a Session; ``generate`` samples.

    ``max_batch``/``max_prompt_len``: the largest rollout (the cache and graph are sized for it).
    ``ds3_gather_for_generation`` (TRL's name): a ZeRO-3 model is gathered whole for generation;
    False generates through DeepSpeed's per-layer hooks (less memory, slow; always ``generate``).
    ``sampling``: the run's settings; ``generate(..., sampling=...)`` may change temperature and
    the other knobs per call (the engine recompiles its step for new knobs; keep them fixed in a run)
    and take up to the built ``max_new_tokens``. ``seed``: default the run's torch seed (see the
    module docstring)."""

    def __init__(self, session: Any, role: str, sampling: SamplingParams, *, max_batch: int, max_prompt_len: int,
                 backend: str = "posttrain", ds3_gather_for_generation: bool = True,
                 model: nn.Module | None = None) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"generation_backend must be one of {BACKENDS}, got {backend!r}")
        if max_batch < 1 or max_prompt_len < 1:
            raise ConfigError(f"max_batch and max_prompt_len must be positive, got {max_batch} and {max_prompt_len}")
        self.session, self.role, self.sampling = session, role, sampling
        self.max_batch, self.max_prompt_len = max_batch, max_prompt_len
        # ``model``: a bare module without a session (benchmarks, tests): no ZeRO, this process only.
        self._bare = model
        self.gather = ds3_gather_for_generation
        self.stats: dict[str, Any] = {"backend": backend, "fallback": None, "captures": 0, "recaptures": 0,
                                      "capture_s": 0.0, "kv_cache_bytes": 0}
        self.backend = backend
        self.engine: DecodeEngine | None = None
        self.shadow: ShadowModel | None = None
        self.rollouts = 0
        if backend == "posttrain":
            module = self._module()
            reason = unsupported_reason(module, max_prompt_len + sampling.max_new_tokens)
            if reason is None and self._zero3() and not self.gather:
                reason = "ds3_gather_for_generation=False: the engine needs the whole weights on each rank"
            if reason is not None:
                self._fall_back(reason)

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: graph captures so far, recaptures (0 after warm-up), capture seconds."""
        return {"rollout/captures": self.stats["captures"], "rollout/recaptures": self.stats["recaptures"],
                "rollout/capture_s": self.stats["capture_s"]}

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

    def _engine_model(self) -> nn.Module:
        if not self._zero3():
            return self._module()
        if self.shadow is None:
            fast = self.session.fast_frozen.get(self.role)
            self.shadow = ShadowModel(self._module(), fast)
        self.shadow.refresh()
        return self.shadow.module

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sampling: SamplingParams | None = None) -> RolloutOutput:
        """Sample completions of left-padded prompts [B, P] (``prompt_mask`` 1 on real tokens)."""
        sampling = sampling or self.sampling
        if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
            raise ConfigError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                              "must be the same [batch, length] shape")
        b, p = prompt_ids.shape
        if b > self.max_batch or p > self.max_prompt_len:  # checked before any collective gather
            raise ConfigError(f"a rollout of {b} prompts x {p} tokens exceeds this Rollout's max_batch="
                              f"{self.max_batch} x max_prompt_len={self.max_prompt_len}; build it larger")
        if sampling.max_new_tokens > self.sampling.max_new_tokens and self.backend == "posttrain":
            raise ConfigError(f"max_new_tokens={sampling.max_new_tokens} exceeds the {self.sampling.max_new_tokens} "
                              "this Rollout was built for (its cache is sized for it); build it with the largest")
        key = self._seed_key()
        self.rollouts += 1
        if self.backend == "hf":
            completion, logprobs = self._hf_generate(prompt_ids, prompt_mask, sampling, key)
        else:
            completion, logprobs = self._engine_generate(prompt_ids, prompt_mask, sampling, key)
        completion, mask, logprobs = finish(completion, logprobs, sampling)
        return RolloutOutput(sequences=torch.cat([prompt_ids, completion.to(prompt_ids.device)], 1),
                             completion_ids=completion, completion_mask=mask, logprobs=logprobs)

    def _engine_generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
                         key: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self._engine_model()
        knobs = replace(sampling, max_new_tokens=self.sampling.max_new_tokens)
        same = (self.engine is not None and self.engine.runner.model is model
                and DecodeEngine.graph_key(self.engine.sampling) == DecodeEngine.graph_key(knobs))
        if same:
            self.engine.set_knobs(knobs)  # temperature, do_sample, top_p, min_new_tokens: buffers
        else:
            old = self.engine
            self.engine = DecodeEngine(model, knobs, self.max_batch, self.max_prompt_len)
            if old is not None:  # new knobs: a new graph, counted as captures
                self.engine.captures, self.engine.recaptures = old.captures, old.recaptures
                self.engine.capture_s = old.capture_s
            self.stats["kv_cache_bytes"] = self.engine.runner.cache_nbytes
            self.stats["fused_weight_bytes"] = self.engine.runner.fused_nbytes
        tokens, logprobs = self.engine.generate(prompt_ids, prompt_mask, key, sampling.max_new_tokens)
        self.stats.update(captures=self.engine.captures, recaptures=self.engine.recaptures,
                          capture_s=round(self.engine.capture_s, 3), graph_pool_bytes=self.engine.graph_pool_bytes,
                          compile=self.engine.compile_mode, storage_moves=self.engine.storage_moves)
        return tokens, logprobs

    @contextmanager
    def _hf_model(self):
        if self._bare is not None:
            yield self._bare, False
            return
        s = self.session
        zero3 = self._zero3()
        with s.activate(self.role):
            if zero3 and self.role in s.fast_frozen:
                # posttrain.frozen gathers layer by layer on every forward: ranks run in lock-step.
                yield s.engines[self.role].module, s.num_processes > 1
            elif zero3 and not self.gather:  # DeepSpeed's hooks gather layer by layer, ranks in lock-step
                yield s.engines[self.role].module, s.num_processes > 1
            elif zero3:
                from trl.models.utils import unwrap_model_for_generation

                with unwrap_model_for_generation(s.engines[self.role], s.accelerator_for(self.role),
                                                 gather_deepspeed3_params=True) as model:
                    yield model, False
            else:
                with nullcontext():
                    yield s.engines[self.role].module, False

    def _hf_generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
                     key: int) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers import GenerationConfig

        n = sampling.max_new_tokens
        # Sampling is our Gumbel-max processor after transformers' own (min_new_tokens), then the
        # argmax of greedy search: the same samples as the engine for the same key and logits.
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=sampling.min_new_tokens or None, do_sample=False,
                               pad_token_id=sampling.pad_token_id, eos_token_id=sampling.stop_token_ids or None,
                               return_dict_in_generate=True, output_logits=True)
        processors = [_GumbelSampling(sampling, key, prompt_ids.shape[1])] if sampling.do_sample else []
        with torch.no_grad(), self._hf_model() as (model, synced):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen,
                                 synced_gpus=synced, logits_processor=processors)
        completion = out.sequences[:, prompt_ids.shape[1]:]
        logits = torch.stack(out.logits, 1)[: completion.shape[0]]
        logprobs = token_logprobs(logits, completion, sampling.temperature)
        got = completion.shape[1]
        if got < n:  # every row stopped early: pad to the full length
            completion = F.pad(completion, (0, n - got), value=sampling.pad_token_id)
            logprobs = F.pad(logprobs, (0, n - got), value=0.0)
        return completion, logprobs
