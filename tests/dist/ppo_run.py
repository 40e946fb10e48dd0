"""Runs PPO on the tiny default's models with JSON overrides; rank 0 writes the metric history."""

import json
import sys

from trl import ScriptArguments

from posttrain.demo import tiny
from posttrain.scripts.data import load_prompts
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

BASE = dict(learning_rate=3e-4, lr_scheduler_type="constant", per_device_train_batch_size=8, num_mini_batches=2,
            num_ppo_epochs=2, response_length=8, temperature=1.0, stop_token="eos", kl_coef=0.05,
            local_rollout_forward_batch_size=16, disable_tqdm=True, num_sample_generations=1, logging_steps=1,
            save_steps=None)
# The overrides that name the trainer's models and rewards (the script's flags), and the argument each goes to.
MODEL_FIELDS = {"model_name_or_path": "model", "reward_model_path": "reward_model", "value_model_path": "value_model",
                "ref_model_name_or_path": "ref_model", "reward_funcs": "reward_funcs"}


def trainer_models(fields: dict) -> dict:
    """Pop the model overrides from ``fields``: the trainer's keyword arguments, the tiny default's by
    default (its SFT policy and reward model; reward_model_path "none": reward functions only)."""
    models = {"model": str(tiny.sft_model_path()), "reward_model": str(tiny.reward_model_path())}
    for name, argument in MODEL_FIELDS.items():
        if name in fields:
            value = fields.pop(name)
            models[argument] = None if value == "none" else value
    return models


def prompts(cfg: PPOConfig, dataset_name: str | None = None) -> list[dict]:
    """What `posttrain ppo` trains on: --dataset_name's rows, else its 2048 bundled prompts."""
    return load_prompts(ScriptArguments(dataset_name=dataset_name), 2048, cfg.seed, "PPO")[0]


def main(out: str, overrides: str) -> None:
    fields = json.loads(overrides)
    dataset_name = fields.pop("dataset_name", None)  # a prompt file, loaded as the script loads it
    models = trainer_models(fields)
    cfg = PPOConfig(**{**BASE, **fields})
    trainer = PPOTrainer(args=cfg, train_dataset=prompts(cfg, dataset_name), **models)
    trainer.train()
    if trainer.is_world_process_zero():
        json.dump(trainer.state.log_history, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
