"""TRL 1.16's multi-turn tool use for GRPO/RLOO (``tools=``, ``environment_factory=``, ``rollout_func=``,
``max_tool_calling_iterations``) on posttrain's engine: each sequence keeps its KV slot across turns; when its
turn ends the host parses the turn as TRL does, runs the tools and appends their result rendered through the
chat template (TRL's ``_get_tool_suffix_ids``) without re-tokenizing what the model sampled.

Where TRL crashes, posttrain counts a failure and goes on: a tool result the chat template cannot render, a
tool call whose arguments are no mapping. Without ``max_tool_calling_iterations`` the iterations are bounded
by the completion budget (every tool output takes tokens of ``max_completion_length``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import torch

from posttrain.errors import ConfigError

RESERVED = ("reset", "get_reward")  # an environment's methods that are no tools


def _methods(env: Any) -> list[Callable]:
    """An environment's public methods but reset/get_reward (its tools), listed on the class as TRL does."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _check_tool(tool: Any, where: str) -> None:
    from transformers.utils import get_json_schema

    if not callable(tool):
        raise ConfigError(f"{where}: {tool!r} is not callable: pass Python functions (type hints and a docstring)")
    try:
        get_json_schema(tool)
    except Exception as err:  # noqa: BLE001 - transformers raises several kinds here
        raise ConfigError(f"{where}: tool {getattr(tool, '__name__', tool)!r} cannot be described to the model "
                          f"({type(err).__name__}: {err}): give it type hints and a docstring with an Args section, "
                          "as transformers' chat templates need") from err


