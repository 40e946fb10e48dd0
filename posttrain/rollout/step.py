"""The decode step's parts as pure functions, and :class:`Parts`, run eager or compiled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.rollout import decoder
from posttrain.rollout.decoder import DecoderSpec
from posttrain.rollout.sampling import choose_tokens


def sample(spec: DecoderSpec, h: torch.Tensor, head: torch.Tensor, head_bias: Any, head_lora: Any,
            step: torch.Tensor, seq: torch.Tensor, key: torch.Tensor, temperature: torch.Tensor,
            do_sample: torch.Tensor, top_p: torch.Tensor, min_new: torch.Tensor, top_k: int, use_top_p: bool,
            stop_ids: torch.Tensor | None, stop_mask: torch.Tensor | None = None, kernel: bool = False,
            min_p: torch.Tensor | None = None, use_min_p: bool = False, seen: torch.Tensor | None = None,
            penalty: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head and the sampler (posttrain's Triton one if ``kernel``, else ``choose_tokens``)."""
    logits = decoder.head(spec, {"head": head, "head_bias": head_bias, "head_lora": head_lora}, h, normed=True)
    if kernel:
        from posttrain.rollout.kernels import sample as triton_sample

        return triton_sample.choose_tokens(logits, step, key, seq, temperature, do_sample, min_new, stop_mask)
    return choose_tokens(logits, step, key, seq=seq, temperature=temperature, do_sample=do_sample, top_k=top_k,
                         top_p=top_p, use_top_p=use_top_p, min_new_tokens=min_new, stop_ids=stop_ids, min_p=min_p,
                         use_min_p=use_min_p, seen=seen, penalty=penalty if penalty is not None else 1.0)


def inputs(spec: DecoderSpec, last: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, key_valid: torch.Tensor,
            cols: torch.Tensor, embed: torch.Tensor, ln1: torch.Tensor, inv_freq: torch.Tensor, max_len: int
            ) -> tuple[torch.Tensor, ...]:
    """The step's prologue: embeddings, norm, rotary cos/sin, additive mask, each row's flat cache index."""
    x = torch.nn.functional.embedding(last.unsqueeze(1), embed)
    cos, sin = decoder.rotary(pos.unsqueeze(1), inv_freq, spec.rope_scaling, x.dtype)
    allowed = key_valid & (cols.unsqueeze(0) <= col.unsqueeze(1))
    # In the model dtype (0 and -inf are exact): SDPA takes it as it is, float32 scores promote it.
    bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
    rows = torch.arange(last.shape[0], device=x.device).unsqueeze(1)
    heads = torch.arange(spec.kv_heads, device=x.device).unsqueeze(0)
    write = col.clamp(max=cols.shape[0] - 1).unsqueeze(1)
    where = ((rows * spec.kv_heads + heads) * max_len + write).reshape(-1)
    return (x, decoder.rms_norm(x, ln1, spec.eps), cos, sin, bias.view(allowed.shape[0], 1, 1, allowed.shape[1]),
            where)


def record(done: torch.Tensor, step: torch.Tensor, last: torch.Tensor, pos: torch.Tensor, col: torch.Tensor,
            out_tokens: torch.Tensor, out_logprobs: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
            limit: torch.Tensor, stop_mask: torch.Tensor | None, pad: int, seen: torch.Tensor | None = None) -> None:
    """The step's epilogue on the slot state, in place (stop tokens by mask: no host sync); a live row's token
    joins ``seen`` (the repetition penalty's)."""
    rows = tokens.shape[0]
    d, st = done[:rows], step[:rows]
    if seen is not None:
        at = tokens.unsqueeze(1)
        seen[:rows].scatter_(1, at, seen[:rows].gather(1, at) | ~d.unsqueeze(1))
    tokens = torch.where(d, pad, tokens)
    r, c = torch.arange(rows, device=tokens.device), st.clamp(max=out_tokens.shape[1] - 1)
    # A done row keeps what it wrote (its clamped column may hold its last real token).
    out_tokens[r, c] = torch.where(d, out_tokens[r, c], tokens)
    out_logprobs[r, c] = torch.where(d, out_logprobs[r, c], logprobs)
    finished = st >= limit - 1
    if stop_mask is not None:
        finished = finished | stop_mask[tokens]
    live = (~d).long()
    last[:rows] = tokens
    step[:rows] += live
    pos[:rows] += live
    col[:rows] += live
    done[:rows] = d | finished


def prompt_inputs(valid: torch.Tensor, members: torch.Tensor, place: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared prompt slots' prologue: their mask, clamped ``members`` and ``place``."""
    rows = place.shape[0]
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))
    return (bias.view(valid.shape[0], 1, 1, valid.shape[1]), members.clamp(max=rows),
            place.clamp(max=members.numel() - 1))


@dataclass(frozen=True)
class Parts:
    """The functions one decode step calls (eager or ``torch.compile``d)."""

    inputs: Callable
    prompt: Callable
    qkv: Callable
    post: Callable
    out: Callable
    sample: Callable
    record: Callable

    @classmethod
    def eager(cls) -> Parts:
        return cls(inputs=inputs, prompt=prompt_inputs, qkv=decoder.project_qkv, post=decoder.decode_layer_post,
                   out=decoder.attention_out, sample=sample, record=record)

    @classmethod
    def compiled(cls, backend: str | Callable) -> Parts:
        """Each part ``torch.compile``d with ``backend``, fullgraph and dynamic."""
        import torch._dynamo

        # Each engine is a recompile of these functions: past the limit dynamo would silently run eager.
        limit = max(64, getattr(torch._dynamo.config, "recompile_limit", 8))
        torch._dynamo.config.recompile_limit = limit
        if hasattr(torch._dynamo.config, "cache_size_limit"):
            torch._dynamo.config.cache_size_limit = max(limit, torch._dynamo.config.cache_size_limit)
        options: dict[str, Any] = dict(fullgraph=True, dynamic=True, backend=backend)
        if backend == "inductor":
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "emulate_precision_casts"):
                options["options"] = {"emulate_precision_casts": True}
        eager = cls.eager()
        return cls(**{name: torch.compile(fn, **options) for name, fn in vars(eager).items()})
