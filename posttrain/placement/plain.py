"""A trained role without a DeepSpeed engine at one process, where ZeRO partitions nothing yet costs hooks,
bucket copies and (fp32) a second model copy: TRL's one-GPU path behind the engine API."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.placement.dsconfig import master_weights as master_weights_of
from posttrain.placement.dsconfig import read_config

if TYPE_CHECKING:
    from posttrain.placement.roles import Role

ENGINES = ("auto", "deepspeed", "torch")


def uses_torch(setting: str, *, world_size: int, trains: bool, from_mix: bool, master_weights: str,
               decoded: bool, mixed_precision: str) -> bool:
    """Whether a role runs as :class:`PlainEngine` (``auto``: world 1, trained, no fp16/decoded fp32)."""
    if setting == "deepspeed" or world_size != 1 or not trains or not from_mix:
        return False
    if setting == "torch" or master_weights == "bf16":
        return True
    return not decoded and mixed_precision != "fp16"


def torch_roles(roles: Iterable[Role], setting: str, *, world_size: int, mixed_precision: str) -> set[str]:
    """The names of a run's roles that take the torch path (:func:`uses_torch` for each)."""
    roles = list(roles)
    decoded = any(r.decoded for r in roles if r.trains)
    return {r.name for r in roles
            if uses_torch(setting, world_size=world_size, trains=r.trains, from_mix=r.from_mix,
                          master_weights=master_weights_of(read_config(r.config)), decoded=decoded,
                          mixed_precision=mixed_precision)}


def check_setting(setting: str, *, world_size: int, mixed_precision: str, own_configs: list[str]) -> None:
    """Refuse a ``single_process_engine`` that cannot apply, in one sentence with the fix."""
    if setting not in ENGINES:
        raise ConfigError(f"single_process_engine must be one of {', '.join(ENGINES)}, got {setting!r}: "
                          "auto (torch on one process, except fp32 master weights in runs that decode a "
                          "trained role), deepspeed or torch")
    if setting != "torch":
        return
    if world_size != 1:
        raise ConfigError(f"single_process_engine torch runs one process only, and this run has {world_size}: "
                          "set single_process_engine auto or deepspeed, or launch one process")
    if mixed_precision == "fp16":
        raise ConfigError("single_process_engine torch has no fp16 loss scaling: use --bf16 true, or "
                          "single_process_engine deepspeed for fp16")
    if own_configs:
        raise ConfigError(f"single_process_engine torch replaces the DeepSpeed engine of trained roles whose config "
                          f"comes from the mix, but {', '.join(map(repr, own_configs))} has a config of its own "
                          "(role_configs, or the zero2-zero3-stock mix, which runs as named): drop it from role_configs "
                          "or choose another mix, or set single_process_engine deepspeed")


def describe(master_weights: str, mixed_precision: str) -> str:
    """What the torch path runs, for the one-process record (printed, model card, dpo_race)."""
    if mixed_precision != "bf16":
        how = "fp32 model"
    elif master_weights == "bf16":
        how = "bf16 model, bf16 Adam states, bf16 autocast forward"
    else:
        how = "fp32 model and Adam states, bf16 autocast forward"
    return f"no DeepSpeed engine: torch fused AdamW on the {how} (TRL's one-GPU path)"


class PlainEngine(nn.Module):
    """Model + torch optimizer as a DeepSpeed engine; ``master_weights`` "bf16" or "fp32" (autocast)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 gradient_accumulation_steps: int, gradient_clipping: float, mixed_precision: str,
                 master_weights: str) -> None:
        super().__init__()
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        _cast_parameters(model, torch.bfloat16 if master_weights == "bf16" else torch.float32,
                         frozen=torch.bfloat16 if mixed_precision == "bf16" else torch.float32, trained=trained)
        model.to(device)
        if mixed_precision == "bf16":
            _autocast_forward(model, device)
        use_fused_adamw(optimizer)
        self.module = model
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clipping = float(gradient_clipping or 0.0)
        self.micro_steps = 0
        self._boundary: bool | None = None
        self._grad_norm: torch.Tensor | None = None
        self._params = [p for group in optimizer.param_groups for p in group["params"]]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.gradient_accumulation_steps > 1:  # as DeepSpeed's engine (and transformers' Trainer) scale
            loss = loss / self.gradient_accumulation_steps
        loss.backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the next step ends the accumulation, as DeepSpeed's engine takes it."""
        self._boundary = is_boundary

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        grads = [p for p in self._params if p.grad is not None]
        if self.clipping > 0:  # clip coefficient max / (norm + 1e-6), as DeepSpeed's and Trainer's
            self._grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.clipping)
        else:
            self._grad_norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm

    def gradient_clipping(self) -> float:
        return self.clipping

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # -- checkpoints: accelerate's files for a model without DeepSpeed ----------------------------
    def save_state(self, directory: str | os.PathLike, scheduler: Any = None) -> None:
        """Weights, optimizer, scheduler and RNG states, with accelerate's ``save_accelerator_state``."""
        from accelerate.checkpointing import save_accelerator_state

        Path(directory).mkdir(parents=True, exist_ok=True)
        save_accelerator_state(str(directory), [self.module.state_dict()], [self.optimizer],
                               [scheduler] if scheduler is not None else [], [], process_index=0,
                               step=self.micro_steps, safe_serialization=False)  # pickled: tied weights

    def load_state(self, directory: str | os.PathLike, scheduler: Any = None) -> None:
        from accelerate.checkpointing import load_accelerator_state
        from accelerate.utils import OPTIMIZER_NAME

        if not (Path(directory) / f"{OPTIMIZER_NAME}.bin").is_file():
            raise ConfigError(f"{directory} was saved by a DeepSpeed engine, and this run trains without one "
                              "(single_process_engine): resume with single_process_engine deepspeed")
        found = load_accelerator_state(str(directory), [self.module], [self.optimizer],
                                       [scheduler] if scheduler is not None else [], [], process_index=0,
                                       map_location="cpu")  # load_state_dict moves to the parameters
        self.micro_steps = int(found.get("step", self.micro_steps))


def _cast_parameters(model: nn.Module, dtype: torch.dtype, *, frozen: torch.dtype, trained: set[int]) -> None:
    """Cast ``trained`` (ids) to ``dtype``, others to ``frozen``, in place; buffers as DeepSpeed leaves."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        target = dtype if id(param) in trained else frozen
        if param.is_floating_point() and param.dtype != target and not any(k in name.split(".") for k in keep):
            param.data = param.data.to(target)


def _autocast_forward(model: nn.Module, device: torch.device) -> None:
    """The forward in bf16 autocast with fp32 outputs, patched as accelerate's ``prepare_model`` does."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast(device_type=device.type, dtype=torch.bfloat16)(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)


def use_fused_adamw(optimizer: torch.optim.Optimizer) -> None:
    """Switch an AdamW to fused where allowed; use on DeepSpeed too (foreach has a master-sized temp)."""
    if type(optimizer) is not torch.optim.AdamW or optimizer.state:
        return
    from torch.optim.optimizer import _device_dtype_check_for_fused

    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                _device_dtype_check_for_fused(p)  # the check AdamW(fused=True) makes at its first step
    except RuntimeError:
        return  # no fused kernel for this device or dtype: torch's default implementation
    for group in (*optimizer.param_groups, optimizer.defaults):
        group["fused"], group["foreach"] = True, False
