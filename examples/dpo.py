"""DPO with the policy and the reference on their own DeepSpeed plugins (the code: posttrain/scripts/dpo.py,
also installed as `posttrain dpo`).

With no model and no dataset it trains the built-in tiny default on bundled synthetic preference
pairs under the demo settings (configs/dpo.yaml) and reports held-out reward accuracy:

    python examples/dpo.py                                             # one process, no launcher
    torchrun --standalone --nproc_per_node 2 examples/dpo.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/dpo.py

Your own model and data take TRL's DPOConfig defaults and TRL/Trainer flags (TRL's ModelConfig for the
model: --use_peft, --lora_r, --dtype, ...), as `trl dpo` does:

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/dpo.py \\
        --model_name_or_path my-org/sft-model --dataset_name my-org/pairs --bf16 true \\
        --eval_strategy steps --eval_steps 100 --save_steps 500 --save_total_limit 2

The reference is the policy's initial weights (with --use_peft, its base with adapters disabled) unless
`--ref_model_name_or_path` names another model. A single data file has no test split: `--test_split_size 0.1`
holds out a tenth of it. Placement: `--mix`, or `role_configs` in a YAML given with `--config`. TRL's own
trl/scripts/dpo.py runs on posttrain with `from posttrain import DPOConfig, DPOTrainer` in place of TRL's.
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.dpo import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
