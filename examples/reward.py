"""A Bradley-Terry reward model on per-role plugins (the code: posttrain/scripts/reward.py, also
installed as `posttrain reward`). The model saved in `<output_dir>` is a one-logit
AutoModelForSequenceClassification: PPO's --reward_model_path and GRPO/RLOO's --reward_funcs take it.

With no model and no dataset it starts from the tiny default's SFT policy (a new score head) on
bundled synthetic preference pairs under the demo settings (configs/reward.yaml) and reports held-out
accuracy:

    torchrun --standalone --nproc_per_node 2 examples/reward.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/reward.py

Your own model and pairs (chosen/rejected, optional prompt and margin; standard or conversational)
take TRL's RewardConfig defaults and TRL's ModelConfig flags, as `trl reward` does:

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/reward.py --bf16 true \\
        --model_name_or_path my-org/sft-model --dataset_name trl-lib/ultrafeedback_binarized \\
        --center_rewards_coefficient 0.01 --eval_strategy steps --eval_steps 100

A causal LM gets a new one-logit score head, as in TRL. With --use_peft the adapters train as SEQ_CLS, so
the score head trains beside them (TRL 1.16 takes --lora_task_type as given, CAUSAL_LM by default, which
leaves that head at its random initialisation). TRL's own trl/scripts/reward.py runs on posttrain with
`from posttrain import RewardConfig, RewardTrainer` in place of TRL's.
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.reward import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
