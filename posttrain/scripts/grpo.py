"""``posttrain grpo``: GRPO; with no model named, the built-in tiny default and its bundled reward."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trl import ScriptArguments

from posttrain.demo import synthetic, tiny
from posttrain.run.hub import push_to_hub
from posttrain.run.modelcard import write_model_card
from posttrain.scripts.args import (
    demo_config,
    parse_config,
    record_script_arguments,
    require_dataset,
    run_script,
)
from posttrain.scripts.data import PromptArguments, load_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

PHASES = ("time/generate", "time/policy_forward", "time/score", "time/train")


def summarize(history: list[dict], cfg: GRPOConfig, seconds: float) -> dict:
    """Mean reward over the first and last tenth of the rows that sampled, and time per phase."""
    scored = [h["reward"] for h in history if isinstance(h.get("reward"), float) and math.isfinite(h["reward"])]
    tenth = max(1, len(scored) // 10)
    first = sum(scored[:tenth]) / tenth if scored else math.nan
    last = sum(scored[-tenth:]) / tenth if scored else math.nan
    phases = {k: round(sum(h.get(k, 0.0) for h in history), 1) for k in PHASES}
    return {"steps": history[-1]["step"] if history else 0, "reward_first_tenth": round(first, 3), "reward_last_tenth": round(last, 3),
            "reward_rise": round(last - first, 3), "seconds_per_phase": phases, "seconds": round(seconds, 1),
            "resumed_from": cfg.resume_from_checkpoint, "mix": cfg.mix, "output_dir": cfg.output_dir}


def demo_models(cfg: GRPOConfig) -> dict:
    """The tiny default's policy and, unless a reward is named, its reward, when no model is named."""
    if cfg.model_name_or_path is not None:
        return {}
    named = cfg.reward_funcs or cfg.reward_model_name_or_path
    return {"model": str(tiny.sft_model_path()), **({} if named else {"reward_funcs": [synthetic.sentiment_reward]})}


def run(config_cls: type, trainer_cls: type, name: str, argv: list[str] | None = None) -> None:
    """Parse, train, save the policy and print the summary (shared with ``posttrain rloo``)."""
    import time

    script, data, cfg = parse_config((ScriptArguments, PromptArguments, config_cls), demo_config(name), argv,
                                     prog=f"posttrain {name}")
    require_dataset([script, cfg])
    start = time.perf_counter()
    prompts, dataset_name = load_prompts(script, data.num_prompts, cfg.seed, cfg._algorithm)
    trainer = trainer_cls(cfg, train_dataset=prompts, **demo_models(cfg))
    history = trainer.train()
    final = trainer.save_model()
    if not trainer.session.is_main_process:
        return
    # Name the data in the card, after the save (a peft save rewrites the card's tags).
    write_model_card(cfg.output_dir, cfg, name, trainer.session, dataset_name=dataset_name)
    record_script_arguments(cfg.output_dir, script, data)
    if history:
        summary = summarize(history, cfg, time.perf_counter() - start)
        summary["generation_backend"] = trainer.rollout.stats.get("backend")
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"\n{name.upper()} summary")
        print(f"  reward  first tenth {summary['reward_first_tenth']:+.3f}  ->  last tenth "
              f"{summary['reward_last_tenth']:+.3f}  (rise {summary['reward_rise']:+.3f}, {summary['steps']} steps, "
              f"{summary['seconds']} s)")
        print("  time per phase (s): " + ", ".join(f"{k.split('/')[1]} {v}"
                                                  for k, v in summary["seconds_per_phase"].items()))
        if trainer.peft_config is not None and not cfg.merge_adapters:
            saved = f"the policy's adapter saved to {final} (PeftModel.from_pretrained(base, folder) loads it)"
        else:
            saved = f"policy saved to {final} (from_pretrained loads it)"
        print(f"  {saved}; metrics in {cfg.output_dir}/metrics.jsonl")
    if cfg.push_to_hub:
        print(f"pushed to {push_to_hub(cfg, final)}")


def main(argv: list[str] | None = None) -> None:
    run(GRPOConfig, GRPOTrainer, "grpo", argv)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
