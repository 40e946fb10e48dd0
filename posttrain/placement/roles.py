"""Roles: which models a run holds, whether each trains, and which DeepSpeed config each gets (a
*mix* gives the trained roles one config and the frozen roles another; per-role configs override)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from posttrain.errors import ConfigError
from posttrain.placement.dsconfig import read_config, with_master_weights


@dataclass
class Role:
    """A model role. ``config`` is a preset name (``posttrain/presets/deepspeed/<name>.json``), a JSON path, or a dict."""

    name: str
    config: str | dict
    trains: bool = False
    # Frozen ZeRO-3 roles: keep DeepSpeed's memory-efficient linear (process-wide, slows the policy).
    memory_efficient_linear: bool = field(default=False, repr=False)
    # Frozen ZeRO-3 roles: posttrain.placement.frozen gathers (None: where it applies; False: off;
    # True: required).
    fast_frozen: bool | None = None
    # The config came from a mix: at one process the Session may simplify it (dsconfig.one_rank).
    from_mix: bool = field(default=False, repr=False)
    # Trained roles: posttrain.rollout decodes from its weights (plain.uses_torch reads it).
    decoded: bool = False


# mix name -> (config of trained roles, config of frozen roles)
MIXES: dict[str, tuple[str, str]] = {
    # posttrain's default: the policy trains fast under ZeRO-2, frozen models are sharded.
    "zero2-zero3": ("zero2_train", "zero3_inference"),
    # Everything sharded: the most memory-frugal, the slowest.
    "zero3": ("zero3_train", "zero3_inference"),
    # What TRL does with a ZeRO-2 policy: a full copy of each frozen model on every GPU.
    "zero2-replicated": ("zero2_train", "replicated_inference"),
    # Frozen models sharded and their parameters kept in CPU memory.
    "zero2-zero3-offload": ("zero2_train", "zero3_inference_offload"),
    # zero2-zero3 with DeepSpeed's own per-parameter gathering for the frozen roles (for comparison).
    "zero2-zero3-stock": ("zero2_train", "zero3_inference")}
# Mixes whose frozen roles keep DeepSpeed's gathering: Role(fast_frozen=False).
STOCK_GATHER_MIXES = {"zero2-zero3-stock"}
DEFAULT_MIX = "zero2-zero3"
# Each trainer's trained, possible frozen, and always-decoded roles (the planner imports no trainer).
TRAINER_ROLES: dict[str, dict[str, list[str]]] = {
    "dpo": {"trained": ["policy"], "frozen": ["reference"]},  # with use_peft, no reference role
    "kto": {"trained": ["policy"], "frozen": ["reference"]},  # with use_peft, no reference role
    # With use_peft, no reference role; the reward role only with a reward model.
    "ppo": {"trained": ["policy", "value"], "frozen": ["reference", "reward"], "decoded": ["policy"]},
    "distill": {"trained": ["student"], "frozen": ["teacher"]},  # decodes its student only on-policy (lmbda > 0)
    # Reference only with beta > 0; each reward model is a frozen role of its own (reward, reward_1, ...).
    "grpo": {"trained": ["policy"], "frozen": ["reference"], "decoded": ["policy"]},
    "rloo": {"trained": ["policy"], "frozen": ["reference"], "decoded": ["policy"]},
    "sft": {"trained": ["policy"], "frozen": []},
    "reward": {"trained": ["reward"], "frozen": []}}
# The trained presets with bf16 master weights and optimizer states (master_weights: bf16).
BF16_STATE_PRESETS = {"zero2_train": "zero2_train_bf16_states", "zero3_train": "zero3_train_bf16_states"}


def trained_config(config: str | dict, master_weights: str, role: str) -> str | dict:
    """Trained config at ``master_weights``: a preset's ``_bf16_states`` twin, else DeepSpeed's bf16 keys."""
    if master_weights == "bf16" and isinstance(config, str) and config in BF16_STATE_PRESETS:
        return BF16_STATE_PRESETS[config]
    checked = with_master_weights(read_config(config), master_weights, f"role {role!r}")
    return config if master_weights == "fp32" else checked


def check_mix(mix: str) -> None:
    """Refuse a mix that does not exist, with the nearest name."""
    if mix not in MIXES:
        near = difflib.get_close_matches(str(mix).lower().replace("_", "-"), list(MIXES), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"unknown mix {mix!r}{hint}: choose one of {', '.join(MIXES)}, or map each role to a "
                          "config in role_configs")


def check_placement(mix: str, role_configs: Mapping | None) -> None:
    """The mix exists and every role config reads, checked before anything is written or loaded."""
    check_mix(mix)
    if role_configs is None:
        return
    if not isinstance(role_configs, Mapping):
        raise ConfigError(f"role_configs must map a role name to a DeepSpeed config (preset name or JSON path), got "
                          f"{role_configs!r}: set it in the YAML as role_configs: {{reference: zero3_inference}}")
    for role, config in role_configs.items():
        try:
            read_config(config)
        except ConfigError as err:
            raise ConfigError(f"role_configs {role}: {err}") from None


def roles_for(trained: Iterable[str], frozen: Iterable[str] = (), mix: str = DEFAULT_MIX,
              configs: Mapping[str, str | dict] | None = None, master_weights: str = "fp32",
              decoded: Iterable[str] = ()) -> list[Role]:
    """Roles from ``mix``, ``configs`` per role; trained get ``master_weights``; ``decoded``: rollout's."""
    check_mix(mix)
    trained, frozen, decoded = list(trained), list(frozen), set(decoded)
    configs = dict(configs or {})
    unknown = set(configs) - set(trained) - set(frozen)
    if unknown:
        raise ConfigError(f"config given for unknown role(s) {sorted(unknown)}: this run's roles "
                          f"are {trained + frozen}")
    if not decoded <= set(trained):
        raise ConfigError(f"decoded role(s) {sorted(decoded - set(trained))} are not trained roles of this run "
                          f"({trained}): only a trained role's engine choice depends on it")
    train_cfg, frozen_cfg = MIXES[mix]
    stock = mix in STOCK_GATHER_MIXES  # kept as named: it exists to compare DeepSpeed's own gathering
    return [Role(n, trained_config(configs.get(n, train_cfg), master_weights, n), trains=True,
                 from_mix=n not in configs and not stock, decoded=n in decoded) for n in trained] + [
        Role(n, configs.get(n, frozen_cfg), trains=False, fast_frozen=False if stock else None,
             from_mix=n not in configs and not stock) for n in frozen]


def roles_from_yaml(source: str | Path | Mapping, trained: Iterable[str],
                    frozen: Iterable[str] = ()) -> list[Role]:
    """Read ``mix:``, ``roles: {name: config}`` and ``master_weights:`` from a YAML file (or its parsed mapping)."""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        try:
            data = yaml.safe_load(Path(source).read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{source}: invalid YAML: {err}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping with 'mix' and/or 'roles'")
    roles = data.get("roles") or {}
    if not isinstance(roles, Mapping):
        raise ConfigError(f"{source}: 'roles' must map a role name to a DeepSpeed config")
    return roles_for(trained, frozen, mix=data.get("mix") or DEFAULT_MIX, configs=roles,
                     master_weights=data.get("master_weights") or "fp32")
