"""Reward functions in TRL 1.16's convention: spec names, calling (as
``GRPOTrainer._calculate_rewards``), return checks, and the warnings TRL leaves silent."""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import logging
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.placement.ranks import gather_objects, sum_over_ranks

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list]
# TRL 1.16's grpo/rloo scripts' registry: name -> the function (or factory call) they use.
BUILTIN: dict[str, Callable[[], RewardFunc]] = {
    "accuracy_reward": lambda: _trl_reward("accuracy_reward"),
    "reasoning_accuracy_reward": lambda: _trl_reward("reasoning_accuracy_reward"),
    "think_format_reward": lambda: _trl_reward("think_format_reward"),
    "get_soft_overlong_punishment": lambda: _trl_reward("get_soft_overlong_punishment")(
        max_completion_len=1280, soft_punish_cache=256),
}
_NEEDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward")
# Keyword arguments the trainer itself passes (TRL's), never dataset columns.
TRAINER_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                  "environments")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


class RewardFuncError(ConfigError):
    """A reward function failed or returned something that is not one reward per completion."""


def _trl_reward(name: str) -> RewardFunc:
    import trl.rewards

    return getattr(trl.rewards, name)


def func_name(fn: Callable) -> str:
    """The name TRL logs a reward function under (``rewards/<name>/mean``)."""
    from trl.trainer.utils import get_callable_name

    return get_callable_name(fn)


def is_async(fn: Callable) -> bool:
    from trl.trainer.utils import is_async_callable

    return is_async_callable(fn)


def spec_kind(spec: str) -> str:
    """``"function"`` or ``"model"`` by spelling alone (a Python reference never reaches the hub)."""
    if spec in BUILTIN:
        return "function"
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix == ".py":
        raise ConfigError(f"reward function {spec!r} is a file: name a function in it, as "
                          f"'{local.stem}.function' (run from its folder)")
    if local.exists():
        return "model"
    if ":" in spec or _DOTTED.fullmatch(spec):
        return "function"
    if spec.isidentifier():
        near = difflib.get_close_matches(spec, list(BUILTIN), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            f"unknown reward function {spec!r}: {hint}use one of TRL's built-in reward functions "
            f"({', '.join(BUILTIN)}), a Python reference 'module.function', or a reward model's folder or hub id "
            "(org/name)")
    return "model"


def load_reward_func(spec: str) -> RewardFunc:
    """The function a spec names; the current directory is importable, as in TRL's scripts."""
    if spec in BUILTIN:
        if spec in _NEEDS_MATH_VERIFY:
            from trl.import_utils import is_math_verify_available

            if not is_math_verify_available():
                raise ConfigError(f"reward function {spec!r} (TRL's) needs the math_verify package: "
                                  "pip install math-verify")
        return BUILTIN[spec]()
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"reward function {spec!r}: write it as 'module.function' (or 'module:function')")
    if module_name.endswith(".py"):
        raise ConfigError(f"reward function {spec!r}: name the module, not its file: "
                          f"'{module_name[:-3].replace('/', '.')}.{attr}'")
    if os.getcwd() not in sys.path:  # TRL's scripts make the current directory importable
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, or the module's own error
        if (isinstance(e, ModuleNotFoundError) and e.name is not None and module_name.startswith(e.name)
                and module_name[len(e.name):][:1] in ("", ".")):
            raise ConfigError(
                f"reward function {spec!r}: importing {module_name!r} failed: there is no module {e.name!r} in the "
                "current directory or on the import path; check the spelling, or run from the folder holding it (or "
                "add that folder to PYTHONPATH)"
            ) from e
        raise ConfigError(f"reward function {spec!r}: importing {module_name!r} failed with {type(e).__name__}: {e}. "
                          "Install what it needs, or put the folder holding it on PYTHONPATH.") from e
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                            and not inspect.isclass(v))
            raise ConfigError(f"reward function {spec!r}: {module_name} has no {attr!r}; its functions are "
                              f"{public[:20]}")
    if not callable(fn) or inspect.isclass(fn):
        what = f"the class {fn.__name__}" if inspect.isclass(fn) else f"of type {type(fn).__name__}"
        raise ConfigError(f"reward function {spec!r} is not a function ({what}): name a function that takes "
                          "completions and returns one reward each")
    return fn


def load_reward_funcs(specs: Sequence[str]) -> list[RewardFunc]:
    """:func:`load_reward_func` for each spec; a model spec among them is refused."""
    funcs = []
    for spec in specs:
        if spec_kind(spec) != "function":
            raise ConfigError(f"reward function {spec!r}: write it as 'module.function' (or 'module:function') "
                              f"or one of TRL's built-in names ({', '.join(BUILTIN)})")
        funcs.append(load_reward_func(spec))
    return funcs


def check_columns(fn: Callable, columns: Sequence[str]) -> None:
    """Refuse a function whose required arguments are neither trainer keywords nor dataset columns."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins, some C callables: nothing to check
        return
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in TRAINER_KWARGS and p.name not in columns]
    if missing:
        raise ConfigError(f"reward function {func_name(fn)!r} needs the dataset column(s) {missing}, which the "
                          f"dataset does not have (its columns: {sorted(columns)}): use a dataset with them")


_LOOP: asyncio.AbstractEventLoop | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop per process on a daemon thread for async reward functions and tools, as TRL keeps."""
    global _LOOP
    if _LOOP is None:
        from trl.trainer.utils import start_event_loop_in_daemon

        _, loop, ready = start_event_loop_in_daemon(name="posttrain-reward-loop")
        ready.wait()
        _LOOP = loop
    return _LOOP