def check_tokenizer(tokenizer: Any) -> None:
    """The chat template renders tool calls and results and a response template parses the model's calls."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise ConfigError("the tokenizer's chat template does not render tool calls and tool results (TRL's "
                          "supports_tool_calling): give a template that does (processing_class=, or "
                          "tokenizer.chat_template = ...); for the tiny default use posttrain.demo.tool_chat.with_tools")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError as err:
            raise ConfigError("no response template parses this chat template's tool calls: set "
                              "tokenizer.response_template (transformers' response parsing) and save it with the "
                              "tokenizer") from err


def check_config(cfg: Any) -> None:
    """``max_tool_calling_iterations`` as a sentence, before anything loads."""
    its = getattr(cfg, "max_tool_calling_iterations", None)
    if its is not None and (isinstance(its, bool) or not isinstance(its, int) or its < 0):
        raise ConfigError(f"max_tool_calling_iterations must be a whole number >= 0 or null (no limit but the "
                          f"completion budget), got {its!r}: set --max_tool_calling_iterations")


class ToolUse:
    """The tools of a GRPO/RLOO run, its environments and the host side of each multi-turn rollout."""

    def __init__(self, tools: list | None, environment_factory: Any, tokenizer: Any, cfg: Any,
                 max_model_len: int | None) -> None:
        from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

        if getattr(cfg, "generation_shared_prompt_kv", False):
            raise ConfigError("multi-turn tool use does not run with generation_shared_prompt_kv: set it false")
        tools = list(tools or [])
        for tool in tools:
            _check_tool(tool, "tools")
        self.tokenizer, self.cfg, self.max_model_len = tokenizer, cfg, max_model_len
        self.standalone = tools
        self.multi = isinstance(environment_factory, dict)
        if environment_factory is None:
            self.factories = None
        elif self.multi:
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self.env_tools: dict[Any, list] = {}
        self.pool: dict[Any, list] = {}
        self.env_rewards: list[Callable] = []  # environments' get_reward, as extra reward functions (TRL's)
        self.tools = list(tools)
        for name, factory in (self.factories or {}).items():
            if not callable(factory):
                raise ConfigError(f"environment_factory{'' if name is None else f'[{name!r}]'} is not callable: pass a "
                                  "class or function returning an environment")
            instance = factory()
            if not callable(getattr(type(instance), "reset", None)):
                raise ConfigError(f"the environment {type(instance).__name__} has no reset method: define "
                                  "reset(self, **row) (it may return text added to the prompt)")
            methods = _methods(instance)
            for m in methods:
                _check_tool(m, f"environment {type(instance).__name__}")
            self.env_tools[name] = tools + methods
            self.pool[name] = [instance]
            self.tools += [m for m in methods if m not in self.tools]
            if callable(getattr(type(instance), "get_reward", None)) and not any(
                    f._env_type is type(instance) for f in self.env_rewards):
                self.env_rewards.append(_env_reward(type(instance)))
        if not self.tools:
            raise ConfigError("tools= is empty and the environments have no public methods: give at least one tool")
        check_tokenizer(tokenizer)
        # TRL's rule: multi-turn needs a prefix-preserving template, else TRL's training template replaces it.
        self.chat_template = None if is_chat_template_prefix_preserving(tokenizer) else (
            get_training_chat_template(tokenizer))
        self.max_iterations = cfg.max_tool_calling_iterations
        self.environments: list | None = None
        self._prefixes: dict[str, list[int]] = {}  # each tool's rendered dummy call (the suffix's prefix)

    # -- a batch -------------------------------------------------------------------------------------
    def start(self, rows: list[dict]) -> list[Any]:
        """Draw this batch's environments from the pool (reset with each row, TRL's order) and the per-row
        tools; the prompts as the model reads them (a reset's observation appended to the last message)."""
        prompts = [r.get("prompt", [{"role": "user", "content": ""}]) if self.factories else r["prompt"]
                   for r in rows]
        self.names = [r.get("environment") if self.multi else None for r in rows]
        self.environments = None
        if self.factories is not None:
            unknown = sorted({repr(n) for n in self.names if n not in self.factories})
            if unknown:
                raise ConfigError(f"rows name environments {', '.join(unknown)} that environment_factory does not "
                                  f"have (it has {list(self.factories)})")
            self.environments, cursor = [], {}
            for name in self.names:
                pool, k = self.pool[name], cursor.get(name, 0)
                if k == len(pool):
                    pool.append(self.factories[name]())
                cursor[name] = k + 1
                self.environments.append(pool[k])
        self.sync_tools, self.async_tools = [], []
        for i in range(len(rows)):
            methods = _methods(self.environments[i]) if self.environments else []
            sync, asyn = {}, {}
            for tool in self.standalone + methods:
                (asyn if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
            self.sync_tools.append(sync)
            self.async_tools.append(asyn)
        if self.environments:
            for i, (prompt, env, row) in enumerate(zip(prompts, self.environments, rows, strict=True)):
                kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
                observation = env.reset(**kwargs)
                if observation is None:
                    continue
                prompts[i] = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
        return prompts

    def row_tools(self, i: int) -> list:
        return self.env_tools[self.names[i]] if self.factories is not None else self.tools

    def prompt_ids(self, prompts: list) -> list[list[int]]:
        """Each prompt rendered with its tools and the generation prompt, as TRL's ``_tokenize_prompts``."""
        kw = self.cfg.chat_template_kwargs or {}
        return [list(self.tokenizer.apply_chat_template(
            conversation=p, tools=self.row_tools(i) or None, chat_template=self.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=True, **kw)["input_ids"])
            for i, p in enumerate(prompts)]

    def begin(self, prompt_ids: list[list[int]]) -> None:
        """A rollout of these prompts: fresh conversations and counters."""
        n = len(prompt_ids)
        self.prompts = prompt_ids
        self.completions: list[list[dict]] = [[] for _ in range(n)]
        self.turn_start = [0] * n
        self.iterations = [0] * n
        self.calls = self.failures = 0

    # -- the engine's callback ---------------------------------------------------------------------------
    def on_turn_end(self, seq: int, ids: list[int], room: int) -> list[int] | None:
        """Parse the turn that just ended; run its tool calls and return their rendered result, or None."""
        from trl.chat_template_utils import parse_response

        start = self.turn_start[seq]
        try:
            message = parse_response(self.tokenizer, ids[start:], prefix=self.prompts[seq] + ids[:start],
                                     tools=self.row_tools(seq))
        except Exception:  # noqa: BLE001 - TRL falls back to the text only on ValueError/TypeError
            message = {"role": "assistant", "content": self.tokenizer.decode(ids[start:], skip_special_tokens=True)}
        self.completions[seq].append(message)
        calls = message.get("tool_calls")
        if not calls or (self.max_iterations is not None and self.iterations[seq] >= self.max_iterations):
            return None
        self.iterations[seq] += 1
        results = self._run(seq, calls)
        tool_messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                         for name, result in results]
        suffix = self._suffix(tool_messages)
        total = len(self.prompts[seq]) + len(ids) + len(suffix)
        if len(suffix) > room or (self.max_model_len is not None and total >= self.max_model_len):
            return None  # TRL: a result past the budget is dropped and the sequence ends as it is
        self.completions[seq] += tool_messages
        self.turn_start[seq] = len(ids) + len(suffix)
        return suffix

    def _run(self, seq: int, calls: list[dict]) -> list[tuple[str, Any]]:
        """Every call in TRL's order (sync ones as met, then the async ones); an exception is its error text."""
        sync, asyn = self.sync_tools[seq], self.async_tools[seq]
        results, pending = [], []
        for call in calls:
            self.calls += 1
            if call.get("type") != "function":
                self.failures += 1
                results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}))
                continue
            function = call["function"]
            name = function["name"]
            try:
                arguments = function["arguments"]
                if not isinstance(arguments, dict):  # TRL: a TypeError from **; counted the same
                    raise TypeError(f"{name}() argument after ** must be a mapping, not {type(arguments).__name__}")
                if name in sync:
                    results.append((name, sync[name](**arguments)))
                elif name in asyn:
                    pending.append((name, asyn[name](**arguments)))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as e:  # noqa: BLE001 - a tool's failure goes back to the model (TRL)
                self.failures += 1
                results.append((name, {"error": str(e)}))
        if pending:
            from posttrain.rewards.functions import event_loop

            async def gather() -> list:
                return await asyncio.gather(*(c for _, c in pending), return_exceptions=True)

            for (name, _), result in zip(pending, asyncio.run_coroutine_threadsafe(gather(), event_loop()).result()):
                if isinstance(result, Exception):
                    self.failures += 1
                    result = {"error": str(result)}
                results.append((name, result))
        return results

    def _suffix(self, tool_messages: list[dict]) -> list[int]:
        """TRL's ``_get_tool_suffix_ids``; a result the template cannot render becomes its error (counted)."""
        try:
            return self._render_suffix(tool_messages)
        except Exception as err:  # noqa: BLE001 - TRL crashes here (e.g. a template that cannot render the result)
            self.failures += 1
            return self._render_suffix([{"role": "tool", "name": m["name"], "content": str({"error": str(err)})}
                                        for m in tool_messages])

    def _render_suffix(self, tool_messages: list[dict]) -> list[int]:
        tok, kw = self.tokenizer, self.cfg.chat_template_kwargs or {}
        name = tool_messages[0]["name"]
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        prefix = self._prefixes.get(name)
        if prefix is None:  # the same for every call of a tool: rendered once (a template render per turn saved)
            prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                             chat_template=self.chat_template, return_dict=False, **kw)
            eos = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
            self._prefixes[name] = prefix = list(prefix[: eos[-1] + 1] if eos else prefix)
        full = tok.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                       chat_template=self.chat_template, return_dict=False, **kw)
        if list(full[: len(prefix)]) != list(prefix):
            raise ValueError("the chat template renders the tool result without keeping the conversation before it")
        return list(full[len(prefix):])

    def metrics(self, calls: float, failures: float, completions: int) -> dict[str, float]:
        """TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency``."""
        return {"tools/call_frequency": calls / completions,
                "tools/failure_frequency": failures / calls if calls > 0 else 0.0}


