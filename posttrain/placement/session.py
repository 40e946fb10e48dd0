"""The Session: every role's DeepSpeed engine, each under its own plugin and Accelerator."""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from posttrain.checks import check_model_path
from posttrain.errors import ConfigError
from posttrain.placement import dsconfig, plain
from posttrain.placement.frozen_weights import FrozenWeightsMixin
from posttrain.placement.generation_ranks import (
    LayoutGroups,
    check_layout,
    install_deepspeed_world,
    module_dtype,
)
from posttrain.placement.roles import Role
from posttrain.placement.saving import SavingMixin
from posttrain.placement.world import (
    _destroy_process_group,
    _single_process_env,
    _skip_shm_comm_op,
    check_environment,
    forget_destroyed_group,
    leave_process,
    note_env_changes,
    on_cpu,
)
from posttrain.placement.zero_fixes import (
    cast_grads_while_flattening,
    recompute_rotary_buffers,
    share_bf16_master,
)

# The newest session: it alone owns the process-wide state (accelerate's, transformers', the group).
_current: weakref.ref | None = None


class Session(SavingMixin, FrozenWeightsMixin):
    """Owns the Accelerator(s) and role engines: ``prepare(name, load(name, path), optimizer)`` per role."""

    def __init__(self, roles: Sequence[Role], *, micro_batch_size: int = 1,
                 gradient_accumulation_steps: int = 1, max_grad_norm: float | None = 1.0,
                 mixed_precision: str | None = None, learning_rate: float | None = None,
                 weight_decay: float | None = None, warmup_steps: int | None = None,
                 total_steps: int | None = None, log_with: str | list[str] | None = None,
                 project_dir: str | None = None, single_process_engine: str = "auto",
                 generation_processes: int = 0) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        env_before = dict(os.environ)
        self.closed = False
        check_environment()
        # accelerate treats every exported accelerate-yaml key as a clash with config-built plugins.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        names = [r.name for r in roles]
        if len(set(names)) != len(names):
            raise ConfigError(f"role names must be unique, got {names}")
        trained = [r for r in roles if r.trains]
        if not trained:
            raise ConfigError("at least one role must train (Role(..., trains=True))")
        # Trained roles first: accelerate activates the first plugin; the first one owns the Accelerator.
        self.roles: dict[str, Role] = {r.name: r for r in trained + [r for r in roles if not r.trains]}
        self.primary = trained[0].name
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.mixed_precision = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        # generation_processes: the last ranks only generate; every engine spans the others (generation_ranks).
        self.layout = check_layout(generation_processes, launched)
        _single_process_env()
        world_size = self.layout.training_processes if self.layout else launched
        plain.check_setting(single_process_engine, world_size=world_size, mixed_precision=self.mixed_precision,
                            own_configs=[r.name for r in trained if not r.from_mix])

        self.configs: dict[str, dict] = {}
        self.one_rank_changes: dict[str, str] = {}  # role -> what the one-process path changed
        self.plain_roles: set[str] = plain.torch_roles(self.roles.values(), single_process_engine, world_size=world_size,
                                                       mixed_precision=self.mixed_precision)
        run_settings = dict(micro_batch_size=micro_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                            world_size=world_size, mixed_precision=self.mixed_precision, max_grad_norm=max_grad_norm,
                            learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps,
                            total_steps=total_steps)
        for role in self.roles.values():
            raw = dsconfig.read_config(role.config)
            torch_path = role.name in self.plain_roles
            if torch_path:
                self.one_rank_changes[role.name] = plain.describe(dsconfig.master_weights(raw), self.mixed_precision)
            elif world_size == 1 and role.from_mix:
                raw, change = dsconfig.one_rank(raw, role.trains)
                if change:
                    self.one_rank_changes[role.name] = change
            self.configs[role.name] = dsconfig.resolve(raw, role=role.name, trains=role.trains,
                                                       memory_efficient_linear=role.memory_efficient_linear,
                                                       **run_settings)
            if torch_path:  # checked as DeepSpeed would take it; its plugin only ever sees loading (no zero.Init)
                self.configs[role.name]["zero_optimization"] = {"stage": 0}

        if self.layout and world_size == 1:
            sharded = [n for n, cfg in self.configs.items() if dsconfig.zero_stage(cfg) == 3]
            if sharded:
                raise ConfigError(f"role(s) {', '.join(map(repr, sharded))} have a ZeRO-3 config but only one rank "
                                  "trains (the others generate): give them a ZeRO-2 or replicated config, or train on "
                                  "more ranks (a larger launch, or lower generation_processes)")
        if self.one_rank_changes:
            changes = "; ".join(f"{n}: {c}" for n, c in self.one_rank_changes.items())
            print(f"[posttrain] one process, so the mix's placements are simplified: {changes}", flush=True)

        # A new session starts from a clean accelerate state (the process group is kept or rebuilt).
        forget_destroyed_group()
        # Without a live group, accelerate's process state (a TRL trainer's, a destroyed group's) is stale.
        group_alive = torch.distributed.is_available() and torch.distributed.is_initialized()
        AcceleratorState._reset_state(reset_partial_state=not group_alive)
        GradientState._reset_state()
        plugins = {name: DeepSpeedPlugin(hf_ds_config=cfg) for name, cfg in self.configs.items()}
        # Without gloo on CPU every rank believes it is rank 0 of 1 and runs silently alone.
        handlers = [InitProcessGroupKwargs(backend="gloo")] if on_cpu() else []
        if on_cpu():
            _skip_shm_comm_op()
        self.accelerator = Accelerator(deepspeed_plugins=plugins, mixed_precision=self.mixed_precision,
                                       gradient_accumulation_steps=gradient_accumulation_steps,
                                       kwargs_handlers=handlers, log_with=log_with, project_dir=project_dir)
        self._check_world(launched)
        self.groups: LayoutGroups | None = None
        self._leave_deepspeed_world: Any = None
        if self.layout:
            self.groups = LayoutGroups(self.layout)
            if not self.groups.generates:
                self._leave_deepspeed_world = install_deepspeed_world(self.groups.train,
                                                                      torch.distributed.get_backend())
        self._pin_accumulation()
        atexit.unregister(_destroy_process_group)  # once, however many sessions
        atexit.register(_destroy_process_group)
        # One Accelerator per role (sharing the process-wide state), each holding exactly one engine.
        self._accelerators: dict[str, Any] = {name: self.accelerator if name == self.primary
                                              else Accelerator() for name in self.roles}
        note_env_changes(env_before)  # the world of one, ACCELERATE_USE_DEEPSPEED...: undone by close()
        global _current
        _current = weakref.ref(self)
        # role -> torch's CPU generator state (before, after) its load, when loading drew from it (a new head).
        self.load_rng: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.engines: dict[str, Any] = {}
        self.fast_frozen: dict[str, Any] = {}  # role -> posttrain.placement.frozen.FastFrozen
        self.optimizers: dict[str, Any] = {}
        self.schedulers: dict[str, Any] = {}
        self._step_lr: dict[str, float] = {}  # role -> the rate its last optimizer step used
        self._active: list[str] = [self.primary]

    def _pin_accumulation(self) -> None:
        # accelerate overwrites the shared value with each prepared plugin's (trap 1): pin the trained one.
        state = self.accelerator.gradient_state
        state.plugin_kwargs = {**state.plugin_kwargs, "num_steps": self.gradient_accumulation_steps}

    # -- processes ---------------------------------------------------------------------------
    def _check_world(self, expected: int) -> None:
        got = self.accelerator.num_processes
        actual = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if got != expected or actual != expected:
            raise RuntimeError(f"world size disagrees: the launcher set WORLD_SIZE={expected}, accelerate "
                               f"sees {got}, torch.distributed sees {actual}. Launch with `accelerate launch "
                               "--use_deepspeed --num_processes N` or `torchrun --nproc_per_node N`, and on "
                               "CPU keep the gloo backend.")

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def num_processes(self) -> int:
        """The processes that train (with generation ranks, the launch's others only generate)."""
        return self.layout.training_processes if self.layout else self.accelerator.num_processes

    @property
    def generates(self) -> bool:
        """Whether this rank only generates (``generation_processes``): it holds no engine, only a decoded role's copy."""
        return self.groups is not None and self.groups.generates

    def wait_for_everyone(self) -> None:
        """A barrier over the training processes (a generation rank passes straight through)."""
        if self.groups is None:
            self.accelerator.wait_for_everyone()
        elif not self.groups.generates:
            torch.distributed.barrier(group=self.groups.train)

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    def role(self, name: str) -> Role:
        if self.closed:
            raise ConfigError("this session is closed (Session.close(), or the trainer's end()): its plugins and "
                              "accelerate's state are gone; build a new Session (or trainer) to go on")
        if name not in self.roles:
            raise ConfigError(f"unknown role {name!r}: this session's roles are {list(self.roles)}; declare "
                              "it with Role(name, config) or roles_for(...) so that it gets a DeepSpeed "
                              "plugin")
        return self.roles[name]

    def zero_stage(self, name: str) -> int:
        return dsconfig.zero_stage(self.configs[self.role(name).name])

    def master_weights(self, name: str) -> str | None:
        """A trained role's optimizer precision ("fp32" or "bf16"); None for a frozen role."""
        role = self.role(name)
        return dsconfig.master_weights(self.configs[name]) if role.trains else None

    # -- activation --------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self, name: str) -> Iterator[Any]:
        """Make ``name``'s plugin the active one; the previous role is active again on exit."""
        self.role(name)
        self._select(name)
        self._active.append(name)
        try:
            yield self.engines.get(name)
        finally:
            self._active.pop()
            self._select(self._active[-1])

    def _select(self, name: str) -> None:
        self.accelerator.state.select_deepspeed_plugin(name)

    # -- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session: finish its trackers and leave the process as it was (transformers out of ZeRO-3
        mode, accelerate's state and the environment reset, the world of one it made taken down; a launcher's
        group stays up for later sessions). Collective (as ``Trainer.end``); after saving; twice is once."""
        if self.closed:
            return
        self.closed = True
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers = []
        if self._leave_deepspeed_world is not None:
            self._leave_deepspeed_world()
        if self.groups is not None:
            self.groups.destroy()
        # A newer session owns the process-wide state now; tearing it down would break that one.
        if _current is not None and _current() is self:
            leave_process()

    @property
    def active_role(self) -> str:
        from accelerate.utils.deepspeed import get_active_deepspeed_plugin

        active = get_active_deepspeed_plugin(self.accelerator.state)
        return next(n for n, p in self.accelerator.state.deepspeed_plugins.items() if p is active)

    # -- models ------------------------------------------------------------------------------
    def _fill_hidden_size(self, name: str, model_config: Any) -> None:
        cfg = self.accelerator.state.deepspeed_plugins[name].deepspeed_config
        dsconfig.resolve_hidden_size(cfg, dsconfig.hidden_size_of(model_config), name)
        self.configs[name] = cfg

    def load(self, name: str, name_or_path: str | os.PathLike | torch.nn.Module | None = None, *,
             config: Any = None, model_cls: Any = None, **kwargs: Any) -> torch.nn.Module:
        """Build a role's model (``from_pretrained``/``from_config``/as given); frozen: eval, no grad. On a generation
        rank, a trained role's whole copy on this device, in the dtype its engine holds (no DeepSpeed, no zero.Init)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        role = self.role(name)
        if self.generates and not role.trains:
            raise ConfigError(f"role {name!r} is frozen and frozen roles run on the training ranks: load it on those "
                              "only (this rank only generates, generation_processes)")
        if isinstance(name_or_path, torch.nn.Module):
            if self.generates:
                return self._generation_copy(name_or_path)
            if not role.trains:
                name_or_path.eval()
                name_or_path.requires_grad_(False)
            return name_or_path
        model_cls = model_cls or AutoModelForCausalLM
        if name_or_path is None and config is None:
            raise ConfigError(f"role {name!r}: give a hub name or local path, or a model config")
        if config is None:
            check_model_path(name_or_path, f"role {name!r}: model")
            # Config attributes among kwargs (num_labels, ...) go to the config, the rest to the model.
            hub = _hub_kwargs(kwargs)
            rest = {k: v for k, v in kwargs.items() if k not in hub}
            config, rest = AutoConfig.from_pretrained(name_or_path, return_unused_kwargs=True, **hub, **rest)
            kwargs = {**hub, **rest}
        self._fill_hidden_size(name, config)
        rng_before = torch.get_rng_state()
        with self._outside_plugins() if self.generates else self.activate(name):
            if name_or_path is not None:
                model = model_cls.from_pretrained(name_or_path, config=config, **kwargs)
            else:
                model = model_cls.from_config(config, **kwargs)
        rng_after = torch.get_rng_state()
        if not torch.equal(rng_before, rng_after):  # TRL's adapters start from the state loading left
            self.load_rng[name] = (rng_before, rng_after)
        if self.generates:
            return self._generation_copy(model)
        if self.zero_stage(name) == 3:
            recompute_rotary_buffers(model)
        if not role.trains:
            model.eval()
            model.requires_grad_(False)
        return model

    @contextlib.contextmanager
    def _outside_plugins(self) -> Iterator[None]:
        """No plugin's DeepSpeed config for transformers (a generation rank's copy is whole); re-selected after."""
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            self._select(self._active[-1])

    def _generation_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        dtype = module_dtype(self.mixed_precision)
        return model.to(device=self.device, dtype=dtype) if dtype is not None else model.to(self.device)

    def prepare(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                scheduler: Any = None) -> Any:
        """Wrap ``model`` in its role's engine; trained roles need ``optimizer``; ``scheduler`` is saved."""
        from accelerate.utils import DummyOptim

        role = self.role(name)
        if self.generates:
            raise ConfigError(f"role {name!r}: this rank only generates (generation_processes) and holds no engine: "
                              "prepare roles on the training ranks; here use the copy Session.load returns")
        if name in self.engines:
            raise ConfigError(f"role {name!r} is already prepared; a role holds one model")
        cfg = self.configs[name]
        if not role.trains and (optimizer is not None or scheduler is not None):
            raise ConfigError(f"role {name!r} is frozen and cannot take an optimizer or scheduler: drop "
                              "them, or declare the role with trains=True and a training config")
        if name in self.plain_roles:
            return self._prepare_plain(name, model, optimizer, scheduler)
        if role.trains and optimizer is None:
            if "optimizer" not in cfg:
                raise ConfigError(f"role {name!r} trains: pass an optimizer to prepare(), or add an "
                                  "'optimizer' block to its DeepSpeed config")
            optimizer = DummyOptim(model.parameters())
        fast = self._fast_frozen(name)
        if hasattr(model, "config"):
            self._fill_hidden_size(name, model.config)
        accelerator = self._accelerators[name]
        with self.activate(name):
            if role.trains:
                engine, optimizer = accelerator.prepare(model, optimizer)
            else:
                engine = accelerator.prepare(model)
        self._pin_accumulation()
        if role.trains:
            if self.num_processes == 1 and share_bf16_master(engine.optimizer):
                print(f"[posttrain] one process: role {name!r}'s bf16 master weights are the model's own weights "
                      "(no second copy)", flush=True)
            cast_grads_while_flattening(engine.optimizer)
            # The torch optimizer DeepSpeed steps: inside a ZeRO or bf16 wrapper, or the engine's own.
            plain.use_fused_adamw(getattr(engine.optimizer, "optimizer", engine.optimizer))
            self.optimizers[name] = optimizer
            if scheduler is not None:
                self.schedulers[name] = scheduler
                accelerator.register_for_checkpointing(scheduler)
            engine.train()
        else:
            engine.eval()
            if fast:
                from posttrain.placement.frozen import take_over

                self.fast_frozen[name] = take_over(engine)
        self.engines[name] = engine
        return engine

    def _prepare_plain(self, name: str, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> Any:
        """A trained role at world size 1 without DeepSpeed (posttrain.placement.plain)."""
        from accelerate.utils import DummyOptim

        if optimizer is None or isinstance(optimizer, DummyOptim):
            raise ConfigError(f"role {name!r} trains without a DeepSpeed engine (single_process_engine): pass a torch "
                              "optimizer to prepare(), or set single_process_engine deepspeed to use the config's block")
        cfg = self.configs[name]
        engine = plain.PlainEngine(model, optimizer, device=self.device,
                                   gradient_accumulation_steps=self.gradient_accumulation_steps,
                                   gradient_clipping=cfg.get("gradient_clipping", 0.0),
                                   mixed_precision=self.mixed_precision, master_weights=dsconfig.master_weights(cfg))
        engine.train()
        self.optimizers[name] = optimizer
        if scheduler is not None:
            self.schedulers[name] = scheduler
        self.engines[name] = engine
        return engine

    def engine_kind(self, name: str) -> str:
        """What runs a role: "torch" (posttrain.placement.plain, no DeepSpeed engine) or "deepspeed"."""
        return "torch" if self.role(name).name in self.plain_roles else "deepspeed"

    def _fast_frozen(self, name: str) -> bool:
        """Whether posttrain.placement.frozen takes over the role's gathering (see Role.fast_frozen)."""
        role, cfg = self.role(name), self.configs[name]
        offloaded = dsconfig.params_offloaded(cfg)
        applies = not role.trains and dsconfig.zero_stage(cfg) == 3 and not offloaded
        if role.fast_frozen and not applies:
            why = ("its parameters are offloaded (the fast path keeps its shards on the device)" if offloaded
                   else "it applies to frozen ZeRO-3 roles only")
            raise ConfigError(f"role {name!r}: fast_frozen cannot apply: {why}; drop fast_frozen, or give "
                              "the role a ZeRO-3 inference config such as zero3_inference")
        return applies if role.fast_frozen is None else role.fast_frozen

    def numel_at_rest(self, name: str) -> tuple[int, int]:
        """(elements this rank stores between forwards, elements of the whole model) of a prepared role."""
        if name in self.fast_frozen:
            return self.fast_frozen[name].local_numel(), self.fast_frozen[name].full_numel()
        params = list(self.engines[name].module.parameters())
        if all(hasattr(p, "ds_tensor") for p in params):
            return sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)
        n = sum(p.numel() for p in params)
        return n, n

    def bytes_outside_allocator(self) -> int:
        """Device memory the session's models hold outside PyTorch's caching allocator."""
        return sum(f.bytes_outside_allocator() for f in self.fast_frozen.values())

    def unwrap(self, name: str) -> torch.nn.Module:
        return self.engines[name].module

    def accelerator_for(self, name: str) -> Any:
        """The Accelerator that holds the role's engine (for accelerate/TRL helpers that take one)."""
        self.role(name)
        return self._accelerators[name]

    def release(self, name: str) -> None:
        """Drop a frozen role's engine and free its memory (e.g. after precomputing its outputs)."""
        if self.role(name).trains:
            raise ConfigError(f"role {name!r} trains; only frozen roles can be released")
        engine = self.engines.pop(name, None)
        if engine is None:
            return
        fast = self.fast_frozen.pop(name, None)
        if fast is not None:
            fast.remove()
        engine.destroy()  # removes ZeRO-3's hooks from the module
        self._accelerators[name].free_memory()
        del engine
        import gc

        gc.collect()

    # -- training ----------------------------------------------------------------------------
    def backward(self, name: str, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """Backward through the role's engine (which scales by 1/accumulation steps). ``boundary``: whether this
        micro-batch ends the optimizer step (an epoch's last step may be short, as in TRL); None: every N-th."""
        engine = self._trained_engine(name)
        if boundary is not None:  # before backward: ZeRO reduces the gradients at the boundary
            engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss)

    def step(self, name: str) -> bool:
        """Engine step, then scheduler at an accumulation boundary; returns whether the optimizer stepped."""
        engine = self._trained_engine(name)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:  # read before the schedulers move it on (a DeepSpeed-config scheduler steps in engine.step)
            self._step_lr[name] = float(engine.get_lr()[0])
        engine.step()
        if boundary and name in self.schedulers:
            self.schedulers[name].step()
        return boundary

    def grad_norm(self, name: str) -> float | None:
        norm = self._trained_engine(name).get_global_grad_norm()
        return None if norm is None else float(norm)

    def learning_rate(self, name: str) -> float:
        """The rate of the role's last optimizer step (or, before any, the first one's), as Trainer logs."""
        engine = self._trained_engine(name)
        return self._step_lr.get(name, float(engine.get_lr()[0]))

    def _trained_engine(self, name: str) -> Any:
        if not self.role(name).trains:
            raise ConfigError(f"role {name!r} is frozen: it has no backward or optimizer step")
        if name not in self.engines:
            raise ConfigError(f"role {name!r} is not prepared yet: call session.prepare({name!r}, model, optimizer)")
        return self.engines[name]


def _hub_kwargs(kwargs: dict) -> dict:
    keys = ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only")
    return {k: kwargs[k] for k in keys if k in kwargs}
