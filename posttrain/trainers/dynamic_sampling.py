"""DAPO's dynamic sampling for GRPO and RLOO: groups whose rewards are all equal carry no gradient, so they are
dropped and more prompts sampled (whole generation batches, at most ``dynamic_sampling_max_rounds`` more) until
the generation batch holds only groups with spread. Every process sees every round's rewards, so all choose the
same groups; the chosen rows are then dealt to the processes in the sampled order."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.rewards.functions import weighted_sum

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def group_spread(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] bool: the group's weighted rewards differ (a group with fewer than two scored rows has none)."""
    from trl.trainer.utils import nanstd

    rewards = weighted_sum(rewards_per_func, weights.to(rewards_per_func.device)).view(-1, num_generations)
    std = nanstd(rewards, dim=1)
    return torch.isfinite(std) & ~torch.isclose(std, torch.zeros_like(std))


def choose_groups(spread: list[torch.Tensor], target: int) -> tuple[list[int], bool]:
    """Indices into the rounds' concatenated groups: the first ``target`` with spread, in sampled order; short
    of ``target``, topped up with the earliest groups without spread (``True``: topped up)."""
    flat = torch.cat(spread).tolist()
    kept = [i for i, ok in enumerate(flat) if ok][:target]
    short = target - len(kept)
    if short:
        kept += [i for i, ok in enumerate(flat) if not ok][:short]
    return sorted(kept), short > 0


def gather_rows(session: Any, batch: dict[str, torch.Tensor], rows: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Every process's rows of ``batch``'s per-row tensors, in rank order (prompts left-padded to one width)."""
    out = {}
    for k, v in batch.items():
        if not (v.dim() and v.shape[0] == rows):
            continue
        if session.num_processes > 1:
            if k in _PROMPT_KEYS:
                v = session.accelerator.pad_across_processes(v, dim=1, pad_index=pad_token_id if k == "prompt_ids"
                                                             else 0, pad_first=True)
            v = session.accelerator.gather(v.contiguous())
        out[k] = v
    return out


def _concat(parts: list[torch.Tensor], key: str, pad_token_id: int) -> torch.Tensor:
    if key in _PROMPT_KEYS:  # rounds' prompts have their own widths: left-pad to the widest
        width = max(p.shape[1] for p in parts)
        value = pad_token_id if key == "prompt_ids" else 0
        parts = [F.pad(p, (width - p.shape[1], 0), value=value) for p in parts]
    return torch.cat(parts)


def fill_generation_batch(trainer: Any, cycle: int, batch: dict[str, torch.Tensor], metrics: dict[str, float]
                          ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Generation batch ``cycle`` with its zero-spread groups replaced by groups sampled in further rounds
    (``trainer.dynamic_rounds`` counts the extra batches drawn, so the prompt order stays TRL's sampler's)."""
    cfg, s = trainer.cfg, trainer.session
    g, pad, local = cfg.num_generations, trainer.tokenizer.pad_token_id, trainer.local_gen_size
    target = trainer.prompts_per_generation
    weights = trainer.rewards.weights
    batches = [batch]
    spread = [group_spread(trainer._gather(batch["rewards_per_func"]), weights, g)]
    extra = 0
    while int(sum(x.sum() for x in spread)) < target and extra < cfg.dynamic_sampling_max_rounds:
        extra += 1
        trainer.dynamic_rounds += 1
        # A ZeRO-3 policy's forward leaves parameters prefetched (a step's backward would release them); the
        # rollout's gather needs them partitioned.
        getattr(s.engines["policy"], "empty_partition_cache", lambda: None)()
        idx = trainer._generation_rows(cycle + trainer.dynamic_rounds)
        more, _ = trainer._sample_and_score([trainer.rows[i] for i in idx], [trainer.prompt_ids[i] for i in idx],
                                            g, train=True)
        batches.append(more)
        spread.append(group_spread(trainer._gather(more["rewards_per_func"]), weights, g))
    chosen, topped_up = choose_groups(spread, target)
    flat = torch.cat(spread)
    dropped = int((~flat).sum()) - sum(1 for i in chosen if not flat[i])
    stats = {"dynamic_sampling/dropped_groups": float(dropped), "dynamic_sampling/extra_rounds": float(extra),
             "dynamic_sampling/underfilled": float(topped_up)}
    if chosen == list(range(target)):  # the first round as sampled: the batch is the one without dynamic sampling
        batch.pop("rewards_per_func")
        return batch, {**metrics, **stats}

    rounds = [gather_rows(s, b, local, pad) for b in batches]
    rows = torch.tensor([i * g + j for i in chosen for j in range(g)], device=s.device)
    merged = {k: _concat([r[k] for r in rounds], k, pad).index_select(0, rows) for k in rounds[0]}
    mine = slice(s.process_index * local, (s.process_index + 1) * local)
    out = {k: v[mine] for k, v in merged.items()}
    first = int(out["prompt_mask"].any(0).long().argmax())  # drop the columns that are padding on every row
    out["prompt_ids"], out["prompt_mask"] = out["prompt_ids"][:, first:], out["prompt_mask"][:, first:]
    # The trained batch's advantages, as TRL computes them over its generation batch.
    loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)  # tool output is out of the loss
    adv = trainer.advantages(merged["rewards_per_func"], out.get("old_per_token_logps"),
                             out.get("ref_per_token_logps"), loss_mask[mine], g)
    out["advantages"] = adv["advantages"][mine]
    out["num_items_in_batch"] = loss_mask.sum().float()
    out.pop("rewards_per_func")
    return out, {**metrics, **adv.get("metrics", {}), **stats}
