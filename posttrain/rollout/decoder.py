"""The Llama-family decoder as pure functions of its weights (no module calls, so it traces whatever a
trainer wrapped), numerics as transformers' forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


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
    if getattr(cfg, "hidden_act", "silu") not in ACTIVATIONS:
        return f"activation {cfg.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rope scaling changes with the sequence length; not supported"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Llama-family layout (model.embed_tokens/layers/norm/rotary_emb)"
    if not hasattr(base.rotary_emb, "inv_freq"):
        return "the rotary embedding has no inv_freq buffer"
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    for layer in base.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return "a decoder layer does not have the Llama-family attention layout"
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "a decoder layer does not have the Llama-family layout"
        if not all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer's MLP is not gate/up/down"
    return None


@dataclass(frozen=True)
class DecoderSpec:
    """The model's fixed numbers, and whether the decode step runs posttrain's Triton kernels."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float
    rope_scaling: float  # the rotary embedding's attention_scaling
    act: Callable[[torch.Tensor], torch.Tensor]
    vocab: int
    triton: bool = False

    @classmethod
    def of(cls, model: nn.Module) -> DecoderSpec:
        base = model.model
        attn, layer = base.layers[0].self_attn, base.layers[0]
        head_dim = attn.head_dim
        eps = getattr(layer.input_layernorm, "variance_epsilon", getattr(model.config, "rms_norm_eps", 1e-6))
        return cls(heads=attn.q_proj.out_features // head_dim, kv_heads=attn.k_proj.out_features // head_dim,
                   head_dim=head_dim, scaling=getattr(attn, "scaling", head_dim**-0.5), eps=float(eps),
                   rope_scaling=float(getattr(base.rotary_emb, "attention_scaling", 1.0)),
                   act=ACTIVATIONS[getattr(model.config, "hidden_act", "silu")], vocab=model.lm_head.out_features)


def lora_add(y: torch.Tensor, x: torch.Tensor, terms: Any) -> torch.Tensor:
    """``y`` plus LoRA terms of input ``x``, cast as peft's ``lora.Linear.forward`` casts them."""
    if not terms:
        return y
    out = y
    for a, b, b_bias, scale in terms:
        x = x.to(a.dtype)
        out = out + F.linear(F.linear(x, a), b, b_bias) * scale
    return out.to(y.dtype)


def lora_add_parts(ys: list[torch.Tensor], x: torch.Tensor, terms: Any) -> list[torch.Tensor]:
    """:func:`lora_add` for projections of one input with stacked adapters ("grouped")."""
    if not terms:
        return ys
    outs, sizes = list(ys), [y.shape[-1] for y in ys]
    for a, b, b_bias, scale in terms:
        x = x.to(a.dtype)
        delta = (F.linear(F.linear(x, a), b, b_bias) * scale).split(sizes, dim=-1)
        outs = [o + d for o, d in zip(outs, delta)]
    return [o.to(y.dtype) for o, y in zip(outs, ys)]


def appended_linear(w: dict[str, Any], key: str, x: torch.Tensor) -> torch.Tensor:
    """Projections ``key`` of ``x`` from the base rows with the adapters' A rows appended (LoRA mode "grouped"):
    one GEMM gives the projections and x A^T, a second adds (x A^T) (scaling B)^T."""
    expand = w[key + "_up"]
    y = F.linear(x, w[key + "_ext"], w.get(key + "_extb"))
    base, shrunk = y.split([expand.shape[0], expand.shape[1]], dim=-1)
    return base + F.linear(shrunk, expand, w.get(key + "_upb"))


