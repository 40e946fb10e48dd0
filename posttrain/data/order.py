"""The order rows are seen in, as TRL 1.16 sees them: seeds, each epoch's permutation, each process's
micro-batches (accelerate's sharding) and each optimizer step's share of them (transformers' Trainer loop)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

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
    """The Trainer's row permutation in ``epoch`` (SFT, DPO, reward, GKD): accelerate's SeedableRandomSampler
    reseeds with ``seed + epoch``, ``seed`` being ``data_seed`` when set, else ``seed``. GRPO: ``repeat_order``."""
    return list(_seeded_perm(n, seed + epoch))


@lru_cache(maxsize=4)
def _seeded_perm(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist())


# Per (n, seed): the RepeatSampler generator's state at each epoch's start, so epoch e costs one draw, not e.
_REPEAT_STATES: dict[tuple[int, int], list[torch.Tensor]] = {}


def repeat_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """TRL's RepeatSampler permutation in ``epoch`` (GRPO, RLOO, distillation): one generator seeded once with
    ``seed`` and drawn once per epoch, so epoch e is the (e+1)-th ``randperm``; ``range(n)`` without shuffle."""
    return list(_repeat_perm(n, seed, epoch)) if shuffle else list(range(n))


@lru_cache(maxsize=4)
def _repeat_perm(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    if len(_REPEAT_STATES) > 16:  # a few datasets per process; bounded so tests' many sizes don't pile up
        _REPEAT_STATES.clear()
    states = _REPEAT_STATES.setdefault((n, seed), [torch.Generator().manual_seed(seed).get_state()])
    g = torch.Generator()
    while len(states) <= epoch:
        g.set_state(states[-1])
        torch.randperm(n, generator=g)
        states.append(g.get_state())
    g.set_state(states[epoch])
    return tuple(torch.randperm(n, generator=g).tolist())


class MicroBatch(NamedTuple):
    """One process's micro-batch: row indices, and which of them accelerate's ``even_batches`` added (rows
    repeated from the start of the epoch's stream so every process gets full batches; TRL trains them too)."""

    rows: list[int]
    filled: list[bool]


@dataclass(frozen=True)
class Schedule:
    """The Trainer's step arithmetic for a loader of ``micro_per_epoch`` micro-batches a process, as
    ``set_initial_training_values`` and ``_run_epoch``: an epoch's last step takes what is left of it."""

    micro_per_epoch: int  # len(train_dataloader) on a process: transformers' steps_in_epoch
    gradient_accumulation_steps: int
    steps_per_epoch: int  # num_update_steps_per_epoch
    max_steps: int  # optimizer steps the run takes
    num_train_epochs: int  # epochs the loop enters

    def micro_batches(self, step: int) -> range:
        """Global micro-batch indices (``epoch * micro_per_epoch + i``) of optimizer step ``step`` (1-based)."""
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        first = k * self.gradient_accumulation_steps
        last = min(first + self.gradient_accumulation_steps, self.micro_per_epoch)
        base = epoch * self.micro_per_epoch
        return range(base + first, base + last)

    def epoch(self, step: int) -> float:
        """The ``epoch`` TRL logs after optimizer step ``step``: ``epoch + micro-batches done / steps_in_epoch``."""
        last = self.micro_batches(step)[-1] + 1
        epoch = (last - 1) // self.micro_per_epoch
        # The same expression as transformers', so the float is equal to the last bit.
        return epoch + (last - epoch * self.micro_per_epoch) / self.micro_per_epoch


def trainer_schedule(micro_per_epoch: int, gradient_accumulation_steps: int, num_train_epochs: float = 3.0,
                     max_steps: int = -1) -> Schedule:
    """transformers' ``set_initial_training_values`` for a loader of ``micro_per_epoch`` batches a process."""
    if micro_per_epoch < 1:
        raise ValueError("the training loader is empty: TRL's Trainer would stop before its first step")
    ga = gradient_accumulation_steps
    steps_per_epoch = max(micro_per_epoch // ga + int(micro_per_epoch % ga > 0), 1)
    if max_steps > 0:
        epochs = max_steps // steps_per_epoch + int(max_steps % steps_per_epoch > 0)
    else:
        max_steps = math.ceil(num_train_epochs * steps_per_epoch)
        epochs = math.ceil(num_train_epochs)
    return Schedule(micro_per_epoch, ga, steps_per_epoch, max_steps, epochs)


class Step(NamedTuple):
    """One optimizer step on one process: its number (1-based), the epoch TRL logs after it, its global
    micro-batch indices and those micro-batches (fewer than gradient_accumulation_steps at an epoch's end)."""

    step: int
    epoch: float
    micro: range
    batches: list[MicroBatch]


@dataclass(frozen=True)
class TrainLoader:
    """TRL's training DataLoader as index arithmetic: the sampler's stream of rows each epoch, cut into
    ``batch_size`` batches (drop_last=False) and dealt to ``world`` processes as accelerate's BatchSamplerShard
    (split_batches=False, even_batches=True); one process keeps a short last batch, several get full ones."""

    n: int  # dataset rows
    batch_size: int  # the DataLoader's batch size on a process
    world: int
    seed: int
    repeat: bool = False  # TRL's RepeatSampler (GRPO, RLOO, distillation) instead of the Trainer's RandomSampler
    mini_repeat_count: int = 1
    prompts_per_batch: int = 1  # RepeatSampler's batch_size: unique rows per repeated chunk
    repeat_count: int = 1
    shuffle: bool = True

    @classmethod
    def rows(cls, n: int, per_device_batch: int, world: int, seed: int, shuffle: bool = True) -> TrainLoader:
        """The Trainer's loader (SFT, DPO, reward, GKD, KTO); ``seed`` is ``data_seed`` when set, else ``seed``;
        ``shuffle`` False: the dataset's order (KTO's ``train_sampling_strategy: sequential``)."""
        return cls(n, per_device_batch, world, seed, shuffle=shuffle)

    @classmethod
    def grpo(cls, n: int, per_device_batch: int, world: int, seed: int, num_generations: int,
             steps_per_generation: int, num_iterations: int = 1, shuffle: bool = True) -> TrainLoader:
        """GRPOTrainer's / RLOOTrainer's loader: generation batches of ``per_device_batch * world *
        steps_per_generation`` rows, each prompt ``num_generations`` times, each batch yielded
        ``num_iterations * steps_per_generation`` times (``seed`` is ``seed``; TRL ignores ``data_seed`` here)."""
        generation_batch = per_device_batch * world * steps_per_generation
        if generation_batch % num_generations:
            raise ValueError(f"generation batch {generation_batch} is not a multiple of num_generations "
                             f"{num_generations}")
        return cls(n, per_device_batch * steps_per_generation, world, seed, True, num_generations,
                   generation_batch // num_generations, num_iterations * steps_per_generation, shuffle)

    @classmethod
    def distillation(cls, n: int, per_device_batch: int, world: int, seed: int, gradient_accumulation_steps: int,
                     shuffle: bool = True) -> TrainLoader:
        """TRL's DistillationTrainer's loader: a generation batch per optimizer step, yielded each micro-step."""
        ga = gradient_accumulation_steps
        return cls(n, per_device_batch * ga, world, seed, True, 1, per_device_batch * world * ga, ga, shuffle)

    @property
    def epoch_rows(self) -> int:
        """Length of the sampler's stream in one epoch (RepeatSampler drops the last incomplete chunk)."""
        if not self.repeat:
            return self.n
        chunks = self.n // self.prompts_per_batch
        return chunks * self.prompts_per_batch * self.mini_repeat_count * self.repeat_count

    def __len__(self) -> int:
        """Micro-batches a process gets each epoch: ``len(train_dataloader)``."""
        return math.ceil(self.epoch_rows / (self.batch_size * self.world))

    def order(self, epoch: int) -> list[int]:
        """The sampler's permutation of the rows in ``epoch``."""
        if self.repeat:
            return repeat_order(self.n, self.seed, epoch, self.shuffle)
        return epoch_order(self.n, self.seed, epoch) if self.shuffle else list(range(self.n))

    def _order(self, epoch: int) -> tuple[int, ...] | range:
        if not self.repeat:  # shuffle False: transformers' SequentialSampler (KTO's default)
            return _seeded_perm(self.n, self.seed + epoch) if self.shuffle else range(self.n)
        return _repeat_perm(self.n, self.seed, epoch) if self.shuffle else range(self.n)

    def _row(self, order: tuple[int, ...] | range, p: int) -> int:
        """Row at position ``p`` of an epoch's stream."""
        if not self.repeat:
            return order[p]
        chunk = self.prompts_per_batch * self.mini_repeat_count
        c, q = divmod(p, chunk * self.repeat_count)
        return order[c * self.prompts_per_batch + (q % chunk) // self.mini_repeat_count]

    def micro_batch(self, epoch: int, k: int, rank: int) -> MicroBatch:
        """Process ``rank``'s ``k``-th micro-batch of ``epoch``: the stream's batch ``k * world + rank``."""
        if not 0 <= k < len(self):
            raise ValueError(f"micro-batch {k} is outside the epoch's {len(self)}")
        size, order = self.epoch_rows, self._order(epoch)
        start = (k * self.world + rank) * self.batch_size
        end = min(start + self.batch_size, size) if self.world == 1 else start + self.batch_size
        # even_batches refills from the epoch's first world batches, cycled when the epoch is shorter.
        cycle = min(size, self.world * self.batch_size)
        rows = [self._row(order, p if p < size else (p - size) % cycle) for p in range(start, end)]
        return MicroBatch(rows, [p >= size for p in range(start, end)])

    def epoch_batches(self, epoch: int, rank: int) -> list[MicroBatch]:
        """Process ``rank``'s micro-batches of ``epoch``, in order."""
        return [self.micro_batch(epoch, k, rank) for k in range(len(self))]

    def schedule(self, gradient_accumulation_steps: int, num_train_epochs: float = 3.0,
                 max_steps: int = -1) -> Schedule:
        """The Trainer's step counts over this loader."""
        return trainer_schedule(len(self), gradient_accumulation_steps, num_train_epochs, max_steps)

    def steps(self, schedule: Schedule, rank: int, start_step: int = 0) -> Iterator[Step]:
        """Process ``rank``'s optimizer steps after ``start_step`` done, to ``schedule.max_steps``."""
        for step in range(start_step + 1, schedule.max_steps + 1):
            micro = schedule.micro_batches(step)
            batches = [self.micro_batch(*divmod(g, len(self)), rank) for g in micro]
            yield Step(step, schedule.epoch(step), micro, batches)

    def generation_prompts(self, cycle: int) -> list[int]:
        """Unique rows of generation batch ``cycle`` (a RepeatSampler chunk), counted across epochs: global
        micro-batch g belongs to batch ``g // repeat_count`` (steps_per_generation * num_iterations in GRPO)."""
        if not self.repeat:
            raise ValueError("generation batches belong to a RepeatSampler loader")
        per_epoch = self.n // self.prompts_per_batch
        if per_epoch < 1:
            raise ValueError(f"a generation batch needs {self.prompts_per_batch} rows and the dataset has {self.n}")
        epoch, c = divmod(cycle, per_epoch)
        return list(self._order(epoch)[c * self.prompts_per_batch : (c + 1) * self.prompts_per_batch])

    def generation_rows(self, cycle: int, rank: int) -> list[int]:
        """Process ``rank``'s rows of generation batch ``cycle``: each prompt ``mini_repeat_count`` times, the
        process's ``batch_size`` slice (what TRL's loader hands it for each of the batch's micro-steps)."""
        if self.prompts_per_batch * self.mini_repeat_count != self.batch_size * self.world:
            raise ValueError("a generation batch must fill one batch on every process (use grpo/distillation)")
        expanded = [i for i in self.generation_prompts(cycle) for _ in range(self.mini_repeat_count)]
        return expanded[rank * self.batch_size : (rank + 1) * self.batch_size]


def trainer_steps(n: int, per_device_batch: int, world: int, gradient_accumulation_steps: int,
                  num_train_epochs: float = 3.0, max_steps: int = -1) -> int:
    """Optimizer steps TRL's Trainer (SFT, DPO, reward) runs over ``n`` rows, short last steps included."""
    return TrainLoader.rows(n, per_device_batch, world, 0).schedule(gradient_accumulation_steps, num_train_epochs,
                                                                    max_steps).max_steps


def rank_batches(n: int, batch_size: int, seed: int, rank: int, world: int, start: int = 0) -> Iterator[list[int]]:
    """Legacy, until the trainers use ``TrainLoader``: endless per-rank micro-batches in ``epoch_order``, each
    epoch's rows past its last full global batch dropped (unlike TRL), from micro-batch ``start``."""
    per_epoch = max(1, n // (batch_size * world))
    step = start
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        base = k * batch_size * world + rank * batch_size
        yield order[base : base + batch_size]
        step += 1
