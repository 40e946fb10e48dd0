"""TRL 1.16's importance-sampling correction (``vllm_importance_sampling_*``) applied to posttrain's engine: the
ratio of the training forward's log-probs to the sampler's, truncated or masked per token or per sequence, and
TRL's ``sampling/*`` metrics."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from posttrain.errors import ConfigError

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
CORRECTION_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                     "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                     "vllm_importance_sampling_cap")


def corrects_sampling(cfg: Any) -> bool:
    """Whether ``cfg`` asks for the correction (RLOO's config has no such field: TRL's RLOO has none)."""
    return bool(getattr(cfg, "vllm_importance_sampling_correction", False))


def check_correction_config(cfg: Any) -> None:
    """TRL's checks of the correction fields (its ``__post_init__`` and trainer), as sentences."""
    if cfg.vllm_importance_sampling_cap is not None:  # TRL's deprecated name for clip_max
        warnings.warn("vllm_importance_sampling_cap is deprecated (TRL): use vllm_importance_sampling_clip_max",
                      FutureWarning, stacklevel=3)
        cfg.vllm_importance_sampling_clip_max = cfg.vllm_importance_sampling_cap
    lo, hi, mode = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max, \
        cfg.vllm_importance_sampling_mode
    if mode not in IS_MODES:
        raise ConfigError(f"vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}; got {mode!r}")
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                          f"vllm_importance_sampling_clip_max ({hi})")
    if not cfg.vllm_importance_sampling_correction:
        return
    if mode.endswith("_truncate") and lo is None and hi is None:
        raise ConfigError("a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or "
                          "vllm_importance_sampling_clip_max set")
    if cfg.loss_type == "vespo" and mode not in ("token_truncate", "token_mask"):
        raise ConfigError("loss_type vespo takes the correction per token (TRL's rule): set "
                          "vllm_importance_sampling_mode to token_truncate or token_mask, or "
                          "vllm_importance_sampling_correction: false")


def importance_sampling_ratio(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                              mask: torch.Tensor, mode: str, clip_min: float | None,
                              clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's ``vllm_importance_sampling_ratio``: exp(training - sampling log-probs), per token [B, T] or
    summed per sequence [B, 1], clamped to [clip_min, clip_max] (``*_truncate``) or 0 outside it (``*_mask``)."""
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def sampling_values(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor, ratio: torch.Tensor,
                    mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What TRL's ``sampling/*`` metrics reduce, for whole sequences: |training - sampling| log-prob of each
    completion token, and the ratio of each completion token (token modes) or sequence."""
    mask = mask.bool()
    delta = (old_per_token_logps - sampling_per_token_logps).abs()
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]
    return delta[mask & ~torch.isnan(delta)], flat


def reduce_sampling_values(parts: list[tuple[torch.Tensor, torch.Tensor]], mode: str,
                           gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.reshape(1, -1)
                           ) -> dict[str, float]:
    """TRL's ``sampling/*`` metrics of one generation batch from its parts' :func:`sampling_values` (the micro-batches
    of a batch whose loss forms the ratio): each process's mean and max of |training - sampling| log-prob and
    min/mean/max ratio, then across processes as TRL reduces them (``gather`` stacks each process's [k] values to
    [processes, k]); plus posttrain's ``sampling/masked_fraction`` in the mask modes, the share of completion tokens
    (token modes) or sequences zeroed."""
    from trl.trainer.utils import nanmax, nanmin

    delta, flat = torch.cat([d for d, _ in parts]), torch.cat([f for _, f in parts])
    zero = torch.tensor(0.0, device=delta.device)

    def stat(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x).float() if x.numel() else zero

    local = torch.stack([stat(delta, torch.mean), stat(delta, torch.max), stat(flat, torch.min),
                         stat(flat, torch.mean), stat(flat, torch.max),
                         (flat == 0).float().sum(), torch.tensor(float(flat.numel()), device=delta.device)])
    ranks = gather(local).view(-1, local.numel())
    out = {"sampling/sampling_logp_difference/mean": ranks[:, 0].mean().item(),
           "sampling/sampling_logp_difference/max": ranks[:, 1].max().item(),
           "sampling/importance_sampling_ratio/min": nanmin(ranks[:, 2]).item(),
           "sampling/importance_sampling_ratio/mean": ranks[:, 3].nanmean().item(),
           "sampling/importance_sampling_ratio/max": nanmax(ranks[:, 4]).item()}
    if mode.endswith("_mask"):
        out["sampling/masked_fraction"] = (ranks[:, 5].sum() / ranks[:, 6].sum().clamp(min=1.0)).item()
    return out


def off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                    sampling_per_token_logps: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL 1.16's off-policy sequence mask (DeepSeek-V3.2): [B, 1], 0 where the advantage is negative and the
    mean sampling-minus-current log-prob exceeds ``threshold``."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    avg = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg <= threshold)).to(dtype=mask.dtype)


def correct_sampling(cfg: Any, old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                     mask: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """One generation batch's correction ratio under ``cfg``'s mode and bounds, and its ``sampling/*`` metrics."""
    ratio, values = correct_in_loss(cfg, old_per_token_logps, sampling_per_token_logps, mask)
    return ratio, reduce_sampling_values([values], cfg.vllm_importance_sampling_mode, gather)


def correct_in_loss(cfg: Any, per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Whole sequences' correction ratio under ``cfg``'s mode and bounds, from ``per_token_logps`` (detached: the
    old log-probs, or a micro-batch's training forward's own where a generation batch trains within one optimizer
    step, TRL's rule), and their :func:`sampling_values`."""
    mode, old = cfg.vllm_importance_sampling_mode, per_token_logps.detach()
    ratio = importance_sampling_ratio(old, sampling_per_token_logps, mask, mode,
                                      cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    return ratio, sampling_values(old, sampling_per_token_logps, ratio, mask, mode)
