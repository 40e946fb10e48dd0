"""``attn_implementation="varlen"``: torch's FlashAttention varlen kernel for padding-free and packed
rows (no dense block mask), SDPA per document where it cannot run. No sliding windows or softcapping."""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

NAME = "varlen"
# torch's kernel and its parameter names, resolved eagerly by register(): compiled code reads them, never resolves.
_RESOLVED: dict[str, tuple[Any, frozenset[str]]] = {}
_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _kernel() -> tuple[Any, frozenset[str]]:
    """torch's varlen_attn and its parameter names (they vary by torch version), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def kernel_available(device: torch.device | str) -> bool:
    """Whether torch's varlen FlashAttention kernel runs on ``device`` (CUDA, sm80 or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or _kernel()[0] is None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 8


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def register() -> None:
    """Register ``"varlen"`` with transformers, with the flash mask function (no dense mask). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _RESOLVED["kernel"] = _kernel()
    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def unsupported(config: Any) -> str | None:
    """Why a model of this config cannot use varlen attention, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    if "sliding_attention" in layer_types or (
            not layer_types and getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)):
        return "its sliding-window attention"
    if getattr(text, "attn_logit_softcapping", None):
        return "its attention softcapping"
    if getattr(text, "attention_dropout", 0.0):
        return "its attention dropout"
    return None


def choose(model_kwargs: dict[str, Any], config: Any, packed_rows: bool, device: torch.device | str) -> str | None:
    """Set "varlen" for packed rows if unasked and supported (registered if used); returns a line or None."""
    asked = model_kwargs.get("attn_implementation")
    if asked is None and packed_rows and kernel_available(device) and unsupported(_config(config, model_kwargs)) is None:
        model_kwargs["attn_implementation"] = asked = NAME
        message = (f"[posttrain] padding-free rows on {torch.device(device).type}: attention 'varlen' (torch's "
                   "FlashAttention varlen kernel, each document on its own; model_init_kwargs "
                   "attn_implementation: sdpa keeps transformers' block mask)")
    else:
        message = None
    if asked == NAME:
        register()
    return message


def choose_for(session: Any, model_kwargs: dict[str, Any], source: Any, packed_rows: bool) -> None:
    """:func:`choose` for a role's load keywords (a model object keeps its attention); the main process says so."""
    if isinstance(source, torch.nn.Module):
        return
    message = choose(model_kwargs, source, packed_rows, session.device)
    if message and session.is_main_process:
        print(message, flush=True)


def _config(config: Any, model_kwargs: dict[str, Any]) -> Any:
    if isinstance(config, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config, trust_remote_code=bool(model_kwargs.get("trust_remote_code")))
    return config


def varlen_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None, max_length_k: int | None = None,
    position_ids: torch.Tensor | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (batch, heads, len, dim) in, (batch, q_len, heads, dim) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation 'varlen' has no sliding window, softcapping or attention sinks: load "
                         "this model with attn_implementation 'sdpa'")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    dropout = dropout if module.training else 0.0
    if attention_mask is not None and (attention_mask.dim() != 2 or q_len != kv_len):
        # A cache (generation) or a ready 4D mask: sdpa on a dense mask.
        return sdpa_attention_forward(module, query, key, value, _dense_mask(attention_mask, q_len, kv_len, causal),
                                      dropout=dropout, scaling=scaling, is_causal=False)
    if attention_mask is not None:  # padded batch: unpad (as transformers' flash path), one document a row
        valid = attention_mask.bool()
        idx = valid.flatten().nonzero().squeeze(1)
        lens = valid.sum(1, dtype=torch.int32)
        cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        out = _attend(*(_tokens(x)[idx] for x in (query, key, value)), cu, cu, int(lens.max()), int(lens.max()),
                      scaling, causal, dropout)
        return out.new_zeros(batch * q_len, *out.shape[1:]).index_copy_(0, idx, out).view(batch, q_len, *out.shape[1:]), None
    if cu_seq_lens_q is None or cu_seq_lens_k is None or max_length_q is None or max_length_k is None:
        if position_ids is None or q_len != kv_len or not _restarts(position_ids):
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          is_causal=causal)
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = prepare_fa_kwargs_from_position_ids(
            position_ids.expand(batch, -1))
    cu_q = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    cu_k = cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
    out = _attend(_tokens(query), _tokens(key), _tokens(value), cu_q, cu_k, int(max_length_q), int(max_length_k),
                  scaling, causal, dropout)
    return out.view(batch, q_len, *out.shape[1:]), None


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, length, dim) -> (batch * length, heads, dim), the varlen layout."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _restarts(position_ids: torch.Tensor) -> bool:
    """Position ids that restart inside a row (padding-free documents)."""
    return position_ids.shape[-1] > 1 and bool((position_ids[..., 1:] <= position_ids[..., :-1]).any())


def _dense_mask(mask: torch.Tensor, q_len: int, kv_len: int, causal: bool) -> torch.Tensor:
    """A (batch, 1, q_len, kv_len) bool mask from a 2D padding mask (4D passes); all-masked rows see all."""
    if mask.dim() == 4:
        return mask
    dense = mask.bool()[:, None, None, -kv_len:].expand(-1, 1, q_len, -1)
    if causal:
        dense = dense & torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    return dense | ~dense.any(-1, keepdim=True)


def _kernel_usable(device: torch.device) -> bool:
    """:func:`kernel_available`, without its cached look-ups while torch.compile traces a compiled decoder layer
    (``compile_layers``): there the model was loaded with "varlen" only where the kernel runs."""
    if torch.compiler.is_compiling():
        return device.type == "cuda"
    return kernel_available(device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
            max_k: int, scaling: float, causal: bool, dropout: float) -> torch.Tensor:
    """Per-document attention over (total, heads, dim) tokens: torch's kernel, else SDPA per document."""
    dtype = q.dtype
    if dtype == torch.float32 and q.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # under autocast the kernel takes the autocast dtype
    if (dropout == 0.0 and q.is_cuda and dtype in _HALF and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and _kernel_usable(q.device)):
        return _kernel_attention(*(x.to(dtype) for x in (q, k, v)), cu_q, cu_k, max_q, max_k, scaling, causal)
    return _per_document(q, k, v, cu_q, cu_k, scaling, causal, dropout)


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_q: int, max_k: int, scaling: float, causal: bool) -> torch.Tensor:
    fn, params = _RESOLVED["kernel"] if torch.compiler.is_compiling() and "kernel" in _RESOLVED else _kernel()
    kwargs: dict[str, Any] = {}
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0)
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:  # torch 2.10
        kwargs["is_causal"] = causal
    if "scale" in params:
        kwargs["scale"] = scaling
    elif not math.isclose(scaling, q.shape[-1] ** -0.5):
        q = q * (scaling * math.sqrt(q.shape[-1]))  # no scale argument (2.10): fold it into the query
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:  # torch >= 2.12
            kwargs["enable_gqa"] = True
        else:  # grouped-query attention by repeating the key/value heads, as transformers' sdpa does
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, **kwargs)


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  scaling: float, causal: bool, dropout: float) -> torch.Tensor:
    outs = []
    bounds = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])
    for qs, qe, ks, ke in bounds:
        if qe == qs:
            continue
        part = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), dropout_p=dropout,
            is_causal=causal, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        outs.append(part.transpose(0, 1))
    out = torch.cat(outs) if outs else q.new_zeros(0, *q.shape[1:])
    # Tokens past the last document get zeros, as the flash kernel leaves them.
    return F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - out.shape[0]))
