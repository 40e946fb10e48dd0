"""A causal LM's forward that returns per-token log-probs and entropies without its ``[tokens, vocab]`` logits:
the model runs as its own forward (so every placement's hooks gather what they gather), and its output layer,
given the hidden states, computes them with TRL's ``ChunkedLogProbFunction`` (tiles of tokens and of the
vocabulary, the backward recomputing each tile) instead of the logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# TRL's vocabulary tile (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE); its token tile is TRL's TOKEN_CHUNK_SIZE.
VOCAB_CHUNK = 32768
# Config fields whose logit transform a model applies after its output layer: those models keep their logits.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def output_layer(model: Any) -> nn.Linear | None:
    """The plain linear output layer of ``model`` (a DeepSpeed engine's or a peft model's causal LM), or None
    where the log-probs cannot come from it alone (no such layer, an adapted one, a logit transform after it)."""
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not isinstance(head, nn.Linear) or any(getattr(text, name, None) is not None for name in _LOGIT_TRANSFORMS):
        return None
    return head


def head_logps(model: Any, head: nn.Linear, targets: torch.Tensor, temperature: float, compute_entropy: bool,
               drop_last: bool, **inputs: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
    """``model(**inputs)`` with ``head`` (its :func:`output_layer`) computing, for the ``[B, S, H]`` hidden states
    it is given (``drop_last``: all but each row's last), the log-probs of ``targets`` ``[B, S]`` under
    softmax(logits / ``temperature``) in float32 (with grad) and the entropies (detached, when asked), instead of
    the logits. Returns (log-probs, entropies, the model's output); log-probs None where the layer was given other
    hidden states (a model that slices after it): the output then holds the logits."""
    from trl.kernels import ChunkedLogProbFunction

    found: dict[str, torch.Tensor | None] = {}

    def hook(module: nn.Linear, args: tuple) -> tuple | None:
        hidden = args[0][:, :-1] if drop_last else args[0]
        if hidden.shape[:-1] != targets.shape:
            return None
        outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
        lp, ent, *_ = ChunkedLogProbFunction.apply(hidden.reshape(-1, hidden.shape[-1]), module.weight, module.bias,
                                                    targets.reshape(-1), temperature, VOCAB_CHUNK, None, 1.0, outputs)
        found["logps"] = lp.view(targets.shape)
        found["entropy"] = ent.detach().view(targets.shape) if ent is not None else None
        return (args[0][:, :0], *args[1:])  # the layer itself then projects no token

    handle = head.register_forward_pre_hook(hook)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return found.get("logps"), found.get("entropy"), out
