"""Fast frozen ZeRO-3 forward: :func:`take_over` gathers one prefetched flat buffer per layer."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_ALIGN_BYTES = 128  # each parameter's offset in a flat vector: its views keep fast kernels' alignment


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _fetch_plan(offsets: list[int], numels: list[int], shard_numel: int, world: int, rank: int, align: int,
                whole: bool) -> tuple[list[bool], int, int, list[tuple[int, int, int]]]:
    """``rank``'s plan: (per param own-slice, base, span, pieces (src, start, end)); ``whole``: full span."""
    lo, hi = rank * shard_numel, (rank + 1) * shard_numel
    local = [lo <= o and o + n <= hi for o, n in zip(offsets, numels)]
    needed: list[tuple[int, int]] = []  # merged ranges of the non-local parameters
    for o, n, here in zip(offsets, numels, local):
        if here or n == 0:
            continue
        if needed and o - needed[-1][1] < align:
            needed[-1] = (needed[-1][0], o + n)
        else:
            needed.append((o, o + n))
    pieces = [(r, max(a, r * shard_numel), min(b, (r + 1) * shard_numel))
              for a, b in needed for r in range(world) if max(a, r * shard_numel) < min(b, (r + 1) * shard_numel)]
    if whole:
        return local, 0, shard_numel * world if world > 1 else 0, pieces
    if not needed:
        return local, 0, 0, pieces
    return local, needed[0][0], needed[-1][1] - needed[0][0], pieces


