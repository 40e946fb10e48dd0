"""The ``"hf"`` backend: transformers' ``generate`` with the engine's keyed sampler."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.rollout.sampling import GumbelSampling, SamplingParams, token_logprobs


@contextmanager
def generation_model(session: Any, role: str, bare: nn.Module | None, zero3: bool, gather: bool
                     ) -> Iterator[tuple[nn.Module, bool]]:
    """The module to call ``generate`` on, and whether the ranks must run in lock-step."""
    if bare is not None:
        yield bare, False
        return
    s = session
    with s.activate(role):
        if zero3 and (role in s.fast_frozen or not gather):
            # posttrain.placement.frozen or DeepSpeed's hooks gather layer by layer on every forward.
            yield s.engines[role].module, s.num_processes > 1
        elif zero3:
            from trl.models.utils import unwrap_model_for_generation

            with unwrap_model_for_generation(s.engines[role], s.accelerator_for(role),
                                             gather_deepspeed3_params=True) as model:
                yield model, False
        else:
            yield s.engines[role].module, False


@contextmanager
def own_generation_config(model: nn.Module) -> Iterator[None]:
    """While ``generate`` runs, the model's generation config is transformers' defaults: its hub values
    (an instruct model's ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``...) would
    otherwise fill every field the call leaves unset and change the sampled distribution, unlike the engine's."""
    from transformers import GenerationConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = getattr(base, "generation_config", None)
    if saved is None:
        yield
        return
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


def hf_generate(model: nn.Module, synced: bool, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                sampling: SamplingParams, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion tokens and log-probs [B, max_new_tokens] (padded if every row stopped early)."""
    from transformers import GenerationConfig

    n = sampling.max_new_tokens
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=sampling.min_new_tokens or None, do_sample=False,
                           pad_token_id=sampling.pad_token_id, eos_token_id=sampling.stop_token_ids or None,
                           repetition_penalty=sampling.repetition_penalty, return_dict_in_generate=True,
                           output_logits=True)
    processors = [GumbelSampling(sampling, key, prompt_ids.shape[1])] if sampling.do_sample else []
    with torch.no_grad(), own_generation_config(model):
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
