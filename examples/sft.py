"""Supervised fine-tuning on per-role plugins (the code: posttrain/scripts/sft.py, also installed as
`posttrain sft`).

With no model and no dataset it trains the built-in tiny default (randomly initialised) on the
bundled corpus, packed padding-free, under the demo settings (configs/sft.yaml) and reports the
held-out loss before and after:

    python examples/sft.py                                             # one process, no launcher
    torchrun --standalone --nproc_per_node 2 examples/sft.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/sft.py

Your own model and data (text, messages or prompt/completion) take TRL's SFTConfig defaults and
TRL/Trainer flags, as `trl sft` does:

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/sft.py --bf16 \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --packing true \\
        --assistant_only_loss true --eval_strategy steps --eval_steps 100 --save_steps 500
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.sft import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
