"""Reductions over the processes of a run (accelerate's reduce and gather; over the training ranks alone where
some ranks only generate), and the world size before the process group exists."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from posttrain.placement.session import Session


def world_size() -> int:
    """The number of processes, from the launcher's environment (before the process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def training_group(session: Session) -> Any:
    """The training ranks' process group under a generation-rank layout, else None (accelerate's world)."""
    groups = getattr(session, "groups", None)
    if groups is None:
        return None
    if groups.generates:
        raise RuntimeError("a reduction over the training ranks was called on a generation rank "
                           f"(rank {groups.rank}): only the training ranks take part in it")
    return groups.train


def sum_over_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every training process (accelerate's reduce, on a copy)."""
    if session.num_processes == 1:
        return t
    group = training_group(session)
    if group is None:
        return session.accelerator.reduce(t, reduction="sum")
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


def gather_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """Every training rank's ``t`` (same shape on each), concatenated in rank order (accelerate's gather)."""
    if session.num_processes == 1:
        return t
    group = training_group(session)
    if group is None:
        return session.accelerator.gather(t.contiguous())
    t = t.contiguous() if t.dim() else t[None]  # a scalar from each rank gives a vector, as accelerate's
    parts = [torch.empty_like(t) for _ in range(session.num_processes)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def mean_over_ranks(session: Session, values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over the training processes (one all-reduce)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=session.device)
    return dict(zip(keys, (sum_over_ranks(session, t) / session.num_processes).tolist()))


def gather_objects(session: Session, objects: list) -> list:
    """Every training rank's list of picklable ``objects``, end to end in rank order (accelerate's gather_object)."""
    if session.num_processes == 1:
        return list(objects)
    group = training_group(session)
    if group is None:
        from accelerate.utils import gather_object

        return gather_object(list(objects))
    every: list = [None] * session.num_processes
    dist.all_gather_object(every, list(objects), group=group)
    return [item for part in every for item in part]


def pad_across_ranks(session: Session, t: torch.Tensor, dim: int = 0, pad_index: Any = 0,
                     pad_first: bool = False) -> torch.Tensor:
    """``t`` padded along ``dim`` to the longest of the training ranks' (accelerate's pad_across_processes)."""
    if session.num_processes == 1 or t.dim() == 0:
        return t
    group = training_group(session)
    if group is None:
        return session.accelerator.pad_across_processes(t, dim=dim, pad_index=pad_index, pad_first=pad_first)
    size = torch.tensor([t.shape[dim]], device=t.device)
    longest = int(gather_ranks(session, size).max())
    if longest == t.shape[dim]:
        return t
    shape = list(t.shape)
    shape[dim] = longest
    out = t.new_full(shape, pad_index)
    start = longest - t.shape[dim] if pad_first else 0
    out.narrow(dim, start, t.shape[dim]).copy_(t)
    return out
