"""The order rows are seen in: seeds, each epoch's permutation, and each rank's share of a batch."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (when installed) numpy's global generators, as transformers' ``set_seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def mix_seed(*parts: int | str) -> int:
    """A stable seed from the run's seed and where it is used (name, epoch, step, rank...)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The permutation for (seed, epoch), the same on every rank: TRL's, seeded with seed + epoch."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_batches(n: int, batch_size: int, seed: int, rank: int, world: int, start: int = 0) -> Iterator[list[int]]:
    """Endless per-rank micro-batches of indices (global batches split by rank), from ``start``."""
    per_epoch = max(1, n // (batch_size * world))
    step = start
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        base = k * batch_size * world + rank * batch_size
        yield order[base : base + batch_size]
        step += 1
