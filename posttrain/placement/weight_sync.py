"""Weight sync for separate generation ranks: the trained policy's parameters, from the training ranks to the
generation ranks' copy, in buckets of bounded size; a building block of the layout (placement.generation_ranks).

Both sides build one plan from one spec (names, shapes, dtypes of the trained module, in its order): buckets of
consecutive parameters up to ``bucket_bytes`` (a parameter larger than that is a bucket of its own). Per bucket,
under ZeRO-3 the training ranks gather that bucket's parameters together (``deepspeed.zero.GatheredParameters``);
training rank 0 packs them into one byte buffer and broadcasts it over the ``sync`` group (training rank 0 and the
generation ranks; NCCL on GPU, gloo on CPU); each generation rank copies every slice into its own parameter in place,
so whatever reads their addresses (the decode engine's CUDA graphs) sees the new weights. No rank ever holds more
than one bucket gathered. Under ZeRO-2 (or no DeepSpeed) training rank 0 holds whole parameters and sends alone.

By default only the parameters that train move (``requires_grad``): all of them in full fine-tuning, the adapters
with LoRA (the generation copy holds the base); ``include_frozen`` sends every parameter (a first sync)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.placement.generation_ranks import LayoutGroups

DEFAULT_BUCKET_BYTES = 128 << 20
ENDED = -1  # the version ``receive`` returns once the training ranks ended the syncs (WeightSender.end)
_ALIGN = 16  # every slice starts on a 16-byte boundary, so a byte view reinterprets as any dtype


@dataclass(frozen=True)
class Entry:
    """One parameter of the spec: its name in the trained module, whole shape, dtype, and whether it trains."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trained: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class SyncRecord:
    """One sync as this rank saw it: the version, each broadcast's (bytes, parameters), the time it took."""

    version: int
    messages: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def params(self) -> int:
        return sum(n for _, n in self.messages)

    @property
    def largest_message(self) -> int:
        return max((b for b, _ in self.messages), default=0)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(entries: list[Entry], bucket_bytes: int) -> list[list[tuple[Entry, int]]]:
    """Consecutive entries grouped up to ``bucket_bytes`` (aligned sizes); each with its byte offset in the bucket.
    An entry larger than ``bucket_bytes`` is a bucket of its own."""
    buckets: list[list[tuple[Entry, int]]] = []
    current: list[tuple[Entry, int]] = []
    used = 0
    for e in entries:
        size = _aligned(e.nbytes)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append((e, used))
        used += size
    if current:
        buckets.append(current)
    return buckets


def bucket_nbytes(bucket: list[tuple[Entry, int]]) -> int:
    entry, offset = bucket[-1]
    return offset + entry.nbytes


def _spec(module: nn.Module) -> tuple[list[Entry], dict[str, nn.Parameter]]:
    params = dict(module.named_parameters())  # tied parameters once, under their first name
    entries = [Entry(n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype, p.requires_grad) for n, p in params.items()]
    return entries, params


class _Plans:
    def __init__(self, entries: list[Entry], bucket_bytes: int) -> None:
        self.entries = entries
        self.bucket_bytes = bucket_bytes
        self.by_mode = {frozen_too: plan_buckets([e for e in entries if frozen_too or e.trained], bucket_bytes)
                        for frozen_too in (False, True)}
        self.buffer_bytes = max((bucket_nbytes(b) for plan in self.by_mode.values() for b in plan), default=0)


