"""A short PPO run on the tiny default, models and prompts given by path as a user would give
their own: test_modelcard.py reads the model card and plot it leaves in the output dir."""

import json
import sys
from pathlib import Path

from posttrain.demo import synthetic, tiny
from posttrain.trainers.ppo import PPOConfig, PPOTrainer


def main(output_dir: str) -> None:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in synthetic.prompts(32)))
    cfg = PPOConfig(output_dir=str(out), model_name_or_path=str(tiny.sft_model_path()),
                    reward_model_path=str(tiny.reward_model_path()), dataset_name=str(prompts),
                    learning_rate=3e-4, per_device_train_batch_size=8, total_episodes=24, num_ppo_epochs=1,
                    response_length=8, local_rollout_forward_batch_size=8, disable_tqdm=True,
                    num_sample_generations=1)
    PPOTrainer(cfg).train()


if __name__ == "__main__":
    main(sys.argv[1])
