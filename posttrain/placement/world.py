"""The processes a Session runs in: refused launcher settings, a world of one without a launcher,
the process group's teardown, and the process-wide state a session leaves behind."""

from __future__ import annotations

import os

import torch

from posttrain.errors import ConfigError

# Environment variables changed by sessions since the last one closed: name -> (value before, value set).
_ENV_SET: dict[str, tuple[str | None, str | None]] = {}
# Whether the process group is a world of one that a session described itself (no launcher).
_OWN_WORLD = False

# Launcher variables that would fill or replace a plugin's values behind the session's back.
OVERRIDING_ENV = ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                  "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                  "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")


def check_environment() -> None:
    """Refuse launcher settings that would silently override the per-role plugins."""
    found = [k for k in OVERRIDING_ENV if os.environ.get(k) not in (None, "", "none")]
    if found:
        raise ConfigError(f"{', '.join(f'{k}={os.environ[k]}' for k in found)} would override posttrain's "
                          "per-role DeepSpeed configs. Remove deepspeed_config_file / zero_stage / "
                          "offload_* / gradient_* from your accelerate config (or the matching --flags of "
                          "accelerate launch), keep only use_deepspeed/num_processes/machine settings, and "
                          "choose placements with posttrain's mix or role configs.")


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def _skip_shm_comm_op() -> None:
    """Mark DeepSpeed's CPU shm all-reduce unbuildable: slow JIT, only tensor-parallel inference uses it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _single_process_env() -> None:
    """No launcher (``python script.py``): describe a world of one, as torchrun would."""
    global _OWN_WORLD
    dist = torch.distributed
    if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        return
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous of this one process
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _OWN_WORLD = True
    single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in single.items():
        os.environ.setdefault(key, value)


def forget_destroyed_group() -> None:
    """Let a second run in one process build its own group: reset DeepSpeed's globals when none is alive."""
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
    """At exit: take the process group down in step on all ranks (no barrier after an uncaught exception)."""
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


def note_env_changes(before: dict[str, str]) -> None:
    """Remember what the environment gained or lost since ``before`` (a session's world, accelerate's flags)."""
    for key in before.keys() | os.environ.keys():
        if before.get(key) != os.environ.get(key):
            # The value before the first unclosed session is the one to restore.
            original = _ENV_SET[key][0] if key in _ENV_SET else before.get(key)
            _ENV_SET[key] = (original, os.environ.get(key))


def _restore_env() -> None:
    for key, (original, set_to) in _ENV_SET.items():
        if os.environ.get(key) != set_to:
            continue  # changed since by someone else: theirs to keep
        if original is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = original
    _ENV_SET.clear()


def _restore_linear() -> None:
    """Undo DeepSpeed's memory-efficient linear (a ZeRO-3 role's opt-in), which replaces F.linear process-wide."""
    import sys

    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    wrap = getattr(sys.modules.get("deepspeed.runtime.zero.linear"), "zero3_linear_wrap", None)
    saved = getattr(getattr(partition, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if saved is not None and wrap is not None and torch.nn.functional.linear is wrap:
        torch.nn.functional.linear = saved


def leave_process() -> None:
    """Take down what sessions set process-wide: accelerate's state, transformers' DeepSpeed config (ZeRO-3
    mode), the environment, and a world of one they made (a launcher's group stays up). Collective."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    global _OWN_WORLD
    if _OWN_WORLD:
        _destroy_process_group()
        forget_destroyed_group()
        _OWN_WORLD = False
    # A launcher's group is kept: a second default group on torchrun's store reuses the first one's keys and
    # hangs, so later sessions share it and the exit handler takes it down.
    AcceleratorState._reset_state(reset_partial_state=not (torch.distributed.is_available()
                                                           and torch.distributed.is_initialized()))
    GradientState._reset_state()
    # accelerate's plugins keep their HfDeepSpeedConfig alive: from_pretrained would keep partitioning (zero.Init).
    unset_hf_deepspeed_config()
    _restore_linear()
    _restore_env()
