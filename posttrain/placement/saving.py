"""Saving and restoring a Session's roles (resumable state, full weights in Hugging Face format);
a mixin of :class:`posttrain.placement.session.Session`.

A saved model is in the dtype it was loaded in (its ``config.dtype``), as TRL's ``save_model`` writes a model
that no engine recast: on one process posttrain may train fp32 master weights in place of a bf16 model
(posttrain.placement.plain), and DeepSpeed's bf16 engine holds 16-bit copies of an fp32 model's masters."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError


class SavingMixin:
    """Session methods that save and restore its roles; collective: call them on every rank."""

    def save_state(self, directory: str | os.PathLike, extra: dict | None = None) -> None:
        """Resumable checkpoint: engine/scheduler/RNG states, then ``trainer_state.json`` (``extra``) last."""
        directory = Path(directory)
        for name, role in self.roles.items():
            if name in self.plain_roles and name in self.engines:
                self.engines[name].save_state(directory / name, self.schedulers.get(name))
            elif role.trains and name in self.engines:
                with self.activate(name):
                    self._accelerators[name].save_state(str(directory / name))
        self.wait_for_everyone()
        if self.is_main_process:
            tmp = directory / "trainer_state.json.tmp"
            tmp.write_text(json.dumps(extra or {}, indent=1))
            os.replace(tmp, directory / "trainer_state.json")
        self.wait_for_everyone()

    def load_state(self, directory: str | os.PathLike) -> dict:
        """Restore what :meth:`save_state` wrote and return its ``extra``; refuses an incomplete state."""
        from accelerate.utils import OPTIMIZER_NAME, RNG_STATE_NAME

        directory = Path(directory)
        if not (directory / "trainer_state.json").is_file():
            raise ConfigError(f"{directory} is incomplete (no trainer_state.json, written last by save_state): "
                              "its save did not finish; resume from an earlier checkpoint")
        for name, role in self.roles.items():
            if role.trains and name in self.engines:
                if not (directory / name).is_dir():
                    raise ConfigError(f"{directory} has no state for role {name!r}: it was saved by another set "
                                      "of roles; resume with the roles it was saved with")
                # Every rank checks every rank's file, so all ranks agree before any collective.
                missing = [i for i in range(self.num_processes)
                           if not (directory / name / f"{RNG_STATE_NAME}_{i}.pkl").is_file()]
                if missing:
                    raise ConfigError(f"{directory / name} lacks the RNG state of rank(s) {missing}: it was saved by "
                                      "fewer processes or its save did not finish; resume from a complete checkpoint "
                                      "with the same number of processes")
                if name in self.plain_roles:
                    self.engines[name].load_state(directory / name, self.schedulers.get(name))
                    continue
                if (directory / name / f"{OPTIMIZER_NAME}.bin").is_file():
                    raise ConfigError(f"{directory / name} was saved without a DeepSpeed engine (single_process_engine "
                                      "torch, one process): resume on one process with single_process_engine torch")
                with self.activate(name):
                    self._accelerators[name].load_state(str(directory / name))
        return json.loads((directory / "trainer_state.json").read_text())

    def state_dict(self, name: str) -> dict | None:
        """The role's full weights. Collective; a trained ZeRO-3 role gives None off the main rank."""
        state_dict = self._gathered_state_dict(name)
        return None if state_dict is None else share_tied(state_dict, self.unwrap(name))

    def _gathered_state_dict(self, name: str) -> dict | None:
        with self.activate(name):
            accelerator = self._accelerators[name]
            if name in self.plain_roles:
                return self.engines[name].module.state_dict()
            if self.role(name).trains:
                return accelerator.get_state_dict(self.engines[name])
            # accelerate's get_state_dict expects a trained engine; gather a frozen one directly.
            import deepspeed

            if name in self.fast_frozen:
                with self.fast_frozen[name].gathered() as module:
                    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            module = self.engines[name].module
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def saved_state_dict(self, name: str) -> dict | None:
        """The role's full weights as they are saved: each in the dtype the model was loaded in (LoRA adapters in
        fp32, as peft makes them; in the load dtype under ZeRO-3, as TRL), the fp32 master weights where the
        engine trains 16-bit copies of them. Collective; a trained ZeRO-3 role gives None off the main rank."""
        module = self.unwrap(name)
        deepspeed_zero3 = self.engine_kind(name) == "deepspeed" and self.zero_stage(name) == 3
        dtype_of = saved_dtypes(module, adapters_in_load_dtype=deepspeed_zero3)
        state_dict = self._gathered_state_dict(name)
        if self.role(name).trains and self.engine_kind(name) == "deepspeed":
            state_dict = self._with_masters(name, state_dict, dtype_of)
        if state_dict is None:
            return None
        for key, value in state_dict.items():
            dtype = dtype_of(key)
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                state_dict[key] = value.to(dtype)
        return share_tied(state_dict, module)

    def _with_masters(self, name: str, state_dict: dict | None, dtype_of: Callable[[str], torch.dtype | None]
                      ) -> dict | None:
        """``state_dict`` with DeepSpeed's fp32 master weights in place of the 16-bit copies its bf16 or fp16 engine
        trains, for the parameters saved wider than that (an fp32-loaded model). Collective, in one order on all ranks."""
        from deepspeed.utils import safe_get_full_fp32_param

        with self.activate(name):
            for key, param in self.unwrap(name).named_parameters():
                dtype = dtype_of(key)
                if not param.requires_grad or dtype is None or dtype.itemsize <= param.dtype.itemsize:
                    continue
                master = safe_get_full_fp32_param(param)  # None where the engine keeps no master (all ranks alike)
                if master is not None and state_dict is not None and key in state_dict:
                    state_dict[key] = master.detach().to("cpu", copy=True).reshape(state_dict[key].shape)
        return state_dict

    def save_pretrained(self, name: str, directory: str | os.PathLike, tokenizer: Any = None) -> None:
        """Save a role's model in Hugging Face format (``from_pretrained`` loads it): :meth:`saved_state_dict`,
        and config.json's ``dtype`` the dtype it is saved in."""
        state_dict = self.saved_state_dict(name)
        if self.is_main_process:
            model = self.unwrap(name)
            loaded = load_dtype(model)  # before save_pretrained overwrites config.dtype with the engine's
            model.save_pretrained(str(directory), state_dict=state_dict, safe_serialization=True)
            record_dtype(model, loaded, directory)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(directory))
        self.wait_for_everyone()


