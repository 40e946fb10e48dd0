"""RLOO (TRL 1.16's ``RLOOTrainer``): GRPO's loop, roles and generation with RLOO's objective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import trl

from posttrain.errors import ConfigError
from posttrain.rewards.functions import weighted_sum
from posttrain.trainers.config import TrainConfig
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import ONLINE_REFUSED, ONLINE_WORKS, OnlineFields, check_online_config


@dataclass
class RLOOConfig(TrainConfig, OnlineFields, trl.RLOOConfig):
    """``trl.RLOOConfig`` (its fields, names and defaults) plus posttrain's placement and rollout fields; RLOO
    has GRPO's roles, loop and generation, and none of GRPO's loss options (TRL's RLOOConfig has none)."""

    _loss_types = ("rloo",)
    _algorithm = "RLOO"
    _trl_works = (*ONLINE_WORKS, "normalize_advantages", "reward_clip_range")
    _trl_refused = ONLINE_REFUSED
    # GRPOConfig's field (TRL 1.16's RLOO has no tools): tool-calling turns per sequence, None for no limit.
    max_tool_calling_iterations: int | None = None

    def __post_init__(self) -> None:
        if self.reward_clip_range is not None:
            if len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]:
                raise ConfigError(f"reward_clip_range must be [min, max]; got {list(self.reward_clip_range)}")
            self.reward_clip_range = tuple(float(x) for x in self.reward_clip_range)
        check_online_config(self)


def rloo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                    kl: torch.Tensor | None = None, beta: float = 0.0, normalize_advantages: bool = False,
                    reward_clip_range: tuple[float, float] | None = None) -> dict[str, torch.Tensor]:
    """TRL 1.16's RLOO advantages over the whole generation batch: clipped weighted rewards minus
    ``beta * kl``, minus the leave-one-out mean of the scored siblings; unscored rows get 0."""
    from trl.trainer.utils import nanstd

    rewards = weighted_sum(rewards_per_func, weights)
    if reward_clip_range:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0 and kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = rewards - baselines.view(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return {"advantages": torch.nan_to_num(advantages, nan=0.0),
            "is_std_zero": torch.isclose(std, torch.zeros_like(std))}


def rloo_loss(cfg: RLOOConfig, per_token_logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """TRL 1.16's ``RLOOTrainer._compute_loss``: the clipped objective on the ratio of summed
    completion log-probs (``old_logps``: the sampling policy's sums), averaged over sequences."""
    logps = (per_token_logps * mask).sum(1)
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_up)
    loss = (-torch.min(coef_1 * advantages, coef_2 * advantages)).mean()
    with torch.no_grad():
        low = ((coef_1 < 1 - cfg.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + cfg.epsilon_up) & (advantages > 0)).float()
        n = torch.tensor(float(low.numel()), device=low.device)
        means = {"clip_ratio/low_mean": (low.sum(), n), "clip_ratio/high_mean": (high.sum(), n),
                 "clip_ratio/region_mean": (torch.maximum(low, high).sum(), n)}
    return loss, {"means": means, "per_seq": {"clip_ratio/low_min": low, "clip_ratio/high_max": high}}


class RLOOTrainer(GRPOTrainer):
    """RLOO with per-role placement and TRL 1.16's constructor; the logged rows (TRL's metric names) are
    ``state.log_history``."""

    name = "rloo"
    config_class = RLOOConfig

    def __init__(self, model: Any, reward_funcs: Any, args: RLOOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None) -> None:
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config,
                         tools, rollout_func, environment_factory)

    def needs_old_logps(self) -> bool:
        return True  # the KL in the reward and the sequence ratio both use them (TRL always computes them)

    def logps_in_rewards(self) -> bool:
        return self.cfg.beta != 0.0  # the KL is in the reward, also in evaluation

    def advantages(self, rewards_per_func: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                   completion_mask: torch.Tensor, num_generations: int | None = None) -> dict[str, Any]:
        cfg, mask = self.cfg, completion_mask.float()
        kl, metrics = None, {}
        if cfg.beta != 0.0:
            # First-order log-ratio summed per sequence, as TRL's RLOO.
            per_token_kl = (old - ref) * mask
            kl = self._gather(per_token_kl.sum(-1))
            totals = self._sum(torch.stack([per_token_kl.sum(), mask.sum()]))
            metrics["kl"] = (totals[0] / totals[1].clamp(min=1.0)).item()
        out = rloo_advantages(rewards_per_func, self.rewards.weights.to(rewards_per_func.device),
                              num_generations or cfg.num_generations, kl, cfg.beta, cfg.normalize_advantages,
                              cfg.reward_clip_range)
        out["metrics"] = metrics
        return out

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)  # tool output is out of the loss
        logps, entropies = self.policy_logps(batch)
        old_logps = (batch["old_per_token_logps"] * mask).sum(1)
        loss, stats = rloo_loss(cfg, logps, old_logps, batch["advantages"], mask)
        stats["means"]["entropy"] = ((entropies.detach() * mask).sum(), mask.sum().float())
        return loss, stats

    def backward_scale(self) -> float:
        return 1.0  # TRL's RLOO loss is a plain mean; the engine divides by the accumulation steps
