"""Model shapes for the planner and the benchmarks: Llama-shaped presets, configs, parameter counts
from the meta device, and the parameters peft's LoRA adapters add."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from posttrain.errors import ConfigError

# Llama-shaped presets built from config with random weights (benchmarks and the planner).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, vocab_size=32000),
    # TinyLlama-1.1B's shape.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    # Llama-3.2-3B's shape.
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # Llama-3-8B's shape.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256)}


def resolve_shape(spec: str, what: str = "--shape") -> str:
    """A preset's name in any case, or a model folder or hub id (checked before the hub is asked)."""
    from posttrain.checks import check_model_path

    if spec.lower() in SHAPES:
        return spec.lower()
    presets = ", ".join(SHAPES)
    if re.fullmatch(r"[\d.]+[kmbt]?", spec.lower()):
        raise ConfigError(f"{what} {spec!r} is not a preset: choose one of {presets} (any case), or give a model "
                          "folder or hub id")
    try:
        check_model_path(spec, what, weights=False)
    except ConfigError as err:
        raise ConfigError(f"{err}, or choose a preset: {presets}") from None
    return spec


def model_config(spec: str, kind: str = "causal", vocab_size: int | None = None) -> Any:
    """A transformers config: :data:`SHAPES` preset, hub name or path; ``vocab_size`` replaces the vocab."""
    from transformers import AutoConfig, LlamaConfig

    if spec in SHAPES:
        shape = {"tie_word_embeddings": False, **SHAPES[spec]}
        cfg = LlamaConfig(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)
    else:
        try:
            cfg = AutoConfig.from_pretrained(spec)
        except (OSError, ValueError) as err:  # no such repo, no network, a config transformers cannot read
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"cannot read the model config of {spec!r} ({first}): give a preset "
                              f"({', '.join(SHAPES)}), a local model folder or a reachable hub id") from None
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    if kind in ("token", "sequence"):
        cfg.num_labels = 1
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = 0
    return cfg


def model_class(kind: str) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    return {"causal": AutoModelForCausalLM, "sequence": AutoModelForSequenceClassification,
            "token": AutoModelForTokenClassification}[kind]


@dataclass(frozen=True)
class ModelSize:
    params: int
    largest_layer: int  # parameters of the largest module (DeepSpeed's ZeRO-3 working-set term)
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int
    vocab: int
    kind: str


def meta_model(spec: str, kind: str = "causal", vocab_size: int | None = None) -> Any:
    """The model built from its config on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        return model_class(kind).from_config(model_config(spec, kind, vocab_size))


@functools.lru_cache(maxsize=64)
def model_size(spec: str, kind: str = "causal", vocab_size: int | None = None) -> ModelSize:
    """Count parameters exactly by building the model on the meta device (no memory, no init)."""
    model = meta_model(spec, kind, vocab_size)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelSize(params=params, largest_layer=largest, hidden=text.hidden_size,
                     intermediate=text.intermediate_size, layers=text.num_hidden_layers,
                     kv_dim=kv_heads * head_dim, vocab=text.vocab_size, kind=kind)


@dataclass(frozen=True)
class Lora:
    """Rank-``r`` adapters on ``target_modules``: None: peft's default; ("all-linear",): all but the head;
    ``dropout``: peft's ``lora_dropout`` (its default 0: no copy of the adapted layers' inputs)."""

    r: int = 16
    target_modules: tuple[str, ...] | None = None
    dropout: float = 0.0


@functools.lru_cache(maxsize=64)
def adapter_params(spec: str, kind: str, lora: Lora, vocab_size: int | None = None) -> int:
    """Trainable params peft gives: ``r * (in + out)`` per adapted linear (embeddings too), plus the head."""
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    model = meta_model(spec, kind, vocab_size)
    targets = lora.target_modules or _default_targets(model)
    # A classifier's head is one of peft's modules_to_save: trained in full, never adapted.
    saved = SEQ_CLS_HEAD_NAMES if kind != "causal" else []
    heads = [getattr(model, n) for n in saved if getattr(model, n, None) is not None][:1]
    total = sum(p.numel() for h in heads for p in h.parameters())
    for module in _adapted(model, targets, saved):
        if isinstance(module, nn.Embedding):
            total += lora.r * (module.num_embeddings + module.embedding_dim)
        elif isinstance(module, (nn.Linear, Conv1D)):
            total += lora.r * sum(module.weight.shape)
    return total


def _default_targets(model: Any) -> Any:
    """peft's default target modules for the model's architecture."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.model_type)
    if targets is None:
        raise ConfigError(f"peft has no default LoRA target modules for model type {model.config.model_type!r}: "
                          "name them with --lora-target-modules (or all-linear)")
    return targets


def _adapted(model: Any, targets: Any, saved: list[str]) -> Any:
    """Modules peft adapts: "all-linear" (all but output embedding) or matching ``targets``; not ``saved``."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    all_linear = [t.lower() for t in targets] == ["all-linear"]
    for name, module in model.named_modules():
        if any(re.match(rf"(^|.*\.){n}($|\..*)", name) for n in saved):
            continue
        if all_linear:
            chosen = isinstance(module, (nn.Linear, Conv1D)) and module is not model.get_output_embeddings()
        else:
            chosen = any(name == t or name.endswith(f".{t}") for t in targets)
        if chosen and isinstance(module, (nn.Embedding, nn.Linear, Conv1D)):
            yield module


@functools.lru_cache(maxsize=64)
def adapted_inputs(spec: str, lora: Lora, vocab_size: int | None = None) -> int:
    """Input features of every adapted linear layer of the causal LM (what LoRA's dropout copies per token)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    model = meta_model(spec, "causal", vocab_size)
    targets = lora.target_modules or _default_targets(model)
    return sum(m.weight.shape[1] if isinstance(m, nn.Linear) else m.weight.shape[0]
               for m in _adapted(model, targets, []) if isinstance(m, (nn.Linear, Conv1D)))


@functools.lru_cache(maxsize=64)
def appended_adapter_params(spec: str, lora: Lora, vocab_size: int | None = None) -> int:
    """Elements the engine adds in LoRA mode "grouped" (rollout/adapters.py): per group of projections sharing an
    input (q|k|v, gate|up, o, down) with an adapted one, the A rows and the [out, R] expand block."""
    from torch import nn

    from posttrain.rollout.weights import projection_groups

    model = meta_model(spec, "causal", vocab_size)
    targets = lora.target_modules or _default_targets(model)
    adapted = {id(m) for m in _adapted(model, targets, []) if isinstance(m, nn.Linear)}
    total = 0
    for layer in model.model.layers:
        for _, _, group in projection_groups(layer):
            rank = lora.r * sum(id(m) in adapted for m in group)
            total += rank * (group[0].in_features + sum(m.out_features for m in group))
    return total


@functools.lru_cache(maxsize=64)
def merged_adapter_params(spec: str, lora: Lora, vocab_size: int | None = None) -> int:
    """Weights the rollout engine keeps merged (``lora_mode`` merged): each adapted linear weight again."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    model = meta_model(spec, "causal", vocab_size)
    targets = lora.target_modules or _default_targets(model)
    return sum(m.weight.numel() for m in _adapted(model, targets, []) if isinstance(m, (nn.Linear, Conv1D)))
