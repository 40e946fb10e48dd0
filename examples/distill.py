"""Knowledge distillation: the student trains under ZeRO-2 while the teacher is sharded with ZeRO-3
(the code: posttrain/scripts/distill.py, also installed as `posttrain distill`).

    torchrun --standalone --nproc_per_node 2 examples/distill.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/distill.py

With no teacher given it first trains a tiny teacher (a wider, deeper tiny Llama) on the bundled text
and caches it; then the tiny student, from random weights, learns from it under the demo settings
(configs/distill.yaml). It reports the student-teacher divergence on held-out lines before and
after, and the factor it fell by. A real run names both models (`--model_name_or_path`,
`--teacher_model_name_or_path`; one vocabulary) and its prompts (`--dataset_name`; a "completion" column
too where the dataset's completions train, lmbda < 1). TRL's own trl/scripts/distillation.py runs with
`from posttrain import DistillationTrainer` in place of TRL's.
"""

from posttrain.scripts.args import run_script
from posttrain.scripts.distill import main

if __name__ == "__main__":
    raise SystemExit(run_script(main))
