"""``posttrain ppo``: PPO; with no model named, the built-in tiny policy and reward model."""

from __future__ import annotations

import json
from pathlib import Path

from trl import ScriptArguments

from posttrain.demo import tiny
from posttrain.models.lora import LoraFields
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
from posttrain.trainers.ppo import PPOConfig, PPOTrainer


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


def saved_as(cfg: LoraFields) -> str:
    """How the trained model was saved: its adapters (PEFT format) or a whole model."""
    if cfg.use_peft and not cfg.merge_adapters:
        return "adapters saved (PEFT format: PeftModel.from_pretrained loads them onto the base)"
    return "saved" + (" with the adapters merged in" if cfg.use_peft else "") + " (from_pretrained loads it)"


def demo_models(cfg: PPOConfig) -> dict:
    """The tiny default's policy and, unless one is named, reward model, when no model is named."""
    if cfg.model_name_or_path is not None:
        return {}
    reward = {} if cfg.reward_model_path else {"reward_model": str(tiny.reward_model_path())}
    return {"model": str(tiny.sft_model_path()), **reward}


def main(argv: list[str] | None = None) -> None:
    script, data, cfg = parse_config((ScriptArguments, PromptArguments, PPOConfig), demo_config("ppo"), argv,
                                     prog="posttrain ppo")
    require_dataset([script, cfg])
    prompts, dataset_name = load_prompts(script, data.num_prompts, cfg.seed, cfg._algorithm)
    trainer = PPOTrainer(cfg, train_dataset=prompts, **demo_models(cfg))
    history = trainer.train()
    final = trainer.save_model()  # the value model in value/
    if not trainer.session.is_main_process:
        return
    # Name the data in the card, after the save (a peft save rewrites the card's tags).
    write_model_card(cfg.output_dir, cfg, "ppo", trainer.session, dataset_name=dataset_name)
    record_script_arguments(cfg.output_dir, script, data)
    if history:
        summary = summarize(history, cfg)
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print("\nPPO summary")
        print(f"  objective/scores  first tenth {summary['score_first_tenth']:+.3f}  ->  last tenth "
              f"{summary['score_last_tenth']:+.3f}  (rise {summary['score_rise']:+.3f})")
        print("  time per phase (s): " + ", ".join(f"{k.split('/')[1]} {v}"
                                                  for k, v in summary["seconds_per_phase"].items()))
        print(f"  policy {saved_as(cfg)} to {final}, value model to {final / 'value'}; "
              f"metrics in {cfg.output_dir}/metrics.jsonl")
    if cfg.push_to_hub:
        print(f"pushed to {push_to_hub(cfg, final)}")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
