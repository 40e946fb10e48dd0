"""What the decoder reads: detached views of the live parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttrain.rollout.adapters import adapted, appended_rank, base_of, resolve


def projection_groups(layer: nn.Module) -> tuple[tuple[str, tuple[str, ...], tuple[nn.Module, ...]], ...]:
    """A decoder layer's projections by shared input: (group key, keys, modules)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (("qkv", ("q", "k", "v"), (attn.q_proj, attn.k_proj, attn.v_proj)),
            ("gate_up", ("gate", "up"), (mlp.gate_proj, mlp.up_proj)),
            ("o", ("o",), (attn.o_proj,)), ("down", ("down",), (mlp.down_proj,)))


def appended_layout(model: nn.Module) -> list[tuple[list[nn.Parameter], int]]:
    """For a ZeRO-3 shadow's layout (rollout/shadow.py): each projection group with a LoRA-adapted member, its base
    weights and the rows LoRA mode "grouped" appends after them (the adapters' ranks)."""
    out = []
    for layer in model.model.layers:
        for _, _, modules in projection_groups(layer):
            ms = [resolve(m) for m in modules]
            if any(adapted(m) for m in ms):
                out.append(([base_of(m).weight for m in ms], appended_rank(ms)))
    return out


def read_weights(model: nn.Module, fused: list[dict[str, torch.Tensor | None]] | None, src: Any) -> dict[str, Any]:
    """Decoder weights as detached views of live params, read via ``src``; ``fused`` fuses q|k|v, gate|up."""
    base = model.model
    norm = src.module

    def linear(entry: dict[str, Any], key: str, module: nn.Module, weight: bool = True, own: bool = True) -> None:
        w, b, terms = src.linear(module, terms=own)
        if weight:
            entry[key] = w
            if b is not None:
                entry[key + "b"] = b
        if terms:
            entry[key + "_lora"] = terms

    layers = []
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        entry: dict[str, Any] = {"ln1": src.tensor(norm(layer.input_layernorm).weight),
                                 "ln2": src.tensor(norm(layer.post_attention_layernorm).weight)}
        if fused:
            entry.update({k: v for k, v in fused[i].items() if v is not None})
        for group, keys, modules in projection_groups(layer):
            appended = src.append(modules)  # LoRA mode "grouped": base and A rows in one GEMM
            if appended is not None:
                entry.pop(group, None)
                entry.pop(group + "b", None)
                entry.update({group + "_ext": appended.weight, group + "_up": appended.expand})
                if appended.bias is not None:
                    entry[group + "_extb"] = appended.bias
                if appended.expand_bias is not None:
                    entry[group + "_upb"] = appended.expand_bias
                continue
            terms = src.group(modules) if len(modules) > 1 else None  # "grouped" where the base is not laid out
            if terms:
                entry[group + "_lora"] = terms
            for key, module in zip(keys, modules):
                linear(entry, key, module, weight=group not in entry, own=not terms)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            entry.update(qn=src.tensor(norm(attn.q_norm).weight), kn=src.tensor(norm(attn.k_norm).weight))
        layers.append(entry)
    head: dict[str, Any] = {}
    linear(head, "head", model.lm_head)
    return {"embed": src.tensor(norm(base.embed_tokens).weight), "norm": src.tensor(norm(base.norm).weight),
            "head": head["head"], "head_bias": head.get("headb"), "head_lora": head.get("head_lora"),
            "inv_freq": base.rotary_emb.inv_freq, "layers": layers}


def _groups(layer: nn.Module) -> list[tuple[str, tuple[nn.Module, ...]]]:
    """The groups of several projections (q|k|v, gate|up), which fused views and copies join."""
    return [(key, modules) for key, _, modules in projection_groups(layer) if len(modules) > 1]


def _end_to_end(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` as a view if the parts lie end to end in one storage, else None."""
    first = parts[0]
    end = first.data_ptr()
    for t in parts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.data_ptr() != end):
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def fused_views(model: nn.Module, src: Any) -> list[dict[str, torch.Tensor | None]] | None:
    """Per-layer fused q|k|v and gate|up views where each group lies end to end; else None."""
    if src.lora:
        return None
    out = []
    for layer in model.model.layers:
        entry: dict[str, torch.Tensor | None] = {}
        for key, modules in _groups(layer):
            weights, biases = zip(*(src.linear(m, terms=False)[:2] for m in modules))
            weight = _end_to_end(list(weights))
            has_bias = [b is not None for b in biases]
            bias = _end_to_end(list(biases)) if all(has_bias) else None
            if weight is None or (any(has_bias) and bias is None):
                return None
            entry[key], entry[key + "b"] = weight, bias
        out.append(entry)
    return out


def fused_buffers(model: nn.Module, src: Any) -> list[dict[str, torch.Tensor | None]]:
    """Per-layer fused q|k|v and gate|up copies (engine option ``fused``)."""
    out = []
    for layer in model.model.layers:
        entry: dict[str, torch.Tensor | None] = {}
        for key, modules in _groups(layer):
            shapes = [src.weight_shape(m) for m in modules]
            like = {"dtype": shapes[0][2], "device": shapes[0][3]}
            rows = sum(s[0] for s in shapes)
            weight = torch.empty(rows, shapes[0][1], **like)
            # A bias if any part has one (a LoRA bias on q alone, say); the others' parts are zeros.
            bias = torch.zeros(rows, **like) if any(src.has_bias(m) for m in modules) else None
            o = 0
            for m, (n, *_) in zip(modules, shapes):
                src.adopt(m, weight[o : o + n], bias[o : o + n] if bias is not None and src.has_bias(m) else None)
                o += n
            entry[key], entry[key + "b"] = weight, bias
        out.append(entry)
    return out


@torch.no_grad()
def refresh_fused(model: nn.Module, fused: list[dict[str, torch.Tensor | None]], src: Any) -> None:
    """Copy the live weights into the fused buffers, in place."""
    for layer, entry in zip(model.model.layers, fused):
        for key, modules in _groups(layer):
            o = 0
            for m in modules:
                w, b, _ = src.linear(m, terms=False)
                part = entry[key][o : o + w.shape[0]]
                if w.data_ptr() != part.data_ptr():  # not an adopted (merged) buffer
                    part.copy_(w)
                    if entry[key + "b"] is not None and b is not None:
                        entry[key + "b"][o : o + w.shape[0]].copy_(b)
                o += w.shape[0]
