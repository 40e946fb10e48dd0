"""The rollout channel of separate generation ranks: completed groups from the generation ranks to the training
ranks; a building block of the layout (placement.generation_ranks).

A group's ``index`` (its place in the run's order of prompt groups) alone decides where it goes: generation rank
``index % G`` produces it and training rank ``index % T`` receives it (G generation ranks, T training ranks). Each
sender sends its groups in increasing index, holding one that completes early until the ones before it are sent,
and each receiver takes its groups in increasing index: a re-run gives every training rank the same rows in the same
order whatever the timing, and as every receiver waits for the smallest index not yet delivered, no pair waits on
the other (no deadlock). Messages are point-to-point on the layout's ``channel`` group (NCCL on GPU, gloo on CPU):
a header (index, version, sizes) and one byte buffer (a JSON list of the tensors, then their bytes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from posttrain.placement.generation_ranks import LayoutGroups, RankLayout

_ALIGN = 16
_HEADER = 4  # index, version, meta bytes, body bytes


@dataclass
class RolloutGroup:
    """One prompt's completed group as it travels: ``index`` in the run's order of groups, ``version`` of the weights
    that sampled it (placement.weight_sync), the rows' token ids, completion mask, the sampler's per-token
    log-probs, and any other tensors (``extras``: per-token weight versions of a partial rollout, rewards...)."""

    index: int
    version: int
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logps: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids,
                "completion_mask": self.completion_mask, "sampling_logps": self.sampling_logps, **self.extras}


_FIELDS = ("prompt_ids", "completion_ids", "completion_mask", "sampling_logps")


def producer(layout: RankLayout, index: int) -> int:
    """The global rank of the generation rank that produces group ``index``."""
    return layout.training_processes + index % layout.generation_processes


def consumer(layout: RankLayout, index: int) -> int:
    """The global rank of the training rank that receives group ``index``."""
    return index % layout.training_processes


def _first(start: int, residue: int, step: int) -> int:
    """The smallest index >= ``start`` that is ``residue`` modulo ``step``."""
    return start + (residue - start) % step


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(group: RolloutGroup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) of ``group``: the body a JSON list of (name, dtype, shape, offset), then each tensor's bytes."""
    tensors = {k: v.detach().contiguous() for k, v in group.tensors().items()}
    specs, offset = [], 0
    for name, t in tensors.items():
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += _aligned(t.numel() * t.element_size())
    meta = json.dumps(specs).encode()
    start = _aligned(len(meta))
    body = torch.zeros(start + offset, dtype=torch.uint8, device=device)
    body[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    for (_, _, _, at), t in zip(specs, tensors.values()):
        data = t.reshape(-1).view(torch.uint8)
        body[start + at: start + at + data.numel()].copy_(data)
    header = torch.tensor([group.index, group.version, len(meta), body.numel()], dtype=torch.int64, device=device)
    return header, body


def unpack(header: torch.Tensor, body: torch.Tensor) -> RolloutGroup:
    """The group ``pack`` made (its tensors views of ``body``)."""
    index, version, meta_len, _ = (int(v) for v in header.tolist())
    specs = json.loads(body[:meta_len].cpu().numpy().tobytes().decode())
    start = _aligned(meta_len)
    tensors = {}
    for name, dtype, shape, at in specs:
        dt = getattr(torch, dtype)
        n = 1
        for d in shape:
            n *= d
        tensors[name] = body[start + at: start + at + n * dt.itemsize].view(dt).view(shape)
    return RolloutGroup(index, version, *(tensors.pop(k) for k in _FIELDS), extras=tensors)


class GroupSender:
    """A generation rank's end of the channel. ``put`` a group as soon as it completes: it leaves at once if every
    earlier group of this rank has left, else when they have; sends do not wait for the receiver (``wait`` does).
    ``start``: the first group index of the run (on resume, the first not yet trained), the same on every rank."""

    def __init__(self, groups: LayoutGroups, start: int = 0) -> None:
        if not groups.generates:
            raise RuntimeError("GroupSender runs on a generation rank; a training rank builds a GroupReceiver")
        self.groups, self.layout = groups, groups.layout
        self.device = groups.device
        self.step = self.layout.generation_processes
        self.next = _first(start, groups.rank - self.layout.training_processes, self.step)
        self.held: dict[int, RolloutGroup] = {}
        self._inflight: list[tuple[list[Any], tuple[torch.Tensor, torch.Tensor]]] = []
        self.sent: list[int] = []

    def put(self, group: RolloutGroup) -> list[int]:
        """Hand over a completed group; the indices that left now (none while an earlier one is not complete)."""
        if producer(self.layout, group.index) != self.groups.rank:
            raise ValueError(f"group {group.index} is produced by rank {producer(self.layout, group.index)}, not "
                             f"by rank {self.groups.rank} (generation rank index % generation_processes)")
        if group.index < self.next or group.index in self.held:
            raise ValueError(f"group {group.index} was already handed over")
        self.held[group.index] = group
        left = []
        while self.next in self.held:
            self._send(self.held.pop(self.next))
            left.append(self.next)
            self.next += self.step
        self.sent += left
        self.poll()
        return left

    def _send(self, group: RolloutGroup) -> None:
        header, body = pack(group, self.device)
        dst = consumer(self.layout, group.index)
        works = [dist.isend(header, dst=dst, group=self.groups.channel),
                 dist.isend(body, dst=dst, group=self.groups.channel)]
        self._inflight.append((works, (header, body)))  # the tensors live until their sends complete

    def poll(self) -> int:
        """Forget the sends that completed; how many groups are still on their way."""
        self._inflight = [(w, t) for w, t in self._inflight if not all(x.is_completed() for x in w)]
        return len(self._inflight)

    def wait(self) -> None:
        """Wait until every group sent so far was received."""
        for works, _ in self._inflight:
            for w in works:
                w.wait()
        self._inflight = []


class GroupReceiver:
    """A training rank's end of the channel: ``receive()`` gives this rank's groups one by one, in increasing index
    (``start``, the same on every rank as the senders', then every ``training_processes``-th)."""

    def __init__(self, groups: LayoutGroups, start: int = 0) -> None:
        if groups.generates:
            raise RuntimeError("GroupReceiver runs on a training rank; a generation rank builds a GroupSender")
        self.groups, self.layout = groups, groups.layout
        self.device = groups.device
        self.step = self.layout.training_processes
        self.next = _first(start, groups.rank, self.step)
        self._header: torch.Tensor | None = None
        self._work: Any = None

    def _post(self) -> None:
        if self._work is None:
            self._header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._work = dist.irecv(self._header, src=producer(self.layout, self.next), group=self.groups.channel)

    def ready(self) -> bool:
        """Whether this rank's next group has begun to arrive; never waits."""
        self._post()
        return self._work.is_completed()

    def receive(self) -> RolloutGroup:
        """This rank's next group (waits for it)."""
        self._post()
        self._work.wait()
        header, self._work = self._header, None
        if int(header[0]) != self.next:
            raise RuntimeError(f"the channel delivered group {int(header[0])} where group {self.next} was due")
        body = torch.empty(int(header[3]), dtype=torch.uint8, device=self.device)
        dist.recv(body, src=producer(self.layout, self.next), group=self.groups.channel)
        self.next += self.step
        return unpack(header, body)
