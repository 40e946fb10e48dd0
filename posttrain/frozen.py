"""A fast forward for frozen ZeRO-3 models: one all-gather per layer, prefetched, into flat buffers.

DeepSpeed's ZeRO-3 engine gathers parameters through per-module hooks, a parameter coordinator and
one partition per parameter; for a frozen model in inference that bookkeeping, not the
communication, dominates (shared/knowledge/multi-plugin-facts.md: 95-138 ms per 1.1B forward,
against 4.1 ms to all-gather the whole model once). A frozen model needs none of its generality:
no gradients, no optimizer state, the same modules in the same order on every forward.

:func:`take_over` keeps the engine the user prepared (a per-role ZeRO-3 plugin, parameters
partitioned by zero.Init) and replaces how its parameters are stored and gathered:

- parameters are grouped into *units*: each decoder layer (a child of a ``ModuleList``), and each
  other module that owns parameters directly (embeddings, final norm, head);
- a group's parameters are laid out as one flat vector, padded to a multiple of the world size and
  split evenly: each rank keeps only its 1/N slice at rest. DeepSpeed's own per-parameter
  partitions are freed, so memory is not doubled;
- before a unit runs, ONE ``all_gather_into_tensor`` rebuilds its full flat vector and the
  parameters become views into it; after the unit runs the buffer is dropped;
- while unit i computes, the gathers of the units expected next (recorded on the previous forward)
  are already in flight, as many as add up to one decoder layer's size (so the final norm and the
  head are fetched during the last layer, not after it): an async collective runs on the
  communication library's own stream (NCCL), and ``wait()`` orders the compute stream after it,
  so no extra stream or events are needed; on CPU (gloo) the same calls are simply synchronous.
- each parameter starts at a 128-byte boundary of the flat vector: views into it keep the
  alignment that vectorised kernels and cuBLAS's fastest paths need.

Hooks on the modules drive it, so ``engine(**batch)`` and ``engine.module.generate(...)`` work as
before. A tied parameter (``lm_head.weight is embed_tokens.weight``) is stored once, in the group
of the first unit that owns it; any other unit that uses it gathers that group too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_ALIGN_BYTES = 128


class _Group:
    """Parameters stored as one flat vector, 1/N of it per rank."""

    def __init__(self, params: list[nn.Parameter], process_group: Any) -> None:
        self.params = params
        self.pg = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.shapes = [tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape) for p in params]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        align = max(1, _ALIGN_BYTES // params[0].element_size())
        self.offsets, end = [], 0
        for n in self.numels:
            self.offsets.append(end)
            end += -(-n // align) * align
        self.numel = sum(self.numels)  # the parameters' elements (without alignment padding)
        self.shard_numel = -(-end // self.world)  # ceil: the last rank's slice is padded
        self.nbytes = self.shard_numel * self.world * params[0].element_size()
        self.shard: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self.work: Any = None  # an in-flight async all-gather into ``full``
        self.users = 0  # units running that need this group (nested or re-entrant use)
        self.empty: torch.Tensor | None = None

    def build_shard(self) -> None:
        """Cut this rank's slice of the flat vector out of the (gathered) parameters."""
        import deepspeed

        zero = [p for p in self.params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(zero, modifier_rank=None):
            first = self.params[0].data
            flat = first.new_zeros(self.shard_numel * self.world)
            for p, offset, n in zip(self.params, self.offsets, self.numels):
                flat[offset: offset + n].copy_(p.data.reshape(-1))
            self.shard = flat[self.rank * self.shard_numel: (self.rank + 1) * self.shard_numel].clone()
            del flat
        self.empty = self.shard.new_empty(0)
        for p in self.params:
            p.data = self.empty
            if hasattr(p, "ds_tensor"):
                # DeepSpeed's partition of this parameter is not used again: free it, so the
                # model is stored once. DeepSpeed gathers of it now fail loudly instead of
                # returning stale values.
                p.ds_tensor.data = self.empty

    def start(self) -> None:
        """Begin gathering the full flat vector, unless it is gathered or in flight."""
        if self.full is None:
            self.full = self.shard.new_empty(self.shard_numel * self.world)
            self.work = dist.all_gather_into_tensor(self.full, self.shard, group=self.pg, async_op=True)

    def acquire(self) -> None:
        """Make the parameters views into the full vector (waiting for its gather)."""
        self.start()
        if self.work is not None:
            self.work.wait()  # on CUDA: the compute stream waits for NCCL's, the CPU does not
            self.work = None
        if self.users == 0:
            for p, shape, offset, n in zip(self.params, self.shapes, self.offsets, self.numels):
                p.data = self.full[offset: offset + n].view(shape)
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.drop()

    def drop(self) -> None:
        """Back to rest: only the local slice is kept."""
        if self.full is None:
            return
        if self.work is not None:
            self.work.wait()
            self.work = None
        for p in self.params:
            p.data = self.empty
        self.full = None
        self.users = 0


@dataclass
class _Unit:
    module: nn.Module
    is_layer: bool
    groups: list[_Group] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def _units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter], bool]]:
    """(module, parameters it uses, is a layer) for each decoder layer and each other parameter
    owner, in registration order. Stops at a ModuleList's children: a layer is one unit."""
    out: list[tuple[nn.Module, list[nn.Parameter], bool]] = []

    def walk(module: nn.Module, whole: bool) -> None:
        if whole:
            params = list(module.parameters())
            if params:
                out.append((module, params, True))
            return
        own = [p for p in module._parameters.values() if p is not None]
        if own:
            out.append((module, own, False))
        layer_list = isinstance(module, nn.ModuleList)
        for child in module.children():
            walk(child, whole=layer_list)

    walk(model, whole=False)
    return out


