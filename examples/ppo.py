"""PPO with a ZeRO-2 policy and value model and ZeRO-3 reference and reward models (the code:
posttrain/scripts/ppo.py, also installed as `posttrain ppo`).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/ppo.py   # the tiny default
    python examples/ppo.py                                                               # one process
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/ppo.py --bf16 \\
        --model_name_or_path my/sft-model --reward_model_path my/reward-model --dataset_name my/prompts

With no model it runs on the built-in tiny default under the demo settings (configs/ppo.yaml): a
tiny policy fine-tuned on bundled text and a tiny reward model trained on bundled preferences for
positive adjectives. With your models, PPOConfig's defaults (TRL's last PPOConfig's, trl 0.x) apply
unless you give `--config FILE`; LoRA is TRL's ModelConfig flags (`--use_peft --lora_r 16 ...`).
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.ppo import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
