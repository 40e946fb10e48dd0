"""TRL 1.16's GRPO entropy bonus (``entropy_coef``) and its adaptive control (``use_adaptive_entropy``, from
Skywork-OR1): the loss less ``coef`` times the mean entropy of the tokens the policy loss acts on, the coefficient
moved each optimizer step toward keeping the entropy above ``entropy_target``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

ENTROPY_FIELDS = ("entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
                  "entropy_coef_delta", "entropy_target")


def entropy_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The entropy settings as (ok, the sentence that names the fix)."""
    return [
        (math.isfinite(cfg.entropy_coef) and cfg.entropy_coef >= 0.0,
         f"entropy_coef must be >= 0 (a bonus on the policy's entropy; 0 turns it off); got {cfg.entropy_coef}"),
        (not cfg.use_adaptive_entropy or 0.0 <= cfg.entropy_coef_min <= cfg.entropy_coef_max,
         f"use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max; got {cfg.entropy_coef_min} and "
         f"{cfg.entropy_coef_max}"),
        (not cfg.use_adaptive_entropy or cfg.entropy_coef_delta >= 0.0,
         f"entropy_coef_delta must be >= 0 (the coefficient's change per optimizer step); got {cfg.entropy_coef_delta}"),
    ]


class EntropyBonus:
    """The bonus's coefficient across a run. Each micro-batch applies the coefficient set at the end of the previous
    optimizer step (adaptive: only while that step's entropy was at or below ``entropy_target``); at each step's end
    the adaptive coefficient moves by ``entropy_coef_delta`` from the entropy of all the step's tokens on every
    process. As TRL's GRPOTrainer, whose checkpoint keeps the same state."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.coef = float(cfg.entropy_coef)
        self.adaptive = bool(cfg.use_adaptive_entropy)
        self.enabled = self.coef != 0.0 or self.adaptive  # adaptive stays on at entropy_coef_min, to recover
        self.last_entropy = math.inf  # the last step's entropy over every process (none yet)
        self._window: torch.Tensor | None = None

    def applied(self) -> float:
        """The coefficient this micro-batch's loss uses."""
        if self.adaptive and self.last_entropy > self.cfg.entropy_target:
            return 0.0
        return self.coef

    def term(self, entropies: torch.Tensor, mask: torch.Tensor, accumulation: int) -> torch.Tensor:
        """The bonus subtracted from a micro-batch's loss: the coefficient times the mean entropy over ``mask``
        (with grad), divided for accumulation only, whatever the loss type (TRL's definition)."""
        total, count = (entropies * mask).sum(), mask.sum()
        mean = total / count.clamp(min=1.0) / accumulation
        if self.adaptive:  # the step's entropy, summed with the other micro-batches'
            stats = torch.stack([total, count]).detach().float()
            self._window = stats if self._window is None else self._window + stats
        return self.applied() * mean

    def step_ended(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """At an optimizer step's end: the adaptive coefficient up by ``entropy_coef_delta`` (to
        ``entropy_coef_max``) if the step's entropy over every process is at most ``entropy_target``, else down
        (to ``entropy_coef_min``)."""
        if not self.adaptive or self._window is None:
            return
        total = sum_over_ranks(self._window)
        entropy = (total[0] / total[1].clamp(min=1.0)).item()
        cfg = self.cfg
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy, self._window = entropy, None

    def state(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def restore(self, state: dict[str, Any]) -> None:
        if "entropy_coef" in state:
            self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
