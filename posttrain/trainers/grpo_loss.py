"""GRPO's math, TRL 1.16's line by line, as pure functions: advantages, loss and logged statistics."""

from __future__ import annotations

import math
from typing import Any

import torch

from posttrain.rewards.functions import weighted_sum
from posttrain.trainers.entropy_bonus import EntropyBonus
from posttrain.trainers.off_policy import off_policy_mask

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO-style min(r A, clip(r) A)


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group", aggregation: str = "sum_then_normalize") -> dict[str, torch.Tensor]:
    """TRL 1.16's GRPO advantages over the whole generation batch, grouped by prompt; a row no reward
    function scored (NaN) is left out of the statistics and gets 0. Also returns ``is_std_zero``."""
    from trl.trainer.utils import nanstd

    if aggregation == "sum_then_normalize":
        rewards = weighted_sum(rewards_per_func, weights)
        mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        else:  # "batch"
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:  # normalize_then_sum: each reward normalised within its group, then weighted, then batch-normalised
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1))
        # NaN where no reward scored the row (a group's NaN std can make more of reward_k NaN)
        rewards = weighted_sum(reward_k, weights, unscored=torch.isnan(rewards_per_func).all(dim=1))
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    return {"advantages": torch.nan_to_num(advantages, nan=0.0),
            "is_std_zero": torch.isclose(std, torch.zeros_like(std))}


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float,
                      all_entropies: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens with entropy >= the ``threshold`` quantile of ``all_entropies`` (default: this process's)."""
    pool = entropies[mask.bool()].float() if all_entropies is None else all_entropies
    if pool.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    cut = torch.quantile(pool, threshold)
    return ((entropies * mask.float()) >= cut) & mask.bool()


def grpo_loss(cfg: Any, per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
              ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
              entropy_mask: torch.Tensor | None = None,
              num_items_in_batch: torch.Tensor | float | None = None,
              num_processes: int = 1, sampling_per_token_logps: torch.Tensor | None = None,
              importance_sampling_ratio: torch.Tensor | None = None, entropies: torch.Tensor | None = None,
              bonus: EntropyBonus | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """One micro-batch's loss (divided for accumulation) and (sum, count) ``means``/``per_seq`` to reduce.
    ``num_items_in_batch``: valid tokens of the whole generation batch, all processes;
    ``sampling_per_token_logps``: the sampler's (off_policy_mask_threshold reads them);
    ``importance_sampling_ratio``: the sampler correction (``off_policy.importance_sampling_ratio``);
    ``bonus``: the entropy bonus (``entropy_coef``), read off ``entropies`` (with grad)."""
    from trl import GRPOTrainer

    ga, mask = cfg.gradient_accumulation_steps, mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    if cfg.off_policy_mask_threshold is not None:
        sampled = old if sampling_per_token_logps is None else sampling_per_token_logps
        keep = off_policy_mask(advantages, per_token_logps, sampled, mask, cfg.off_policy_mask_threshold)
    log_ratio = per_token_logps - old
    if cfg.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: one weight per sequence, the mean log-ratio
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)

    if cfg.beta != 0.0:  # k3 estimator of KL(policy || reference)
        diff = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(diff) - diff - 1
        if cfg.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    lo, hi = cfg.epsilon_low, cfg.epsilon_up
    if cfg.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=hi).detach() * advantages * per_token_logps
    elif cfg.loss_type in _CLIPPED_LOSSES:
        coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
        if cfg.delta is not None:  # two-sided clipping (INTELLECT-2)
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif cfg.loss_type == "sapo":
        temps = torch.where(advantages > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * advantages
    else:  # vespo: TRL's gamma weights of the sequence ratio scale the policy gradient
        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
            importance_sampling_ratio=importance_sampling_ratio,
            k_pos=cfg.vespo_k_pos, lambda_pos=cfg.vespo_lambda_pos, k_neg=cfg.vespo_k_neg,
            lambda_neg=cfg.vespo_lambda_neg)
        per_token_loss = -phi_seq * advantages * per_token_logps
    if cfg.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None and cfg.loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if cfg.beta != 0.0:
        per_token_loss = per_token_loss + cfg.beta * per_token_kl

    # TRL's policy loss; the loss types normalised per micro-batch are then divided for accumulation.
    if cfg.loss_type in ("grpo", "sapo"):
        policy = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        policy = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif cfg.loss_type == "dr_grpo":
        policy = (per_token_loss * mask).sum() / (per_token_loss.size(0) * cfg.max_completion_length)
    elif cfg.loss_type in ("cispo", "dapo", "vespo"):
        # num_items_in_batch spans the generation batch: rescale it to one accumulation window
        items = torch.as_tensor(num_items_in_batch, dtype=per_token_logps.dtype).clamp(min=1.0)
        policy = (per_token_loss * mask).sum() / (items / num_processes * ga / cfg.steps_per_generation)
    else:  # luspo
        policy = (per_token_loss * mask).sum(-1).mean()
    loss = policy if cfg.loss_type in ("cispo", "dapo", "vespo") else policy / ga
    if bonus is not None and bonus.enabled:  # the entropy bonus, over the tokens the policy loss acts on
        loss = loss - bonus.term(entropies, mask if entropy_mask is None else mask * entropy_mask, ga)

    with torch.no_grad():
        def masked_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if x.shape[1] == 1:  # sequence level: one value per sequence
                return x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            return (x * mask).sum(), mask.sum()

        def seq_mean(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        per_seq: dict[str, torch.Tensor] = {}
        if bonus is not None and bonus.enabled:  # TRL's policy_loss: a mean over processes of each one's
            means["policy_loss"] = (policy.detach(), torch.ones((), device=policy.device))
        if cfg.beta != 0.0:
            means["kl"] = masked_sum(per_token_kl)
        if cfg.loss_type in _CLIPPED_LOSSES:
            low = ((coef_1 < 1 - lo) & (advantages < 0)).float()
            high = ((coef_1 > 1 + hi) & (advantages > 0)).float()
            means["clip_ratio/low_mean"] = masked_sum(low)
            means["clip_ratio/high_mean"] = masked_sum(high)
            means["clip_ratio/region_mean"] = masked_sum(torch.maximum(low, high))
            per_seq["clip_ratio/low_min"] = seq_mean(low)
            per_seq["clip_ratio/high_max"] = seq_mean(high)
        elif cfg.loss_type == "cispo":
            means["cispo_clip_ratio"] = masked_sum(((coef_1 > hi) & (advantages > 0)).float())
        elif cfg.loss_type == "vespo":
            means["vespo/phi_seq_mean"] = masked_sum(phi_seq)
    return loss, {"means": means, "per_seq": per_seq}


def reduce_loss_stats(stats: list[dict[str, Any]], sum_over_ranks: Any = None, gather: Any = None) -> dict[str, float]:
    """TRL's logged loss stats: token-weighted means (``sum_over_ranks``), min/max (``gather``), averaged."""
    from trl.trainer.utils import nanmax, nanmin

    sum_over_ranks = sum_over_ranks or (lambda t: t)
    gather = gather or (lambda t: t)
    rows: list[dict[str, float]] = []
    for st in stats:
        keys = sorted(st["means"])
        row: dict[str, float] = {}
        parts = torch.stack([torch.stack([st["means"][k][0].float(), st["means"][k][1].float()]) for k in keys])
        totals = sum_over_ranks(parts)
        for k, (s, n) in zip(keys, totals.tolist()):
            row[k] = s / max(n, 1.0)
        for k, v in sorted(st["per_seq"].items()):
            row[k] = (nanmin if k.endswith("min") else nanmax)(gather(v.float())).item()
        rows.append(row)
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def average_generation_metrics(gens: list[dict[str, float]]) -> dict[str, float]:
    """A window's generation metrics as TRL logs them: NaN-skipping means; the latest ``num_tokens``."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in gens for k in m):
        if key == "num_tokens":
            out[key] = [m[key] for m in gens if key in m][-1]
            continue
        valid = [m[key] for m in gens if key in m and not math.isnan(m[key])]
        out[key] = sum(valid) / len(valid) if valid else math.nan
    return out


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's ``completions/*`` metrics over every process's completion lengths."""
    m = {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(),
         "completions/clipped_ratio": truncated.float().mean().item()}
    term = lengths[~truncated]
    term = term if term.numel() else torch.zeros(1)
    m["completions/mean_terminated_length"] = term.mean().item()
    m["completions/min_terminated_length"] = term.min().item()
    m["completions/max_terminated_length"] = term.max().item()
    return m