def load_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model (or the base of a peft model) was loaded in: its ``config.dtype``, set by
    ``from_pretrained``/``from_config`` and kept when an engine recasts the parameters; None if unknown."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = getattr(getattr(base, "config", None), "dtype", None)
    if isinstance(dtype, str):  # save_pretrained leaves the name ("bfloat16")
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def saved_dtypes(model: nn.Module, adapters_in_load_dtype: bool = False) -> Callable[[str], torch.dtype | None]:
    """The dtype each state-dict key is saved in: the load dtype; LoRA adapters fp32 (peft's
    ``autocast_adapter_dtype``) unless ``adapters_in_load_dtype``; None (as held) for transformers'
    ``_keep_in_fp32_modules`` and a model of unknown load dtype."""
    loaded = load_dtype(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    keep = set(getattr(base, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(base, "_keep_in_fp32_modules_strict", None) or ())
    adapters = loaded if adapters_in_load_dtype or loaded is None else torch.float32
    peft = hasattr(model, "peft_config")

    def dtype_of(key: str) -> torch.dtype | None:
        parts = key.split(".")
        if loaded is None or keep.intersection(parts):
            return None
        return adapters if peft and any(p.startswith("lora_") for p in parts) else loaded

    return dtype_of


def record_dtype(model: nn.Module, dtype: torch.dtype | None, directory: str | os.PathLike) -> None:
    """Set ``model.config.dtype`` back to ``dtype`` and, where save_pretrained wrote config.json (a full model),
    write it again: transformers writes the dtype of the model's parameters, the engine's, not the saved one."""
    if dtype is None:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.dtype = dtype
    if not hasattr(model, "peft_config") and (Path(directory) / "config.json").is_file():
        base.config.save_pretrained(str(directory))


def share_tied(state_dict: dict, module: nn.Module) -> dict:
    """Names of one shared parameter (tied embeddings) given one tensor again, as ``module.state_dict()`` has
    them: gathered copies are separate, and ``save_pretrained`` drops a tied name only for a shared tensor."""
    names: dict[int, list[str]] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(key)
    for tied in names.values():
        present = [key for key in tied if key in state_dict]
        for key in present[1:]:
            state_dict[key] = state_dict[present[0]]
    return state_dict