def _env_reward(env_type: type) -> Callable:
    """An environment's ``get_reward`` as a reward function named after its class (TRL's weight 1)."""
    if inspect.iscoroutinefunction(env_type.get_reward):
        async def reward(environments: list, **kwargs: Any) -> list:
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:
        def reward(environments: list, **kwargs: Any) -> list:
            return [e.get_reward() if type(e) is env_type else None for e in environments]
    reward.__name__ = reward.__qualname__ = env_type.__name__
    reward._env_type = env_type
    return reward


def rollout_func_output(output: Any, n: int) -> dict[str, Any]:
    """A ``rollout_func``'s result checked as TRL reads it: ``prompt_ids``, ``completion_ids``, ``logprobs``
    (lists, one per row), optional ``env_mask``; other keys are extra reward-function arguments."""
    if not isinstance(output, dict):
        raise ConfigError(f"rollout_func returned a {type(output).__name__}: return a dict with prompt_ids, "
                          "completion_ids and logprobs (one list per row)")
    missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - output.keys())
    if missing:
        raise ConfigError(f"rollout_func must return keys {missing} in its output dict.")
    for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask"):
        if key in output and len(output[key]) != n:
            raise ConfigError(f"rollout_func returned {len(output[key])} {key} for {n} rows: one per row")
    if any(len(lp) != len(c) for lp, c in zip(output["logprobs"], output["completion_ids"])):
        raise ConfigError("rollout_func's logprobs must have one entry per completion token (the sampler's "
                          "log-prob of each, which GRPO's sampler correction reads)")
    if "env_mask" in output and any(len(m) != len(c) for m, c in zip(output["env_mask"], output["completion_ids"])):
        raise ConfigError("rollout_func's env_mask must have one entry per completion token")
    if any(len(p) == 0 for p in output["prompt_ids"]) or any(len(c) == 0 for c in output["completion_ids"]):
        raise ConfigError("rollout_func returned an empty prompt or completion: every row needs tokens")
    return output


