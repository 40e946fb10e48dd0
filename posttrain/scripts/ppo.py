"""``posttrain ppo``: PPO; with no model named, the built-in tiny policy and reward model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl import ModelConfig, ScriptArguments

from posttrain.demo import tiny
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
from posttrain.scripts.data import PromptArguments, load_prompts
from posttrain.trainers.ppo import PPOConfig, PPOTrainer


@dataclass
class PPOScriptArguments:
    """The models beside the policy (ModelConfig's ``--model_name_or_path``) and the reward functions: what
    TRL's PPO script read from its config (``reward_model_path``) goes to the trainer's arguments."""

    # A sequence-classification model (TRL's PPOConfig's name); "none": only reward_funcs. The tiny default's
    # when no model is named.
    reward_model_path: str | None = None
    # "module.function" names of functions of (prompts, completions), scored beside or instead of the reward model.
    reward_funcs: list[str] | None = None
    value_model_path: str | None = None  # default: the reward model if it reads the policy's ids, else the policy
    ref_model_name_or_path: str | None = None  # default: the policy's weights (with --use_peft: its base)


def summarize(history: list[dict], cfg: PPOConfig) -> dict:
    """Mean score over the first and last tenth of the updates, and time per phase."""
    rows = [h for h in history if "objective/scores" in h]
    tenth = max(1, len(rows) // 10)
    first = sum(h["objective/scores"] for h in rows[:tenth]) / tenth
    last = sum(h["objective/scores"] for h in rows[-tenth:]) / tenth
    phases = {k: round(sum(h.get(k, 0.0) for h in rows), 1) for k in
              ("time/generate", "time/policy_forward", "time/score", "time/train")}
    return {"updates": rows[-1]["step"], "score_first_tenth": round(first, 3), "score_last_tenth": round(last, 3),
            "score_rise": round(last - first, 3), "seconds_per_phase": phases,
            "resumed_from": cfg.resume_from_checkpoint, "mix": cfg.mix, "output_dir": cfg.output_dir}


def saved_as(peft_config: Any, merge_adapters: bool) -> str:
    """How the trained model was saved: its adapters (PEFT format) or a whole model."""
    if peft_config is not None and not merge_adapters:
        return "adapters saved (PEFT format: PeftModel.from_pretrained loads them onto the base)"
    return "saved" + (" with the adapters merged in" if peft_config is not None else "") + " (from_pretrained loads it)"


def reward_model(model_args: ModelConfig, args: PPOScriptArguments) -> str | None:
    """``--reward_model_path``; with no model named and none given, the tiny default's reward model."""
    if args.reward_model_path == "none":
        return None
    if args.reward_model_path is None and model_args.model_name_or_path is None:
        return str(tiny.reward_model_path())
    return args.reward_model_path


def main(argv: list[str] | None = None) -> None:
    script, data, ppo_args, cfg, model_args = parse_config(
        (ScriptArguments, PromptArguments, PPOScriptArguments, PPOConfig, ModelConfig), demo_config("ppo"), argv,
        prog="posttrain ppo")
    require_dataset([script, model_args])
    if model_args.use_peft and ppo_args.ref_model_name_or_path:
        raise ConfigError("--use_peft takes its reference from the policy's base model (adapters disabled): drop "
                          "--ref_model_name_or_path, or drop --use_peft to use a reference model of its own")
    model, peft_config = model_arguments(model_args, cfg, tiny.sft_model_path)
    prompts, dataset_name = load_prompts(script, data.num_prompts, cfg.seed, cfg._algorithm)
    trainer = PPOTrainer(args=cfg, model=model, ref_model=ppo_args.ref_model_name_or_path,
                         reward_model=reward_model(model_args, ppo_args), value_model=ppo_args.value_model_path,
                         train_dataset=prompts, peft_config=peft_config, reward_funcs=ppo_args.reward_funcs)
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    history = trainer.state.log_history
    final = trainer.save_model()  # the value model in value/
    if trainer.is_world_process_zero():
        record_script_arguments(cfg.output_dir, script, data, ppo_args, model_args)
        if history:
            summary = summarize(history, cfg)
            Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
            print("\nPPO summary")
            print(f"  objective/scores  first tenth {summary['score_first_tenth']:+.3f}  ->  last tenth "
                  f"{summary['score_last_tenth']:+.3f}  (rise {summary['score_rise']:+.3f})")
            print("  time per phase (s): " + ", ".join(f"{k.split('/')[1]} {v}"
                                                      for k, v in summary["seconds_per_phase"].items()))
            print(f"  policy {saved_as(peft_config, cfg.merge_adapters)} to {final}, value model to "
                  f"{final / 'value'}; metrics in {cfg.output_dir}/metrics.jsonl")
    finish(trainer, dataset_name)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
