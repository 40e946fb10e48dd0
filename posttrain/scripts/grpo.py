"""``posttrain grpo``: GRPO as TRL's grpo.py script (TRL's script arguments, ``ModelConfig``); with no model
named, the built-in tiny default and its bundled reward."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl import ModelConfig
from trl.scripts.grpo import GRPOScriptArguments

from posttrain.data.preference import load_dataset_source
from posttrain.data.prompts import check_prompt_rows
from posttrain.demo import synthetic, tiny, tool_task
from posttrain.demo.tool_chat import with_tools
from posttrain.errors import ConfigError
from posttrain.scripts.args import (
    demo_config,
    finish,
    model_arguments,
    parse_config,
    record_script_arguments,
    require_dataset,
    run_script,
)
from posttrain.scripts.data import BUNDLED_PROMPTS, PromptArguments, bundled_prompts, load_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

PHASES = ("time/generate", "time/policy_forward", "time/score", "time/train")


@dataclass
class ToolArguments:
    """Multi-turn tool use (the trainer's tools= and environment_factory=): functions as "module:function" (or
    "module.function"), an environment class as "module:Class". With no model named, the tiny default's tool
    task (posttrain/demo/tool_task.py)."""

    tools: list[str] | None = None
    environment_factory: str | None = None


def tool_objects(args: ToolArguments) -> tuple[list | None, Any]:
    """The named tools and environment factory, imported (each named in one sentence if it cannot be)."""
    from posttrain.rewards.functions import load_reward_func

    def load(spec: str, what: str) -> Any:
        try:
            return load_reward_func(spec) if what == "tool" else _load_class(spec)
        except ConfigError as err:
            raise ConfigError(str(err).replace("reward function", f"--{what}s" if what == "tool" else
                                               "--environment_factory")) from None

    tools = [load(t, "tool") for t in args.tools] if args.tools else None
    return tools, load(args.environment_factory, "environment") if args.environment_factory else None


def _load_class(spec: str) -> Any:
    import importlib
    import os
    import sys

    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"--environment_factory {spec!r}: write it as 'module:Class'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--environment_factory {spec!r}: {type(err).__name__}: {err}; check the spelling, or run "
                          "from the folder holding it") from None
    if not callable(factory):
        raise ConfigError(f"--environment_factory {spec!r} is not callable: name a class (or a function returning "
                          "an environment)")
    return factory


def _wants_tools(argv: list[str] | None) -> bool:
    import sys

    return any(a.split("=")[0] in ("--tools", "--environment_factory") for a in (sys.argv[1:] if argv is None
                                                                                  else argv))


@dataclass
class OnlinePromptArguments(PromptArguments):
    """The bundled prompts (no dataset_name): how many to train on and, with --eval_strategy, to evaluate on."""

    num_eval_prompts: int = 64  # bundled held-out prompts (another seed than the training ones)


def summarize(history: list[dict], cfg: GRPOConfig, seconds: float) -> dict:
    """Mean reward over the first and last tenth of the rows that sampled, and time per phase."""
    scored = [h["reward"] for h in history if isinstance(h.get("reward"), float) and math.isfinite(h["reward"])]
    tenth = max(1, len(scored) // 10)
    first = sum(scored[:tenth]) / tenth if scored else math.nan
    last = sum(scored[-tenth:]) / tenth if scored else math.nan
    # A phase no step ran is left out (the old-policy forward runs only where a batch outlives a step).
    phases = {k: round(sum(h.get(k, 0.0) for h in history), 1) for k in PHASES if any(k in h for h in history)}
    steps = max((h["step"] for h in history if "step" in h), default=0)
    return {"steps": steps, "reward_first_tenth": round(first, 3), "reward_last_tenth": round(last, 3),
            "reward_rise": round(last - first, 3), "seconds_per_phase": phases, "seconds": round(seconds, 1),
            "resumed_from": cfg.resume_from_checkpoint, "mix": cfg.mix, "output_dir": cfg.output_dir}


def reward_funcs(script: Any, model_args: ModelConfig) -> list:
    """TRL's script's rewards: the reward model first, then ``--reward_funcs`` (TRL's names, ``module.function``);
    with no model named and no reward, the tiny default's bundled reward function."""
    named = ([script.reward_model_name_or_path] if script.reward_model_name_or_path else []) + list(
        script.reward_funcs or [])
    if not named and model_args.model_name_or_path is None:
        return [synthetic.sentiment_reward]
    if not named:
        raise ConfigError("no reward is named: set --reward_funcs (one of TRL's reward names, \"module.function\") "
                          "and/or --reward_model_name_or_path (a reward model's folder or hub id)")
    return named


def eval_prompts(script: Any, data: OnlinePromptArguments, cfg: GRPOConfig) -> list[dict] | None:
    """The held-out prompts under --eval_strategy: the dataset's test split, or bundled ones."""
    if cfg.eval_strategy == "no":
        return None
    if script.dataset_name is None:
        return bundled_prompts(data.num_eval_prompts, cfg.seed + 1)
    name, split = script.dataset_name, script.dataset_test_split
    try:
        dataset = load_dataset_source(name, split, script.dataset_config)
    except ConfigError:
        raise
    except (ValueError, KeyError):  # a single file, or a hub dataset without that split
        raise ConfigError(f"--eval_strategy {cfg.eval_strategy}: {name} has no {split!r} split to evaluate on; set "
                          "--dataset_test_split to one of its splits, or --eval_strategy no") from None
    return check_prompt_rows(dataset, f"{name} (split {split!r})", cfg._algorithm)


def run(config_cls: type, trainer_cls: type, name: str, argv: list[str] | None = None,
        script_cls: type = GRPOScriptArguments) -> None:
    """Parse, train, save the policy and print the summary (shared with ``posttrain rloo``)."""
    demo = demo_config(f"{name}_tools" if _wants_tools(argv) else name)
    script, data, cfg, model_args, tool_args = parse_config(
        (script_cls, OnlinePromptArguments, config_cls, ModelConfig, ToolArguments), demo, argv,
        prog=f"posttrain {name}")
    require_dataset([script, model_args])
    tools, environment_factory = tool_objects(tool_args)
    agent_demo = model_args.model_name_or_path is None and (tools or environment_factory)
    model, peft_config = model_arguments(model_args, cfg, tool_task.policy_path if agent_demo else tiny.sft_model_path)
    rewards = reward_funcs(script, model_args)
    start = time.perf_counter()
    if agent_demo and script.dataset_name is None:
        prompts, dataset_name = tool_task.prompts(data.num_prompts, cfg.seed), "posttrain.demo.tool_task"
    else:
        prompts, dataset_name = load_prompts(script, data.num_prompts, cfg.seed, cfg._algorithm)
    held_out = eval_prompts(script, data, cfg)
    agents = {"tools": tools, "environment_factory": environment_factory} if tools or environment_factory else {}
    if agent_demo:  # the tiny default's template with tools (posttrain/demo/tool_chat.py)
        agents["processing_class"] = with_tools(tiny.load_tokenizer(model))
    trainer = trainer_cls(model=model, reward_funcs=rewards, args=cfg, train_dataset=prompts,
                          eval_dataset=held_out, peft_config=peft_config, **agents)
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    history = trainer.state.log_history
    final = trainer.save_model()
    if trainer.is_world_process_zero():
        record_script_arguments(cfg.output_dir, script, data, model_args, tool_args)
        if history:
            summary = summarize(history, cfg, time.perf_counter() - start)
            summary["generation_backend"] = trainer.rollout.stats.get("backend")
            evals = [h for h in history if "eval/reward" in h]
            if evals:
                summary["eval_reward_first"], summary["eval_reward_last"] = (evals[0]["eval/reward"],
                                                                             evals[-1]["eval/reward"])
            if "tools/call_frequency" in history[-1]:
                calls = [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h]
                tenth = max(1, len(calls) // 10)
                summary["tool_calls_first_tenth"] = round(sum(calls[:tenth]) / tenth, 3)
                summary["tool_calls_last_tenth"] = round(sum(calls[-tenth:]) / tenth, 3)
            Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"\n{name.upper()} summary")
            if "tool_calls_first_tenth" in summary:
                print(f"  tool calls per completion  first tenth {summary['tool_calls_first_tenth']:.3f}  ->  last "
                      f"tenth {summary['tool_calls_last_tenth']:.3f}")
            print(f"  reward  first tenth {summary['reward_first_tenth']:+.3f}  ->  last tenth "
                  f"{summary['reward_last_tenth']:+.3f}  (rise {summary['reward_rise']:+.3f}, {summary['steps']} "
                  f"steps, {summary['seconds']} s)")
            if evals:
                print(f"  held-out reward {summary['eval_reward_first']:+.3f} -> {summary['eval_reward_last']:+.3f}")
            print("  time per phase (s): " + ", ".join(f"{k.split('/')[1]} {v}"
                                                      for k, v in summary["seconds_per_phase"].items()))
        if peft_config is not None and not cfg.merge_adapters:
            saved = f"the policy's adapter saved to {final} (PeftModel.from_pretrained(base, folder) loads it)"
        else:
            saved = f"policy saved to {final} (from_pretrained loads it)"
        print(f"  {saved}; metrics in {cfg.output_dir}/metrics.jsonl")
    finish(trainer, dataset_name or BUNDLED_PROMPTS)


def main(argv: list[str] | None = None) -> None:
    run(GRPOConfig, GRPOTrainer, "grpo", argv)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
