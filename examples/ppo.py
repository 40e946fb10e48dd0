"""PPO with a ZeRO-2 policy and value model and ZeRO-3 reference and reward models.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/ppo.py   # the tiny default
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/ppo.py --config configs/ppo.yaml \
        --model_name_or_path my/sft-model --reward_model_path my/reward-model --dataset_name my/prompts

With no arguments it runs on the built-in tiny default: a tiny policy fine-tuned on bundled text and
a tiny reward model trained on bundled preferences for positive adjectives.
"""

import json
from pathlib import Path

from posttrain.trainers.common import parse_config
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo.yaml"


def main() -> None:
    (cfg,) = parse_config(PPOConfig, DEFAULT_CONFIG)
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    trainer.save()
    if trainer.session.is_main_process and history:
        tenth = max(1, len(history) // 10)
        first = sum(h["objective/scores"] for h in history[:tenth]) / tenth
        last = sum(h["objective/scores"] for h in history[-tenth:]) / tenth
        phases = {k: round(sum(h.get(k, 0.0) for h in history), 1) for k in
                  ("time/generate", "time/policy_forward", "time/score", "time/train")}
        summary = {"updates": len(history), "score_first_tenth": round(first, 3), "score_last_tenth": round(last, 3),
                   "score_rise": round(last - first, 3), "seconds_per_phase": phases,
                   "mix": cfg.mix, "output_dir": cfg.output_dir}
        Path(cfg.output_dir, "summary.json").write_text(json.dumps(summary, indent=1))
        print("\nPPO summary")
        print(f"  objective/scores  first tenth {first:+.3f}  ->  last tenth {last:+.3f}  (rise {last - first:+.3f})")
        print("  time per phase (s): " + ", ".join(f"{k.split('/')[1]} {v}" for k, v in phases.items()))
        print(f"  policy saved to {cfg.output_dir}/policy; metrics in {cfg.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
