"""Sampling settings, top-k/top-p, keyed Gumbel-max (the noise a hash of key, step, sequence and token) and
TRL's truncation after the first stop token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor

from posttrain.errors import ConfigError


@dataclass
class SamplingParams:
    """What to sample; names as in transformers' GenerationConfig / TRL configs."""

    max_new_tokens: int
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float | None = None  # None or 0: off
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # EOS and stop tokens
    do_sample: bool = True  # False: greedy
    repetition_penalty: float = 1.0  # transformers' (CTRL's): 1 off; a seen token's logit divided (or times if < 0)

    def __post_init__(self) -> None:
        # None means "off", as in TRL's configs (top_k: None in some versions).
        self.top_k = 0 if self.top_k is None else int(self.top_k)
        self.top_p = 1.0 if self.top_p is None else float(self.top_p)
        self.min_p = check_min_p(self.min_p)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}; use do_sample=False for greedy")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        self.repetition_penalty = check_repetition_penalty(self.repetition_penalty)
        if self.top_k < 0 or self.min_new_tokens < 0:
            raise ConfigError(f"top_k and min_new_tokens must be >= 0, got {self.top_k} and {self.min_new_tokens}")
        self.stop_token_ids = list(self.stop_token_ids)


def check_min_p(min_p: float | None) -> float | None:
    """``min_p`` as the sampler takes it (None: off, for None or 0), or the sentence that names the fix."""
    if min_p is not None and not 0 <= min_p <= 1:
        raise ConfigError(f"min_p must be in [0, 1] (0 or None: off), got {min_p}")
    return float(min_p) if min_p else None


def check_repetition_penalty(penalty: float) -> float:
    """``repetition_penalty`` as the sampler takes it (1: off), or the sentence that names the fix."""
    if isinstance(penalty, bool) or not penalty > 0:
        raise ConfigError(f"repetition_penalty must be > 0 (1: off), got {penalty}")
    return float(penalty)


# TRL's ``generation_kwargs`` keys the engine's sampler takes: transformers' GenerationConfig names and vLLM's
# SamplingParams names (TRL hands the dict to whichever generates), each to its SamplingParams field.
GENERATION_KWARGS = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "do_sample": "do_sample",
                     "min_new_tokens": "min_new_tokens", "min_tokens": "min_new_tokens",
                     "repetition_penalty": "repetition_penalty"}
_STOP_KWARGS = ("eos_token_id", "stop_token_ids")


