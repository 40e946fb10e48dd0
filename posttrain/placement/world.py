"""The processes a Session runs in: launcher settings it refuses (they would override the per-role
plugins), a world of one described when there is no launcher, DeepSpeed's CPU comm op it skips, and
the process group taken down in step at exit."""

from __future__ import annotations

import os

import torch

from posttrain.errors import ConfigError

# Launcher variables that would fill or replace a plugin's values behind the session's back.
OVERRIDING_ENV = (
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_GRADIENT_CLIPPING",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
)


def check_environment() -> None:
    """Refuse launcher settings that would silently override the per-role plugins."""
    found = [k for k in OVERRIDING_ENV if os.environ.get(k) not in (None, "", "none")]
    if found:
        raise ConfigError(
            f"{', '.join(f'{k}={os.environ[k]}' for k in found)} would override posttrain's per-role "
            "DeepSpeed configs. Remove deepspeed_config_file / zero_stage / offload_* / gradient_* from "
            "your accelerate config (or the matching --flags of accelerate launch), keep only "
            "use_deepspeed/num_processes/machine settings, and choose placements with posttrain's mix "
            "or role configs."
        )


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def _skip_shm_comm_op() -> None:
    """On CPU DeepSpeed JIT-compiles its shared-memory all-reduce (``deepspeed_shm_comm``, a slow
    build, once per machine) when its comm backend starts. Only tensor-parallel inference uses it
    (``inference_all_reduce``, which falls back to torch.distributed without it); ZeRO's
    collectives are plain torch.distributed (gloo), so posttrain marks it unavailable through
    DeepSpeed's own table of buildable ops, read by ``deepspeed.comm.torch.build_shm_op``."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _single_process_env() -> None:
    """``python script.py`` with no launcher: describe a world of one, as torchrun would, so that
    accelerate and DeepSpeed build their process group (TRL scripts run that way on one GPU or CPU).
    Without it DeepSpeed's engine fails with "Default process group has not been initialized"."""
    dist = torch.distributed
    if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        return
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous of this one process
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in single.items():
        os.environ.setdefault(key, value)


def forget_destroyed_group() -> None:
    """Let a second run in one Python process build its own process group.

    A run that ends by destroying the process group (accelerate's ``end_training``, TRL's trainers,
    ``torch.distributed.destroy_process_group``) leaves DeepSpeed holding the destroyed group: its
    communication backend and the groups ``deepspeed.utils.groups`` caches. The next engine then
    fails with "Group ... is not registered". DeepSpeed has no call to forget them, so their module
    globals are reset here, and only when no process group is alive."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        return
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    for name, value in vars(groups).items():
        if name.startswith("_") and name.isupper() and "GROUP" in name:
            if isinstance(value, dict):
                value.clear()
            elif value is not None:
                setattr(groups, name, None)


def _destroy_process_group() -> None:
    """At exit: take the process group down in step on every rank.

    Left to interpreter teardown, gloo's C++ threads were destroyed while still joinable in about
    1 of 13 two-process CPU runs ("terminate called without an active exception", SIGABRT after
    the work was done); with this, 0 of 20. After an uncaught exception ranks are not in step, so
    they skip the barrier; the gloo barrier has a timeout so that exit never hangs.
    """
    import sys
    from datetime import timedelta

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo" and not hasattr(sys, "last_value"):
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        except RuntimeError:
            pass  # another rank left early; nothing to wait for
    dist.destroy_process_group()
