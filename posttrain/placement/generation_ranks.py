"""Separate generation ranks: the last ``generation_processes`` ranks of one launch only generate, the others
only train. Building blocks of the layout (the trainer wires them):

- :class:`RankLayout` says which ranks train and which generate; :func:`check_layout` refuses one that cannot work.
- :class:`LayoutGroups` creates, collectively on every rank and in one order, the process groups: the training
  ranks' (``train``), training rank 0 with the generation ranks for weight transfer (``sync``), and every rank for
  the rollout channel (``channel``).
- :func:`install_deepspeed_world` makes the training ranks DeepSpeed's world on a training rank: every DeepSpeed engine
  (trained or frozen, ZeRO-2 or ZeRO-3, each under its own plugin), ``zero.Init`` while a model loads, and the
  collectives DeepSpeed runs without a group (the barriers in ZeRO-3's optimizer set-up and in checkpointing) then
  span the training ranks only, while accelerate builds the engines as usual.

Generation ranks are the last ranks, so a training rank's global rank is its index among the training ranks: what
DeepSpeed and accelerate derive from the global rank (rank 0 writes, per-rank file names) stays right."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posttrain.errors import ConfigError

# Backends whose rollouts can run on a rank of their own (the hf backend generates through the trained engine).
GENERATION_RANK_BACKENDS = ("posttrain",)


@dataclass(frozen=True)
class RankLayout:
    """Which ranks of a world of ``world_size`` train and which generate (the last ``generation_processes``)."""

    world_size: int
    generation_processes: int

    @property
    def training_processes(self) -> int:
        return self.world_size - self.generation_processes

    @property
    def training_ranks(self) -> list[int]:
        return list(range(self.training_processes))

    @property
    def generation_ranks(self) -> list[int]:
        return list(range(self.training_processes, self.world_size))

    def generates(self, rank: int) -> bool:
        """Whether global ``rank`` only generates."""
        return rank >= self.training_processes


def check_layout(generation_processes: int, world_size: int, generation_backend: str | None = None) -> RankLayout | None:
    """The layout of ``generation_processes`` generation ranks in a world of ``world_size``, None when the setting is
    off (0); a layout that cannot work is refused in one ConfigError sentence."""
    if isinstance(generation_processes, bool) or not isinstance(generation_processes, int) or generation_processes < 0:
        raise ConfigError(f"generation_processes must be a whole number >= 0 (0: every rank trains and generates), "
                          f"got {generation_processes!r}")
    if generation_processes == 0:
        return None
    if generation_backend is not None and generation_backend not in GENERATION_RANK_BACKENDS:
        raise ConfigError(f"generation_processes {generation_processes} needs generation_backend posttrain (the "
                          f"{generation_backend} backend generates through the trained engine on the training ranks): "
                          "set generation_backend posttrain, or generation_processes 0")
    if generation_processes >= world_size:
        raise ConfigError(f"generation_processes {generation_processes} leaves no training rank in a launch of "
                          f"{world_size} process(es): launch at least {generation_processes + 1} processes "
                          f"(torchrun --nproc_per_node {generation_processes + 1}), or lower generation_processes")
    return RankLayout(world_size, generation_processes)


class LayoutGroups:
    """The layout's process groups. Collective: every rank of the launch builds them, in this order, once.

    - ``train``: the training ranks (DeepSpeed's world there, and posttrain's reductions: placement.ranks).
    - ``sync``: training rank 0 (global 0) and the generation ranks: weight transfer (placement.weight_sync).
    - ``channel``: every rank, for the rollout channel's point-to-point messages (placement.group_channel), apart
      from the default group so that no other traffic shares its communicator.

    On a rank outside a group, that attribute is torch's non-member marker (``sync``: use it where ``in_sync``)."""

    def __init__(self, layout: RankLayout) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the generation-rank layout needs the launch's process group: build the Session first")
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(f"the layout is for {layout.world_size} ranks but the process group has "
                               f"{dist.get_world_size()}")
        self.layout = layout
        self.rank = dist.get_rank()
        self.backend = str(dist.get_backend())  # the launch's: NCCL on GPU, gloo on CPU
        self.train = dist.new_group(layout.training_ranks)
        self.sync_ranks = [0, *layout.generation_ranks]
        self.sync = dist.new_group(self.sync_ranks)
        self.channel = dist.new_group(list(range(layout.world_size)))

    @property
    def generates(self) -> bool:
        """Whether this rank only generates."""
        return self.layout.generates(self.rank)

    @property
    def in_sync(self) -> bool:
        return self.rank in self.sync_ranks

    @property
    def device(self) -> torch.device:
        """Where this rank's messages live: its CUDA device under NCCL, the CPU under gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.backend else torch.device("cpu")

    def destroy(self) -> None:
        """Take the three groups down (collective, as their creation); the default group stays."""
        for group in (self.channel, self.sync, self.train):
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)


# -- DeepSpeed's world ------------------------------------------------------------------------------------
# Backend methods whose group is not a collective's (tearing down or creating the default group).
_KEEP_GROUP = frozenset({"destroy_process_group", "init_process_group"})


def _group_signature(function: Callable, depth: int = 3) -> inspect.Signature | None:
    """The signature, with ``group``, of a backend method, looking through decorators that hide it (DeepSpeed's
    ``stage_on_cpu`` wraps without ``functools.wraps``: the decorated function is in the wrapper's closure)."""
    fn: Any = getattr(function, "__func__", function)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if "group" in signature.parameters:
        return signature
    if depth == 0:
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        found = _group_signature(inner, depth - 1) if inspect.isfunction(inner) else None
        if found is not None:
            return found
    return None


# Collectives DeepSpeed calls without a group somewhere (ZeRO-3's checks, barriers, checkpoint tags).
_MUST_REDIRECT = ("barrier", "broadcast", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _TrainingWorld:
    """deepspeed.comm's backend (``deepspeed.comm.comm.cdb``) with ``group``, the training ranks, as its world:
    a call without a group (or on torch's default group) runs on ``group``; new groups sync only their members."""

    def __init__(self, backend: Any, group: Any) -> None:
        self._backend = backend
        self._group = group
        self._wrapped: dict[str, Callable] = {}
        for name in _MUST_REDIRECT:
            if _group_signature(getattr(type(backend), name)) is None:
                raise RuntimeError(f"DeepSpeed's communication backend {type(backend).__name__}.{name} takes no "
                                   "group that posttrain can find: this DeepSpeed version cannot run generation ranks")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name in _KEEP_GROUP or not callable(attr):
            return attr
        if name not in self._wrapped:
            self._wrapped[name] = self._wrap(name, attr)
        return self._wrapped[name]

    def _wrap(self, name: str, method: Callable) -> Callable:
        signature = _group_signature(getattr(type(self._backend), name, method))
        if signature is None:
            return method
        backend, group = self._backend, self._group
        unbound = next(iter(signature.parameters)) == "self"

        def on_training_ranks(*args: Any, **kwargs: Any) -> Any:
            given = kwargs.get("group")
            if given is not None and given is not dist.GroupMember.WORLD:  # the usual call: a group by keyword
                return method(*args, **kwargs)
            bound = signature.bind(backend, *args, **kwargs) if unbound else signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["group"] is None or bound.arguments["group"] is dist.GroupMember.WORLD:
                bound.arguments["group"] = group
            positional = bound.args[1:] if unbound else bound.args
            return method(*positional, **bound.kwargs)

        return on_training_ranks

    def get_world_group(self) -> Any:
        return self._group

    def new_group(self, ranks: list[int]) -> Any:
        # DeepSpeed builds groups on the training ranks alone: the generation ranks never join the call.
        return dist.new_group(list(ranks), use_local_synchronization=True)


def install_deepspeed_world(train_group: Any, backend: str) -> Callable[[], None]:
    """Make ``train_group`` DeepSpeed's world on this (training) rank until the returned function is called.

    DeepSpeed partitions and reduces over its data-parallel group, which without a model-parallel unit is a clone of
    its world (``deepspeed.utils.groups._clone_world_group``); ``zero.Init`` partitions over its world group when
    none is given (transformers' ``from_pretrained`` gives none); ZeRO-3's optimizer and ``save_checkpoint`` call
    group-less barriers. With the training ranks as that world, accelerate's unchanged ``prepare`` builds every
    engine over them."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    if ds_comm.cdb is None:
        ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    current = ds_comm.cdb
    real = current._backend if isinstance(current, _TrainingWorld) else current  # a newer session takes over
    saved_world = groups._WORLD_GROUP
    world = _TrainingWorld(real, train_group)
    ds_comm.cdb = world
    groups._WORLD_GROUP = train_group  # DeepSpeed's clone of its world: its data-parallel group

    def uninstall() -> None:
        if ds_comm.cdb is world:  # not if a newer session installed its own since
            ds_comm.cdb = real
        if groups._WORLD_GROUP is train_group:
            groups._WORLD_GROUP = saved_world

    return uninstall


def deepspeed_world_size() -> int:
    """The size of DeepSpeed's world as its engines see it (the training ranks under a layout)."""
    import deepspeed.comm as ds_dist

    return ds_dist.get_world_size()


def dp_world_size(engine: Any) -> int:
    """The number of ranks a DeepSpeed engine's ZeRO partitions and gradient reductions span."""
    return dist.get_world_size(engine.seq_data_parallel_group)


def module_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype a DeepSpeed engine holds a model's parameters in under accelerate's ``mixed_precision`` (None: as
    loaded): the generation ranks' copy is held in it, so a weight sync moves the trained values unchanged."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