class WeightSender:
    """The training side. Build it on every training rank at once with a :class:`WeightReceiver` on every generation
    rank (training rank 0 sends them the spec), from the trained role's module on this rank
    (``session.unwrap("policy")``: a DeepSpeed engine's module, ZeRO-2 or ZeRO-3, or a plain one).

    ``send(version)`` is collective over the training ranks (ZeRO-3 gathers bucket by bucket) and the generation ranks'
    ``receive``; call it after an optimizer step, every ``weight_sync_steps`` steps (:meth:`due`)."""

    def __init__(self, groups: LayoutGroups, module: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 weight_sync_steps: int = 1) -> None:
        if groups.generates:
            raise RuntimeError("WeightSender runs on the training ranks; a generation rank builds a WeightReceiver")
        if bucket_bytes < _ALIGN or weight_sync_steps < 1:
            raise ValueError(f"bucket_bytes must be >= {_ALIGN} and weight_sync_steps >= 1, got {bucket_bytes} and "
                             f"{weight_sync_steps}")
        self.groups = groups
        self.weight_sync_steps = weight_sync_steps
        entries, self.params = _spec(module)
        self.plans = _Plans(entries, bucket_bytes)
        self.sharded = any(hasattr(p, "ds_id") for p in self.params.values())
        self.device = groups.device
        self.sends = groups.rank == 0  # training rank 0 is the one training member of the sync group
        self._buffer: torch.Tensor | None = None
        self.version: int | None = None
        self.last: SyncRecord | None = None
        if self.sends:
            dist.broadcast_object_list([(entries, bucket_bytes)], src=0, group=groups.sync, device=self.device)

    def due(self, step: int) -> bool:
        """Whether the weights after optimizer step ``step`` (1, 2, ...) go to the generation ranks."""
        return step % self.weight_sync_steps == 0

    @torch.no_grad()
    def send(self, version: int, include_frozen: bool = False) -> SyncRecord:
        """Send the trained module's current parameters as ``version`` (the generation ranks record it with every
        group they sample after it); ``include_frozen``: every parameter, not only those that train."""
        start = time.perf_counter()
        record = SyncRecord(version)
        if self.sends:
            header = torch.tensor([version, int(include_frozen)], dtype=torch.int64, device=self.device)
            dist.broadcast(header, src=0, group=self.groups.sync)
        if self.sends or self.sharded:
            for bucket in self.plans.by_mode[include_frozen]:
                params = [self.params[e.name] for e, _ in bucket]
                with self._gathered(params):
                    if self.sends:
                        record.messages.append((self._broadcast(bucket, params), len(bucket)))
        record.seconds = time.perf_counter() - start
        self.version, self.last = version, record
        return record

    def end(self) -> None:
        """Tell the generation ranks that no sync follows (their ``receive`` returns :data:`ENDED`). Training ranks."""
        if self.sends:
            header = torch.tensor([ENDED, 0], dtype=torch.int64, device=self.device)
            dist.broadcast(header, src=0, group=self.groups.sync)

    def _gathered(self, params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
        if not self.sharded:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def _broadcast(self, bucket: list[tuple[Entry, int]], params: list[nn.Parameter]) -> int:
        if self._buffer is None:
            self._buffer = torch.empty(self.plans.buffer_bytes, dtype=torch.uint8, device=self.device)
        nbytes = bucket_nbytes(bucket)
        for (entry, offset), p in zip(bucket, params):
            src = p.data.detach().contiguous().view(-1).view(torch.uint8)
            self._buffer[offset: offset + entry.nbytes].copy_(src)
        dist.broadcast(self._buffer[:nbytes], src=0, group=self.groups.sync)
        return nbytes


class WeightReceiver:
    """The generation side: ``module`` is this rank's copy of the trained role (``session.load`` on a generation rank,
    with the same adapters under LoRA). Build it while the training ranks build their :class:`WeightSender`.

    ``receive()`` waits for the next sync and copies it into ``module`` in place; ``ready()`` tells without waiting
    whether one has begun (the decode loop can poll it between steps). ``version`` is the last version received;
    ``ended`` whether the training ranks sent :meth:`WeightSender.end`. Whatever the engine derives from the weights
    (fused q|k|v copies, merged LoRA buffers) it refreshes as after an optimizer step."""

    def __init__(self, groups: LayoutGroups, module: nn.Module) -> None:
        if not groups.generates:
            raise RuntimeError("WeightReceiver runs on the generation ranks; a training rank builds a WeightSender")
        self.groups = groups
        self.device = groups.device
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=0, group=groups.sync, device=self.device)
        entries, bucket_bytes = got[0]
        own = dict(module.named_parameters())
        missing = [e.name for e in entries if e.name not in own]
        wrong = [f"{e.name} {tuple(own[e.name].shape)} here, {e.shape} trained" for e in entries
                 if e.name in own and tuple(own[e.name].shape) != e.shape]
        if missing or wrong:
            raise RuntimeError(f"the generation copy does not match the trained model: missing {missing[:3]}, "
                               f"shapes differ {wrong[:3]}; load the same model (and the same adapters) on both sides")
        self.params = {e.name: own[e.name] for e in entries}
        self.plans = _Plans(entries, bucket_bytes)
        self._buffer: torch.Tensor | None = None
        self._header: torch.Tensor | None = None
        self._work: Any = None
        self.version: int | None = None
        self.last: SyncRecord | None = None
        self.ended = False

    def _post(self) -> None:
        if self._work is None:
            self._header = torch.empty(2, dtype=torch.int64, device=self.device)
            self._work = dist.broadcast(self._header, src=0, group=self.groups.sync, async_op=True)

    def ready(self) -> bool:
        """Whether the next sync has begun (its header arrived); never waits."""
        self._post()
        return self._work.is_completed()

    @torch.no_grad()
    def receive(self) -> int:
        """Wait for the next sync, copy every parameter it carries into place; its version (:data:`ENDED`, moving
        nothing, once the training ranks called ``end``). Between decode steps: the copies run on the current stream."""
        start = time.perf_counter()
        self._post()
        self._work.wait()
        version, frozen_too = (int(v) for v in self._header.tolist())
        self._work = None
        if version == ENDED:
            self.ended = True
            return ENDED
        record = SyncRecord(version)
        if self._buffer is None:
            self._buffer = torch.empty(self.plans.buffer_bytes, dtype=torch.uint8, device=self.device)
        for bucket in self.plans.by_mode[bool(frozen_too)]:
            nbytes = bucket_nbytes(bucket)
            dist.broadcast(self._buffer[:nbytes], src=0, group=self.groups.sync)
            for entry, offset in bucket:
                src = self._buffer[offset: offset + entry.nbytes].view(entry.dtype).view(entry.shape)
                self.params[entry.name].data.copy_(src)
            record.messages.append((nbytes, len(bucket)))
        record.seconds = time.perf_counter() - start
        self.version, self.last = version, record
        return version