class FastFrozen:
    """Owns a frozen model's flat shards and the hooks that gather them layer by layer."""

    def __init__(self, model: nn.Module, process_group: Any = None) -> None:
        self.model = model
        self.units: list[_Unit] = []
        self.groups: list[_Group] = []
        owner: dict[int, _Group] = {}
        for module, params, is_layer in _units(model):
            fresh = [p for p in params if id(p) not in owner]
            unit = _Unit(module, is_layer)
            # One flat vector per dtype (zero.Init casts floats to one dtype, so usually one).
            for dtype in dict.fromkeys(p.dtype for p in fresh):
                same = [p for p in fresh if p.dtype == dtype]
                group = _Group(same, process_group or getattr(same[0], "ds_process_group", None))
                self.groups.append(group)
                owner.update({id(p): group for p in same})
            # The unit's own group first, then those of parameters it shares (tied weights).
            for p in params:
                if owner[id(p)] not in unit.groups:
                    unit.groups.append(owner[id(p)])
            self.units.append(unit)
        for group in self.groups:
            group.build_shard()
        # Gathers kept in flight ahead of the running unit: about one decoder layer's bytes.
        layers = [u.nbytes for u in self.units if u.is_layer] or [u.nbytes for u in self.units]
        self.lookahead_bytes = max(layers)
        # The order units ran in on the last complete forward: what to prefetch next.
        self.trace: list[int] = []
        self._current: list[int] = []
        self._on_trace = False
        self._handles = [model.register_forward_pre_hook(self._begin), model.register_forward_hook(self._end)]
        for i, unit in enumerate(self.units):
            self._handles.append(unit.module.register_forward_pre_hook(self._pre(i)))
            self._handles.append(unit.module.register_forward_hook(self._post(i)))

    # -- hooks -------------------------------------------------------------------------------
    def _begin(self, module: nn.Module, args: Any) -> None:
        self._rest()  # a forward that raised may have left buffers gathered
        self._current, self._on_trace = [], bool(self.trace)

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.trace = self._current
        self._rest()  # a prefetch that the forward did not use

    def _pre(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            pos = len(self._current)
            self._current.append(i)
            # Follow last forward's order while this one repeats it; prefetch the unit after.
            self._on_trace = self._on_trace and pos < len(self.trace) and self.trace[pos] == i
            for group in self.units[i].groups:
                group.acquire()
            if self._on_trace:
                self._prefetch(pos + 1)
        return hook

    def _prefetch(self, pos: int) -> None:
        """Start the gathers of the units at trace positions ``pos``, ``pos + 1``, ... until the
        bytes ahead of the running unit reach :attr:`lookahead_bytes` (at least one unit)."""
        ahead = 0
        while pos < len(self.trace) and ahead < self.lookahead_bytes:
            for group in self.units[self.trace[pos]].groups:
                if group.users == 0:  # not the running unit's own (a tied weight used twice)
                    group.start()
                    ahead += group.nbytes
            pos += 1

    def _post(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for group in self.units[i].groups:
                group.release()
        return hook

    def _rest(self) -> None:
        for group in self.groups:
            group.drop()

    # -- inspection and full weights ---------------------------------------------------------
    def local_numel(self) -> int:
        """Elements this rank stores at rest (its slices, padding included)."""
        return sum(g.shard.numel() for g in self.groups)

    def full_numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """Every parameter whole for the duration (collective: all ranks must enter)."""
        for group in self.groups:
            group.acquire()
        try:
            yield self.model
        finally:
            self._rest()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def take_over(engine: Any) -> FastFrozen:
    """Replace a prepared inference-only ZeRO-3 engine's gathering with :class:`FastFrozen`.

    The engine stays the object the user holds; its module's forward hooks become ours.
    """
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    offload = getattr(engine, "optimizer", None)
    if not isinstance(offload, DeepSpeedZeRoOffload):
        raise TypeError("fast_frozen needs a frozen ZeRO-3 engine prepared without an optimizer")
    model = engine.module
    # Remove DeepSpeed's per-module hooks and the engine's forward prologue/epilogue, which
    # re-arm DeepSpeed's gather-on-attribute-access.
    offload.destroy()
    for handle in ("module_forward_pre_hook", "module_forward_post_hook"):
        if getattr(engine, handle, None) is not None:
            getattr(engine, handle).remove()
            setattr(engine, handle, None)
    fast = FastFrozen(model)
    for module in model.modules():
        # DeepSpeed's parameter dict gathers on access while "in forward"; a plain dict cannot.
        module._parameters = dict(module._parameters)
        for p in module._parameters.values():
            if p is not None and hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules.clear()
    return fast