def generation_overrides(kwargs: dict[str, Any] | None, eos_ids: list[int], temperature: float) -> dict[str, Any]:
    """SamplingParams fields from TRL's ``generation_kwargs``, which override the config's sampling fields as in
    TRL. ``eos_token_id`` (transformers) replaces the stop ids ``eos_ids``, ``stop_token_ids`` (vLLM) adds to
    them; any other key, or a ``temperature`` other than the config's, is refused in one sentence."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"generation_kwargs must be a dict, got {type(kwargs).__name__}")
    out: dict[str, Any] = {}
    stops, extra = None, []
    for key, value in kwargs.items():
        if key in GENERATION_KWARGS:
            # vLLM's top_k -1 and transformers' None both mean off
            out[GENERATION_KWARGS[key]] = 0 if key == "top_k" and value in (None, -1) else value
        elif key in _STOP_KWARGS:
            ids = [value] if isinstance(value, int) else list(value or [])
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ConfigError(f"generation_kwargs {key} must be token ids (whole numbers >= 0), got {value!r}")
            if key == "eos_token_id":
                stops = ids
            else:
                extra = ids
        elif key == "temperature":
            if value != temperature:  # TRL would sample at one temperature and score the loss at the other
                raise ConfigError(f"generation_kwargs temperature {value} differs from temperature {temperature}, "
                                  "which the loss divides the logits by: set temperature instead")
        elif key in ("max_new_tokens", "max_tokens", "max_length"):
            raise ConfigError(f"generation_kwargs {key}: the completion length is max_completion_length; set that "
                              "instead")
        else:
            takes = ", ".join([*GENERATION_KWARGS, *_STOP_KWARGS, "temperature"])
            raise ConfigError(f"generation_kwargs {key!r} has no equivalent in posttrain's engine, which takes "
                              f"{takes}: remove it")
    if stops is not None or extra:
        base = list(eos_ids) if stops is None else stops
        out["stop_token_ids"] = base + [t for t in extra if t not in base]
    SamplingParams(max_new_tokens=1, pad_token_id=0, **out)  # the values' own checks, before anything loads
    return out


@dataclass
class RolloutOutput:
    sequences: torch.Tensor  # [B, P+N] prompt (left-padded, as given) + completion
    completion_ids: torch.Tensor  # [B, N]; after the first stop token: pad (the stop token itself kept)
    completion_mask: torch.Tensor  # [B, N] 1 up to and including the first stop token
    logprobs: torch.Tensor  # [B, N] float32, under the temperature-scaled distribution; 0 where masked


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at ``tokens`` (float32), before any filtering."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float | torch.Tensor, use_top_p: bool | None = None,
                  min_p: float | torch.Tensor | None = None, use_min_p: bool | None = None) -> torch.Tensor:
    """transformers' TopK, TopP then MinP warpers with static shapes (removed entries -inf)."""
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
    if use_min_p if use_min_p is not None else bool(min_p):
        # transformers' MinPLogitsWarper op for op: below min_p times the top token's probability goes (the top
        # token itself never does).
        probs = torch.softmax(scaled, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove = remove.scatter(-1, probs.argmax(dim=-1, keepdim=True), False)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on int64 tensors holding values < 2**32 (products stay below 2**63)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def gumbel_noise(key: torch.Tensor, step: torch.Tensor, seq: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab], a pure function of (key, step, seq, token); ``key`` 0-d or per row."""
    seq = seq.view(-1, 1).to(torch.int64)
    key = key.view(-1, 1) if key.dim() else key
    step = step.view(-1, 1) if step.dim() else step
    tok = torch.arange(vocab, device=seq.device, dtype=torch.int64).unsqueeze(0)
    base = _hash32(_hash32(key ^ (step * 0x2545F491)) + seq * 0x5851F42D)
    return gumbel_from_bits(_hash32(base ^ _hash32(tok + 0x9E3779B)))


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) from 32 random bits. 23 of them, so every ``u`` is a float32 strictly inside (0, 1): with 24,
    ``2**24 - 0.5`` rounds to ``2**24``, ``u`` to 1 and the noise to +inf, an arbitrary token chosen at any logit."""
    u = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def choose_tokens(logits: torch.Tensor, step: torch.Tensor, key: torch.Tensor, *, seq: torch.Tensor | None = None,
                  temperature: float | torch.Tensor, do_sample: bool | torch.Tensor, top_k: int = 0,
                  top_p: float | torch.Tensor = 1.0, use_top_p: bool | None = None,
                  min_new_tokens: int | torch.Tensor = 0, stop_ids: torch.Tensor | None = None,
                  min_p: float | torch.Tensor | None = None, use_min_p: bool | None = None,
                  seen: torch.Tensor | None = None, penalty: float | torch.Tensor = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob from raw logits [B, V]. Scalars may be 0-d tensors (graph
    inputs); top_k, ``use_top_p``, ``use_min_p``, stop tokens and ``seen`` (given or None) are fixed per graph.
    ``seen`` [B, V]: the tokens each row's prompt and completion hold, whose logits the repetition ``penalty``
    scales before the temperature, as transformers' RepetitionPenaltyLogitsProcessor; the log-prob is the
    unpenalized one, as the training forward computes it."""
    if seq is None:
        seq = torch.arange(logits.size(0), device=logits.device)
    raw = logits.float()
    scaled = raw / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    pick = scaled
    if seen is not None:
        pick = torch.where(seen, torch.where(raw < 0, raw * penalty, raw / penalty), raw) / temperature
    if stop_ids is not None:
        barred = torch.zeros(scaled.size(-1), dtype=torch.bool, device=scaled.device).index_fill(0, stop_ids, True)
        early = (step < min_new_tokens).view(-1, 1) if step.dim() else step < min_new_tokens
        pick = pick.masked_fill(barred & early, float("-inf"))
    if isinstance(do_sample, bool):
        if do_sample:  # greedy ignores top-k/top-p, as transformers does (argmax is kept by both)
            pick = filter_logits(pick, top_k, top_p, use_top_p, min_p, use_min_p)
            pick = pick + gumbel_noise(key, step, seq, pick.size(1))
    else:
        pick = filter_logits(pick, top_k, top_p, use_top_p, min_p, use_min_p)
        pick = pick + gumbel_noise(key, step, seq, pick.size(1)) * do_sample
    tokens = pick.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool: the tokens of each row of ``ids`` where ``mask`` (what the repetition penalty scales;
    transformers' processor skips left padding and ids past the vocabulary the same way)."""
    marks = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    marks.scatter_(1, ids.masked_fill(mask == 0, vocab).clamp(max=vocab), True)
    return marks[:, :vocab]


def finish(completion: torch.Tensor, logprobs: torch.Tensor, sampling: SamplingParams
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's truncate_response for several stop tokens; (completion, mask, log-probs)."""
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


class GumbelSampling(LogitsProcessor):
    """A logits processor turning transformers' greedy search into the engine's sampler."""

    def __init__(self, sampling: SamplingParams, key: int, prompt_len: int) -> None:
        self.sampling, self.key, self.prompt_len = sampling, key, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = torch.tensor(input_ids.shape[1] - self.prompt_len, device=scores.device)
        key = torch.tensor(self.key, device=scores.device)
        s = self.sampling
        pick = filter_logits(scores.float() / s.temperature, s.top_k, s.top_p, min_p=s.min_p)
        seq = torch.arange(scores.size(0), device=scores.device)
        return pick + gumbel_noise(key, step, seq, scores.size(1))