def _raised(name: str, err: Exception) -> RewardFuncError:
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return RewardFuncError(f"reward function {name!r} raised {type(err).__name__}: {err}{where}")


def check_rewards(name: str, values: Any, n: int) -> list[float]:
    """One float per completion (None as NaN) from what a reward function returned; else raises."""
    what = f"return a list of {n} rewards (floats, or None for a completion it does not score)"
    kind = type(values).__name__
    if hasattr(values, "tolist"):  # a numpy array or tensor (a 0-d one gives a number: refused below)
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFuncError(f"reward function {name!r} returned a {kind}, not a list: {what}")
    if len(values) != n:
        raise RewardFuncError(f"reward function {name!r} returned {len(values)} rewards for {n} completions: {what}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real):  # int, float, bool, numpy scalars
            out.append(float(v))
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            out.append(float(v.item()))
        else:
            raise RewardFuncError(f"reward function {name!r} returned a {type(v).__name__} ({v!r:.40}) for completion "
                                  f"{i}: {what}")
    return out


def call_reward_funcs(funcs: Sequence[RewardFunc], prompts: list, completions: list,
                      completion_ids: list[list[int]] | None = None, device: torch.device | str = "cpu",
                      **kwargs: Any) -> torch.Tensor:
    """Run each function with TRL's keyword arguments plus ``kwargs``: float32 ``(batch, len(funcs))``."""
    n = len(prompts)
    out = torch.zeros(n, len(funcs), dtype=torch.float32, device=device)
    call = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs}
    pending = []
    for i, fn in enumerate(funcs):
        if is_async(fn):
            pending.append((i, fn))
            continue
        try:
            values = fn(**call)
        except RewardFuncError:
            raise
        except Exception as e:
            raise _raised(func_name(fn), e) from e
        out[:, i] = torch.tensor(check_rewards(func_name(fn), values, n), dtype=torch.float32, device=device)
    if pending:
        async def run_all() -> list:
            return await asyncio.gather(*(fn(**call) for _, fn in pending), return_exceptions=True)

        results = asyncio.run_coroutine_threadsafe(run_all(), event_loop()).result()
        for (i, fn), values in zip(pending, results, strict=True):
            if isinstance(values, Exception):
                raise _raised(func_name(fn), values) from values
            out[:, i] = torch.tensor(check_rewards(func_name(fn), values, n), dtype=torch.float32, device=device)
    return out


def weighted_sum(per_func: torch.Tensor, weights: Sequence[float] | torch.Tensor,
                 unscored: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's weighted sum of rewards, NaN left out; NaN on ``unscored`` rows (default: none scored)."""
    values = weights.tolist() if isinstance(weights, torch.Tensor) else list(weights)
    w = torch.tensor(values, dtype=per_func.dtype, device=per_func.device)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1) if unscored is None else unscored] = torch.nan
    return total


class RewardWarnings:
    """Warnings about a generation batch's rewards, each said once per run on the main process."""

    def __init__(self, names: Sequence[str], main_process: bool = True) -> None:
        self.names, self.main, self.said = list(names), main_process, set()

    def _once(self, key: tuple, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            if self.main:
                logger.warning(message)

    def check(self, per_func: torch.Tensor) -> None:
        nan = torch.isnan(per_func)
        for j, name in enumerate(self.names):
            if nan[:, j].all():
                self._once(("none", name), f"reward {name!r} returned None (or NaN) for every completion of a "
                           f"generation batch ({per_func.shape[0]} completions): it adds nothing to their rewards")
            if torch.isinf(per_func[:, j]).any():
                self._once(("inf", name), f"reward {name!r} returned an infinite reward: the rewards and advantages of "
                           "its group become inf or NaN (NaN advantages are set to 0); return finite values")
        unscored = nan.all(dim=1)
        if unscored.all():
            self._once(("all",), "every reward returned None (or NaN) for every completion of a generation batch: "
                       "every advantage is 0 and the policy learns nothing from it")
        elif unscored.any():
            self._once(("rows",), f"{int(unscored.sum())} of {per_func.shape[0]} completions got None from every reward "
                       "(TRL warns the same): they are left out of the group statistics and get advantage 0; make at "
                       "least one reward score every completion")


def raise_on_every_rank(session: Any, failure: Exception | None) -> None:
    """Re-raise a rank's reward-function failure on every rank, so none waits in a collective."""
    if session.num_processes > 1:
        said = [m for m in gather_objects(session, [str(failure) if failure else ""]) if m]
        if said and failure is None:
            raise RewardFuncError(said[0])
    if failure is not None:
        raise failure


def mean_of_logged_metrics(session: Any, logged: dict[str, list[float]]) -> dict[str, float]:
    """Metrics reward functions logged (``log_metric``), each averaged over every process's calls."""
    names = list(logged)
    if session.num_processes > 1:
        names = gather_objects(session, names)
    out = {}
    for name in sorted(set(names)):
        values = logged.get(name, [])
        t = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=session.device)
        total, count = sum_over_ranks(session, t).tolist()
        out[name] = total / count if count else math.nan
    return out