class _Group:
    """One flat vector of parameters, 1/N per rank; read only in a forward or :meth:`FastFrozen.gathered`."""

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
        self.shard_nbytes = self.shard_numel * params[0].element_size()
        self.nbytes = self.shard_nbytes * self.world
        self.align = align
        self.shard: torch.Tensor | None = None
        self.full: torch.Tensor | None = None  # the fetched part of the flat vector; no storage at rest
        self.base = 0  # the flat-vector position of full[0]
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # "p2p": (into full, from a rank's shard)
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full, shard) views of straddling parameters' local part
        self.live = False  # gathered, or a gather in flight
        self.work: Any = None  # "nccl": the async all-gather into ``full`` not yet waited for
        self.users = 0  # units running that need this group (nested or re-entrant use)
        # "p2p": the peers' mapped shards, the copies' side stream, and its two reused events.
        self.remote: list[torch.Tensor] | None = None
        self.stream: Any = None
        self.ready: Any = None
        self.copied: Any = None
        self.pending = False  # "p2p": copies issued that the compute stream has not waited for

    def build_shard(self, out: torch.Tensor | None = None) -> None:
        """Cut this rank's slice (``out``, peer or own memory); params view it or ``full``; frees ``full``."""
        import deepspeed

        zero = [p for p in self.params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(zero, modifier_rank=None):
            first = self.params[0].data
            flat = first.new_zeros(self.shard_numel * self.world)
            for p, offset, n in zip(self.params, self.offsets, self.numels):
                flat[offset: offset + n].copy_(p.data.reshape(-1))
            mine = flat[self.rank * self.shard_numel: (self.rank + 1) * self.shard_numel]
            self.shard = mine.clone() if out is None else out.copy_(mine)
            del flat, mine
        n, lo = self.shard_numel, self.rank * self.shard_numel
        # NCCL's all-gather is collective, so it fills the whole vector; copies fetch only what's needed.
        self.local, self.base, span, pieces = _fetch_plan(self.offsets, self.numels, n, self.world, self.rank,
                                                          self.align, whole=self.remote is None)
        self.full = self.shard.new_empty(span)
        for r, a, b in pieces:
            if self.remote is not None:
                self.copies.append((self.full[a - self.base: b - self.base], self.remote[r][a - r * n: b - r * n]))
            if r == self.rank:
                self.back.append((self.full[a - self.base: b - self.base], self.shard[a - lo: b - lo]))
        empty = self.shard.new_empty(0)
        for p, shape, offset, here in zip(self.params, self.shapes, self.offsets, self.local):
            stride = _contiguous_strides(shape)
            if here:  # as_strided's offset counts from the start of the storage, not of the view
                p.data = self.shard.as_strided(shape, stride, self.shard.storage_offset() + offset - lo)
            else:
                p.data = self.full.as_strided(shape, stride, offset - self.base)
            if hasattr(p, "ds_tensor"):  # store the model once; a DeepSpeed gather now fails loudly
                p.ds_tensor.data = empty
        self.storage = self.full.untyped_storage()
        self.full_nbytes = self.storage.nbytes()
        self.storage.resize_(0)
        if self.remote is not None:
            self.ready, self.copied = torch.cuda.Event(), torch.cuda.Event()

    def start(self, compute: Any = None) -> None:
        """Gather what this rank lacks unless live; ``compute``: the stream using it (default: current)."""
        if self.live:
            return
        self.live = True
        if self.full_nbytes == 0:  # every parameter is a view of the local slice
            return
        self.storage.resize_(self.full_nbytes)
        if self.remote is None:
            self.work = dist.all_gather_into_tensor(self.full, self.shard, group=self.pg, async_op=True)
            return
        # The side stream waits for compute (earlier work may still use the fresh memory) and
        # compute waits for the copies in acquire()/drop(), so no record_stream is needed.
        compute = compute or torch.cuda.current_stream()
        self.ready.record(compute)
        self.stream.wait_event(self.ready)
        torch.cuda.set_stream(self.stream)  # cheaper than the torch.cuda.stream() context
        try:
            for dst, src in self.copies:
                dst.copy_(src, non_blocking=True)
            self.copied.record(self.stream)
        finally:
            torch.cuda.set_stream(compute)
        self.pending = True

    def write_back(self) -> None:
        """Copy the local part of straddling parameters back into the slice after an in-place change."""
        for full, shard in self.back:
            shard.copy_(full)

    def _wait(self, compute: Any = None) -> None:
        """Order ``compute`` (default: the current stream) after the gather; the CPU does not wait."""
        if self.pending:
            (compute or torch.cuda.current_stream()).wait_event(self.copied)
            self.pending = False
        elif self.work is not None:
            self.work.wait()  # on CUDA: the current stream waits for NCCL's, the CPU does not
            self.work = None

    def acquire(self, compute: Any = None) -> None:
        """Make the parameters' values whole (ordering the compute stream after their gather)."""
        self.start(compute)
        self._wait(compute)
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.drop()

    def drop(self) -> None:
        """Back to rest: only the local slice is kept."""
        if not self.live:
            return
        self._wait()
        if self.full_nbytes:
            self.storage.resize_(0)
        self.live = False
        self.users = 0


class _PeerMemory:
    """Each rank's shards in one symmetric-memory buffer mapped by the host; read by copies (no SMs)."""

    def __init__(self, groups: list[_Group], process_group: Any, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.offsets, total = [], 0
        for g in groups:
            self.offsets.append(total)
            total += -(-g.shard_nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        with contextlib.suppress(Exception):  # older PyTorch needs it, newer ones do it themselves
            symm_mem.enable_symm_mem_for_group(process_group.group_name)
        before = torch.cuda.memory_allocated(device)
        self.local = symm_mem.empty(max(total, 1), dtype=torch.uint8, device=device)
        # Some PyTorch versions allocate it outside the caching allocator: memory reports add it back.
        self.outside_allocator = torch.cuda.memory_allocated(device) - before < total
        self.handle = symm_mem.rendezvous(self.local, process_group)
        self.remote = [self.handle.get_buffer(r, (max(total, 1),), torch.uint8) for r in range(groups[0].world)]
        self.stream = torch.cuda.Stream(device)
        self.nbytes = total

    def view(self, buffer: torch.Tensor, index: int, group: _Group) -> torch.Tensor:
        start = self.offsets[index]
        return buffer[start: start + group.shard_nbytes].view(group.params[0].dtype)


def _peer_memory_or_none(groups: list[_Group], process_group: Any, device: torch.device,
                         required: bool) -> _PeerMemory | None:
    """Set up peer-mapped shards; None on every rank if any rank could not (then NCCL gathers)."""
    import warnings

    peers, error = None, None
    try:
        peers = _PeerMemory(groups, process_group, device)
    except Exception as err:  # noqa: BLE001 - e.g. no P2P between the GPUs; reported below
        error = err
    ok = torch.tensor([peers is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=process_group)
    if bool(ok.item()):
        return peers
    if required:
        raise RuntimeError(f"fast frozen transport p2p is not available here: {error!r}")
    warnings.warn(f"posttrain.placement.frozen: peer-mapped shards unavailable ({error!r}); gathering with NCCL",
                  stacklevel=3)
    return None


def _choose_transport(requested: str, process_group: Any, device: torch.device) -> str:
    """"p2p" where every rank of the group is a CUDA process on this host, else "nccl" (collective)."""
    if requested not in ("auto", "p2p", "nccl"):
        raise ValueError(f"transport={requested!r}: expected auto, p2p or nccl")
    if requested == "nccl":
        return "nccl"
    hosts: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(hosts, (socket.gethostname(), device.type), group=process_group)
    possible = device.type == "cuda" and len(set(hosts)) == 1
    if requested == "p2p" and not possible:
        raise ValueError("transport=p2p needs every rank of the group on one host, on CUDA")
    return "p2p" if possible else "nccl"


@dataclass
class _Unit:
    module: nn.Module
    is_layer: bool
    groups: list[_Group] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def _units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter], bool]]:
    """(module, parameters it uses, is a layer) per ModuleList child and other parameter owner, in order."""
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
    """Owns a frozen model's flat shards and the hooks that gather them layer by layer, prefetching ahead."""

    def __init__(self, model: nn.Module, process_group: Any = None, transport: str = "auto") -> None:
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
        self.peers: _PeerMemory | None = None
        pg = (self.groups[0].pg if self.groups else None) or dist.group.WORLD
        first = self.groups[0].params[0] if self.groups else None
        device = getattr(first, "ds_tensor", first).device if first is not None else torch.device("cpu")
        self.transport = _choose_transport(transport, pg, device) if self.groups else "nccl"
        if self.transport == "p2p":
            self.peers = _peer_memory_or_none(self.groups, pg, device, required=transport == "p2p")
            self.transport = "p2p" if self.peers is not None else "nccl"
        for i, group in enumerate(self.groups):
            if self.peers is None:
                group.build_shard()
            else:
                group.remote = [self.peers.view(buf, i, group) for buf in self.peers.remote]
                group.stream = self.peers.stream
                group.build_shard(self.peers.view(self.peers.local, i, group))
        if self.peers is not None:
            # Every shard is written before any rank reads a peer's; from here on they never change.
            torch.cuda.synchronize()
            dist.barrier(group=pg)
        layers = [u.nbytes for u in self.units if u.is_layer] or [u.nbytes for u in self.units]
        self.lookahead_bytes = max(layers)  # bytes gathered ahead of the running unit
        self.trace: list[int] = []  # unit order of the last complete forward
        self._current: list[int] = []
        self._on_trace = False
        self._compute: Any = None  # "p2p": the stream the running forward computes on
        self._handles = [model.register_forward_pre_hook(self._begin), model.register_forward_hook(self._end)]
        for i, unit in enumerate(self.units):
            self._handles.append(unit.module.register_forward_pre_hook(self._pre(i)))
            self._handles.append(unit.module.register_forward_hook(self._post(i)))
        # At rest reading the non-local parameters would crash (freed storage): refuse state dicts.
        self._handles.append(model.register_state_dict_pre_hook(self._refuse_at_rest))

    # -- hooks -------------------------------------------------------------------------------
    def _begin(self, module: nn.Module, args: Any) -> None:
        self._rest()  # a forward that raised may have left buffers gathered
        self._current, self._on_trace = [], bool(self.trace)
        self._compute = torch.cuda.current_stream() if self.peers is not None else None

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.trace = self._current
        self._rest()  # a prefetch that the forward did not use
        self._compute = None

    def _pre(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            pos = len(self._current)
            self._current.append(i)
            # Follow last forward's order while this one repeats it; prefetch the unit after.
            self._on_trace = self._on_trace and pos < len(self.trace) and self.trace[pos] == i
            for group in self.units[i].groups:
                group.acquire(self._compute)
            if self._on_trace:
                self._prefetch(pos + 1)
        return hook

    def _prefetch(self, pos: int) -> None:
        """Start gathering the units from trace position ``pos`` on, up to :attr:`lookahead_bytes`."""
        ahead = 0
        while pos < len(self.trace) and ahead < self.lookahead_bytes:
            for group in self.units[self.trace[pos]].groups:
                if group.users == 0:  # not the running unit's own (a tied weight used twice)
                    group.start(self._compute)
                    ahead += group.nbytes
            pos += 1

    def _post(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for group in self.units[i].groups:
                group.release()
        return hook

    def _refuse_at_rest(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not all(g.live for g in self.groups):
            raise RuntimeError("this frozen ZeRO-3 model keeps only its shards between forwards, so its "
                               "parameters cannot be read now: take its state dict with "
                               "Session.state_dict(role) or Session.save_pretrained(role, directory), or "
                               "inside `with FastFrozen.gathered():` (collective: on every rank)")

    def _rest(self) -> None:
        for group in self.groups:
            group.drop()

    # -- inspection and full weights ---------------------------------------------------------
    def local_numel(self) -> int:
        """Elements this rank stores at rest (its slices, padding included)."""
        return sum(g.shard.numel() for g in self.groups)

    def full_numel(self) -> int:
        return sum(g.numel for g in self.groups)

    def bytes_outside_allocator(self) -> int:
        """Device memory this model holds that ``torch.cuda.memory_allocated()`` does not count."""
        return self.peers.nbytes if self.peers is not None and self.peers.outside_allocator else 0

    def at_rest(self) -> bool:
        """No gathered buffer is allocated and every parameter is a view of a slice or of freed storage."""
        shards = {g.shard.untyped_storage().data_ptr() for g in self.groups}
        return not any(g.live for g in self.groups) and all(
            p.untyped_storage().nbytes() == 0 or p.untyped_storage().data_ptr() in shards
            for p in self.model.parameters())

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """Every parameter whole for the duration (collective: all ranks must enter)."""
        for group in self.groups:
            group.acquire()
        try:
            yield self.model
        finally:
            self._rest()

    @torch.no_grad()
    def update_(self, fn: Any) -> None:
        """``fn(param)`` per whole parameter, group by group; ranks keep slices. Collective, same ``fn``."""
        for group in self.groups:
            group.acquire()
            try:
                if self.peers is not None:  # peers copy from the slices: all read before any write
                    torch.cuda.synchronize()
                    dist.barrier(group=group.pg)
                for p in group.params:
                    fn(p)
                group.write_back()
            finally:
                group.release()
        if self.peers is not None:
            # Every slice is rewritten before any rank copies from it again.
            torch.cuda.synchronize()
            dist.barrier(group=self.groups[0].pg)

    def remove(self) -> None:
        """Remove the hooks. Collective with "p2p" (no rank frees shards a peer may still read)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.peers is not None:
            torch.cuda.synchronize()
            dist.barrier(group=self.groups[0].pg)


def take_over(engine: Any) -> FastFrozen:
    """Swap a prepared inference-only ZeRO-3 engine's gathering for :class:`FastFrozen` (same object)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    offload = getattr(engine, "optimizer", None)
    if not isinstance(offload, DeepSpeedZeRoOffload):
        raise TypeError("fast_frozen needs a frozen ZeRO-3 engine prepared without an optimizer")
    model = engine.module
    # The engine's forward prologue/epilogue would re-arm DeepSpeed's gather-on-attribute-access.
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