def padded(lists: list[list], value: float, device: Any, left: bool = False,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Lists of ids (or other values) as one tensor, padded on the right (or left)."""
    width = max(len(x) for x in lists)
    rows = [([value] * (width - len(x)) + list(x)) if left else (list(x) + [value] * (width - len(x))) for x in lists]
    return torch.tensor(rows, dtype=dtype, device=device)


class Sampled:
    """A batch sampled with tools or a ``rollout_func``: what ``_sample_and_score`` reads."""

    def __init__(self, prompts: list, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 completion_ids: torch.Tensor, completion_mask: torch.Tensor, tool_mask: torch.Tensor | None,
                 completions: list | None, reward_kwargs: dict[str, Any], logprobs: torch.Tensor,
                 calls: int = 0, failures: int = 0) -> None:
        self.prompts, self.prompt_ids, self.prompt_mask = prompts, prompt_ids, prompt_mask
        self.logprobs = logprobs  # the sampler's, of the model's own tokens: GRPO's sampler correction reads them
        self.completion_ids, self.completion_mask, self.tool_mask = completion_ids, completion_mask, tool_mask
        self.completions, self.reward_kwargs = completions, reward_kwargs
        self.calls, self.failures = calls, failures


def sample(trainer: Any, rows: list[dict]) -> Sampled:
    """Sample ``rows`` through the trainer's ``rollout_func`` or with its tools on its rollout."""
    tok, dev = trainer.tokenizer, trainer.session.device
    pad = tok.pad_token_id
    if trainer.rollout_func is not None:
        prompts = [r["prompt"] for r in rows]
        output = rollout_func_output(trainer.rollout_func(prompts, trainer), len(rows))
        # TRL sets each row's extra field (a list: that row's entry; anything else: the value itself).
        extra = {k: v if isinstance(v, list) else [v] * len(rows) for k, v in output.items()
                 if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        prompt_ids = padded(output["prompt_ids"], pad, dev, left=True)
        prompt_mask = padded([[1] * len(p) for p in output["prompt_ids"]], 0, dev, left=True)
        completions = output["completion_ids"]
        env_mask = output.get("env_mask")
        logprobs = padded(output["logprobs"], 0.0, dev, dtype=torch.float32)
        return Sampled(prompts, prompt_ids, prompt_mask, padded(completions, pad, dev),
                       padded([[1] * len(c) for c in completions], 0, dev),
                       padded(env_mask, 1, dev) if env_mask is not None else None, None, extra, logprobs)
    use = trainer.tool_use
    prompts = use.start(rows)
    ids = use.prompt_ids(prompts)
    use.begin(ids)
    prompt_ids, prompt_mask = padded(ids, pad, dev, left=True), padded([[1] * len(p) for p in ids], 0, dev, left=True)
    out = trainer.rollout.generate_turns(prompt_ids, prompt_mask, use.on_turn_end)
    mask = out.completion_mask.to(dev).long()
    completion_ids = out.completion_ids.to(dev)
    kwargs = {"environments": use.environments} if use.environments is not None else {}
    return Sampled(prompts, prompt_ids, prompt_mask, completion_ids, mask, out.tool_mask.to(dev).long(),
                   use.completions, kwargs, out.logprobs.to(dev), use.calls, use.failures)


def setup(tools: Any, environment_factory: Any, rollout_func: Any, reward_funcs: Any, cfg: Any, tokenizer: Any,
          max_model_len: int | None) -> tuple[ToolUse | None, Any]:
    """The run's :class:`ToolUse` (None without tools) and its reward functions with the environments'
    ``get_reward`` added (TRL's weight 1, appended to ``reward_weights``)."""
    if rollout_func is not None and (tools or environment_factory is not None):
        raise ConfigError("pass rollout_func= or tools=/environment_factory=, not both: a rollout_func runs its own "
                          "tools")
    if rollout_func is not None and not callable(rollout_func):
        raise ConfigError("rollout_func must be callable: rollout_func(prompts, trainer) -> dict")
    if not tools and environment_factory is None:
        return None, reward_funcs
    use = ToolUse(tools, environment_factory, tokenizer, cfg, max_model_len)
    if use.env_rewards:
        given = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [
            reward_funcs]
        if cfg.reward_weights is not None:
            cfg.reward_weights = [*cfg.reward_weights, *[1.0] * len(use.env_rewards)]
        reward_funcs = given + use.env_rewards
    return use, reward_funcs


def check_prompts(use: ToolUse, rows: list[dict]) -> list[list[int]]:
    """Every row's prompt ids as the model will read them (reset on one instance per environment), to size
    the rollout; conversational prompts are required (TRL parses the turns as messages)."""
    from trl.data_utils import is_conversational

    if any("prompt" in r and not is_conversational({"prompt": r["prompt"]}) for r in rows):
        raise ConfigError("tools need conversational prompts (a list of {'role', 'content'} messages): TRL parses "
                          "each turn as a message")
    out = []
    for r in rows:
        prompt = r.get("prompt", [{"role": "user", "content": ""}])
        name = r.get("environment") if use.multi else None
        if use.factories is not None:
            if name not in use.factories:
                raise ConfigError(f"a row names environment {name!r}, which environment_factory does not have "
                                  f"(it has {list(use.factories)})")
            kwargs = {k: v for k, v in r.items() if k != "environment"} if use.multi else r
            observation = use.pool[name][0].reset(**kwargs)
            if observation is not None:
                prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
        use.names = [name]
        out.append(use.prompt_ids([prompt])[0])
    return out
