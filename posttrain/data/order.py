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
    """One seed from the run's seed and where it is used (a name, the epoch, step, rank, ...): a
    stable hash, the same in every process and every run, so that data order and sampling depend
    only on that position (a resumed run draws what the uninterrupted one drew)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The same permutation on every rank for a given (seed, epoch): TRL's order, i.e. accelerate's
    ``SeedableRandomSampler`` under transformers' Trainer, a generator seeded with seed + epoch."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_batches(n: int, batch_size: int, seed: int, rank: int, world: int, start: int = 0) -> Iterator[list[int]]:
    """Endless per-rank micro-batches of example indices: each global batch of
    ``batch_size * world`` consecutive examples of an epoch's permutation is split by rank, so the
    data seen does not depend on placement and a resumed run continues at micro-batch ``start``."""
    per_epoch = max(1, n // (batch_size * world))
    step = start
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        base = k * batch_size * world + rank * batch_size
        yield order[base : base + batch_size]
        step += 1
