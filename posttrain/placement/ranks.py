"""Reductions over the processes of a run (accelerate's reduce and gather), and the world size
before the process group exists."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posttrain.placement.session import Session


def world_size() -> int:
    """The number of processes, from the launcher's environment (before the process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def sum_over_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every process (accelerate's reduce, on a copy)."""
    return session.accelerator.reduce(t, reduction="sum") if session.num_processes > 1 else t


def gather_ranks(session: Session, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape on each), concatenated in rank order (accelerate's gather)."""
    return session.accelerator.gather(t.contiguous()) if session.num_processes > 1 else t


def mean_over_ranks(session: Session, values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over processes (one all-reduce)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=session.device)
    return dict(zip(keys, (sum_over_ranks(session, t) / session.num_processes).tolist()))