def linear(w: dict[str, Any], key: str, x: torch.Tensor) -> torch.Tensor:
    """Projection ``key`` of ``x`` (with its bias and LoRA terms, if any)."""
    if key + "_ext" in w:
        return appended_linear(w, key, x)
    return lora_add(F.linear(x, w[key], w.get(key + "b")), x, w.get(key + "_lora"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] of positions [B, T], as LlamaRotaryEmbedding computes them."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def project_qkv(spec: DecoderSpec, w: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections, q/k norms and rotation (unless not ``rotate``) of the normed input ``h``."""
    b, t, _ = h.shape
    d = spec.head_dim
    sizes = [spec.heads * d, spec.kv_heads * d, spec.kv_heads * d]
    if "qkv_ext" in w:
        q, k, v = appended_linear(w, "qkv", h).split(sizes, dim=-1)
    elif "qkv" in w:
        q, k, v = F.linear(h, w["qkv"], w.get("qkvb")).split(sizes, dim=-1)
        q, k, v = lora_add(q, h, w.get("q_lora")), lora_add(k, h, w.get("k_lora")), lora_add(v, h, w.get("v_lora"))
    else:
        q, k, v = linear(w, "q", h), linear(w, "k", h), linear(w, "v", h)
    q, k, v = lora_add_parts([q, k, v], h, w.get("qkv_lora"))
    q, k = q.view(b, t, -1, d), k.view(b, t, -1, d)
    v = v.reshape(b, t, -1, d).transpose(1, 2)
    if "qn" in w:
        q, k = rms_norm(q, w["qn"], spec.eps), rms_norm(k, w["kn"], spec.eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if not rotate:
        return q, k, v
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def attention_out(spec: DecoderSpec, w: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor,
                  next_norm: torch.Tensor | None = None) -> Any:
    """Output projection, residual, norm, MLP, residual; with ``next_norm`` also the stream's norm by it."""
    b, t = attn.shape[0], attn.shape[2]
    o = linear(w, "o", attn.transpose(1, 2).reshape(b, t, -1))
    # The kernels keep x's dtype, where eager would promote to a float32 norm weight's.
    pointwise = spec.triton and w["ln2"].dtype == x.dtype
    if pointwise:
        x, h = torch.ops.posttrain.add_rms_norm(x, o, w["ln2"], spec.eps)
    else:
        x = x + o
        h = rms_norm(x, w["ln2"], spec.eps)
    if "gate_up_ext" in w:
        gate_up = appended_linear(w, "gate_up", h)
        if pointwise and spec.act is F.silu:
            mid = torch.ops.posttrain.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = spec.act(gate) * up
    elif pointwise and "gate_up" in w and spec.act is F.silu and not any(
            w.get(k) for k in ("gate_lora", "up_lora", "gate_up_lora")):
        mid = torch.ops.posttrain.silu_mul(F.linear(h, w["gate_up"], w.get("gate_upb")))
    else:
        if "gate_up" in w:
            gate, up = F.linear(h, w["gate_up"], w.get("gate_upb")).chunk(2, dim=-1)
            gate, up = lora_add(gate, h, w.get("gate_lora")), lora_add(up, h, w.get("up_lora"))
        else:
            gate, up = linear(w, "gate", h), linear(w, "up", h)
        gate, up = lora_add_parts([gate, up], h, w.get("gate_up_lora"))
        mid = spec.act(gate) * up
    down = linear(w, "down", mid)
    if next_norm is None:
        return x + down
    if pointwise:
        return torch.ops.posttrain.add_rms_norm(x, down, next_norm, spec.eps)
    x = x + down
    return x, rms_norm(x, next_norm, spec.eps)


def decode_attention(spec: DecoderSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """One query per row over the cache [B, kv_heads, L, d] as one SDPA call."""
    b, groups, d = q.shape[0], spec.heads // spec.kv_heads, spec.head_dim
    out = F.scaled_dot_product_attention(q.reshape(b, spec.kv_heads, groups, d), keys, values,
                                         attn_mask=bias, scale=spec.scaling)
    return out.reshape(b, spec.heads, 1, d)


def stacked_bias(spec: DecoderSpec, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` [B, 1, W, L] as :func:`query_attention`'s additive mask of its stacked queries, [B, 1,
    groups x W, L] of 0 and -inf in ``dtype``: what SDPA makes of a boolean mask, made once for all the layers
    instead of once a layer, its rows 16-element aligned so that CUDA's kernel reads it without a padded copy."""
    b, _, width, length = allowed.shape
    groups, room = spec.heads // spec.kv_heads, length + (-length % 16)
    bias = torch.full((b, 1, groups, width, room), float("-inf"), dtype=dtype, device=allowed.device)
    bias[..., :length].masked_fill_(allowed.unsqueeze(2), 0.0)
    return bias.view(b, 1, groups * width, room)[..., :length]


def query_attention(spec: DecoderSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    stacked: torch.Tensor) -> torch.Tensor:
    """Queries [B, heads, W, d] over keys and values [B, kv_heads, L, d] under :func:`stacked_bias`: each kv
    head's query heads stacked along the queries, so the kv heads are read as they are, never repeated."""
    b, width, d = q.shape[0], q.shape[2], spec.head_dim
    q = q.reshape(b, spec.kv_heads, (spec.heads // spec.kv_heads) * width, d)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=stacked, scale=spec.scaling)
    return out.reshape(b, spec.heads, width, d)


def sdpa_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's own kernels with their float32 log-sum-exp (a fully masked row: 0 and float32's lowest)."""
    length = keys.shape[2]
    if q.is_cuda:
        mask = bias
        if not torch.compiler.is_compiling():  # inductor aligns this op's mask itself (sdpa_constraint)
            # Eager, the kernel wants the mask's rows 16-element aligned (SDPA pads it the same way).
            mask = F.pad(bias, (0, -length % 16))[..., :length]
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], length)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, mask, True,
                                                                          scale=scale)[:2]
        lse = lse[..., : q.shape[2]]  # padded to its kernel's query block
    else:
        mask = bias.expand(q.shape[0], q.shape[1], q.shape[2], length)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=mask,
                                                                              scale=scale)
    # Fully masked rows: the CPU kernel returns a log-sum-exp of 0, CUDA's -inf; set both apart.
    masked = (bias == float("-inf")).all(-1)  # [n, 1, 1]
    lowest = torch.finfo(torch.float32).min
    return out.nan_to_num(0.0), lse.float().masked_fill(masked, lowest)

def decode_attention_shared(spec: DecoderSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            bias: torch.Tensor, prompt: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """:func:`decode_attention`, shared prompt slots: ``prompt`` = (pkeys, pvalues, pbias, members, place)."""
    pkeys, pvalues, pbias, members, place = prompt
    b, kvh, g, d = q.shape[0], spec.kv_heads, spec.heads // spec.kv_heads, spec.head_dim
    s, n = pkeys.shape[0], members.shape[1]
    qg = q.reshape(b, kvh, g, d)
    # The prompts' queries: a slot's members side by side (a zero query where a member is missing).
    padded = torch.cat([qg, qg.new_zeros(1, kvh, g, d)])
    qp = padded[members].permute(0, 2, 1, 3, 4).reshape(s, kvh, n * g, d)  # [S, kvh, G * g, d]
    out_c, lse_c = sdpa_lse(qg, keys, values, bias, spec.scaling)
    out_p, lse_p = sdpa_lse(qp, pkeys, pvalues, pbias, spec.scaling)
    out_c, out_p = out_c.float(), out_p.float()
    # Back to rows: [S, kvh, G, g, ...] -> [S * G, kvh, g, ...], row r at place[r].
    out_p = out_p.reshape(s, kvh, n, g, d).transpose(1, 2).reshape(s * n, kvh, g, d).index_select(0, place)
    lse_p = lse_p.reshape(s, kvh, n, g).transpose(1, 2).reshape(s * n, kvh, g).index_select(0, place)
    out_c, lse_c = out_c.reshape(b, kvh, g, d), lse_c.reshape(b, kvh, g)
    lse = torch.logaddexp(lse_p, lse_c)
    out = out_p * (lse_p - lse).exp().unsqueeze(-1) + out_c * (lse_c - lse).exp().unsqueeze(-1)
    return out.to(q.dtype).view(b, spec.heads, 1, d)


def decode_layer_post(spec: DecoderSpec, w: dict[str, torch.Tensor], x: torch.Tensor, q: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, next_norm: torch.Tensor,
                      prompt: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a decoder layer once its key and value are cached."""
    if prompt is None:
        attn = decode_attention(spec, q, keys, values, bias)
    else:
        attn = decode_attention_shared(spec, q, keys, values, bias, prompt)
    return attention_out(spec, w, x, attn, next_norm)


def head(spec: DecoderSpec, weights: dict[str, Any], x: torch.Tensor, normed: bool = False) -> torch.Tensor:
    """Final norm (unless ``normed``) and LM head of [B, 1, H]: logits [B, V] in the model dtype."""
    h = x if normed else rms_norm(x, weights["norm"], spec.eps)
    return lora_add(F.linear(h, weights["head"], weights["head_bias"]), h, weights.get("head_lora"))[:, 0]


def prefill(spec: DecoderSpec, weights: dict[str, Any], ids: torch.Tensor, positions: torch.Tensor,
            key_mask: torch.Tensor, write: Callable[[int, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """Run left-padded prompts [b, P] with SDPA, ``write`` each layer's k and v; last logits [b, V]."""
    b, p = ids.shape
    causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
    allowed = causal.unsqueeze(0) & key_mask.bool().unsqueeze(1)
    x = F.embedding(ids, weights["embed"])
    # A padding query attends to itself, so no row is all -inf (SDPA would give NaN there).
    bias = stacked_bias(spec, (allowed | torch.eye(p, dtype=torch.bool, device=ids.device)).unsqueeze(1), x.dtype)
    cos, sin = rotary(positions, weights["inv_freq"], spec.rope_scaling, x.dtype)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write(i, k, v)
        return query_attention(spec, q, k, v, bias)

    return head(spec, weights, layers(spec, weights, x, cos, sin, attend)[:, -1:])


def layers(spec: DecoderSpec, weights: dict[str, Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every decoder layer over the hidden states ``x`` [B, T, H], ``attend(layer, q, k, v)`` giving its
    attention; each layer's residual add fused with the next layer's input norm, as the decode step does."""
    ws = weights["layers"]
    h = rms_norm(x, ws[0]["ln1"], spec.eps)
    for i, w in enumerate(ws):
        if spec.triton:  # rotated by one kernel into the layout SDPA reads (eager: five passes and a copy)
            q, k, v = project_qkv(spec, w, h, cos, sin, rotate=False)
            q, k = torch.ops.posttrain.rope_heads(q, cos, sin), torch.ops.posttrain.rope_heads(k, cos, sin)
        else:
            q, k, v = project_qkv(spec, w, h, cos, sin)
        if i + 1 < len(ws):
            x, h = attention_out(spec, w, x, attend(i, q, k, v), ws[i + 1]["ln1"])
        else:
            x = attention_out(spec, w, x, attend(i, q, k, v))
    return x
