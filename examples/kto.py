"""KTO with the policy and the reference on their own DeepSpeed plugins (the code: posttrain/scripts/kto.py,
also installed as `posttrain kto`).

With no model and no dataset it trains the built-in tiny default on bundled synthetic unpaired feedback
(prompt, completion, label) under the demo settings (configs/kto.yaml) and reports the held-out reward margin
of desirable over undesirable completions:

    python examples/kto.py                                             # one process, no launcher
    torchrun --standalone --nproc_per_node 2 examples/kto.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/kto.py

Your own model and data take TRL's KTOConfig defaults and TRL/Trainer flags (TRL's ModelConfig for the
model: --use_peft, --lora_r, --dtype, ...), as `trl kto` does:

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/kto.py \\
        --model_name_or_path my-org/sft-model --dataset_name my-org/feedback --bf16 true \\
        --eval_strategy steps --eval_steps 100 --save_steps 500 --save_total_limit 2

The reference is the policy's initial weights (with --use_peft, its base with adapters disabled) unless
`--ref_model_name_or_path` names another model. Data is TRL's unpaired format (`prompt`, `completion`, boolean
`label`), standard or conversational; paired data (`chosen`/`rejected`) is unpaired as TRL does. A single data file has no test split: `--test_split_size 0.1`
holds out a tenth of it. Placement: `--mix`, or `role_configs` in a YAML given with `--config`. TRL's own
trl/scripts/kto.py runs on posttrain with `from posttrain import KTOConfig, KTOTrainer` in place of TRL's.
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.kto import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
