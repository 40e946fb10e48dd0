"""GRPO on per-role plugins (the code: posttrain/scripts/grpo.py, also installed as `posttrain grpo`).

    torchrun --standalone --nproc_per_node 2 examples/grpo.py                             # the tiny default, CPU
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/grpo.py --bf16 \\
        --model_name_or_path my/model --reward_funcs my_pkg.rewards.accuracy --dataset_name my/prompts

With no model it runs on the built-in tiny default under the demo settings (configs/grpo.yaml): a
tiny policy fine-tuned on bundled text, rewarded by a bundled function for positive adjectives.
With your model, GRPOConfig's defaults (TRL 1.16's) apply unless you give `--config FILE`. The flags are
TRL's grpo.py script's: `--reward_funcs` (TRL's reward names or `module.function`),
`--reward_model_name_or_path`, LoRA as TRL's ModelConfig (`--use_peft --lora_r 16 ...`), and
`--eval_strategy steps` to generate on the dataset's test split and log the eval rewards.
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.grpo import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
