"""Saving and restoring a Session's roles (resumable state, full weights in Hugging Face format);
a mixin of :class:`posttrain.placement.session.Session`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
        self.accelerator.wait_for_everyone()
        if self.is_main_process:
            tmp = directory / "trainer_state.json.tmp"
            tmp.write_text(json.dumps(extra or {}, indent=1))
            os.replace(tmp, directory / "trainer_state.json")
        self.accelerator.wait_for_everyone()

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

    def save_pretrained(self, name: str, directory: str | os.PathLike, tokenizer: Any = None) -> None:
        """Save a role's model in Hugging Face format (``from_pretrained`` loads it)."""
        state_dict = self.state_dict(name)
        if self.is_main_process:
            model = self.unwrap(name)
            model.save_pretrained(str(directory), state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(directory))
        self.accelerator.wait_for_everyone()


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
