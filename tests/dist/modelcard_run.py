"""A short `posttrain ppo` run on the tiny default, models and prompts given by path as a user would
give their own: test_modelcard.py reads the model card and plot it leaves in the output dir (the
trainer writes it when training ends; the script then names the data, which the trainer, given
rows, cannot know)."""

import json
import sys
from pathlib import Path

from posttrain.demo import synthetic, tiny
from posttrain.scripts import ppo
from posttrain.scripts.args import run_script


def main(output_dir: str) -> None:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in synthetic.prompts(32)))
    settings = dict(output_dir=out, model_name_or_path=tiny.sft_model_path(), reward_model_path=tiny.reward_model_path(),
                    dataset_name=prompts, learning_rate=3e-4, per_device_train_batch_size=8, total_episodes=24,
                    num_ppo_epochs=1, response_length=8, local_rollout_forward_batch_size=8, disable_tqdm="true",
                    num_sample_generations=1, logging_steps=1)
    raise SystemExit(run_script(ppo.main, [a for k, v in settings.items() for a in (f"--{k}", str(v))]))


if __name__ == "__main__":
    main(sys.argv[1])
