"""DPO training runs on two processes, several sessions in one launch: placements, precomputed vs live
reference, checkpoint + resume, LoRA, evaluation. Rank 0 writes what the tests check as JSON."""

import json
import sys
from pathlib import Path

from posttrain.demo import synthetic, tiny
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

TRAIN = synthetic.preference_pairs(64, seed=0)
EVAL = synthetic.preference_pairs(24, seed=1)


def run(tmp: Path, name: str, eval_dataset=None, peft_config=None, **fields) -> tuple[DPOTrainer, dict]:
    base = dict(output_dir=str(tmp / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-3, max_steps=6, logging_steps=1, max_length=64, disable_tqdm=True)
    trainer = DPOTrainer(str(tiny.sft_model_path()), args=DPOConfig(**{**base, **fields}), train_dataset=TRAIN,
                         eval_dataset=eval_dataset, peft_config=peft_config)
    trainer.train()
    history = trainer.state.log_history
    res = {"losses": [r["loss"] for r in history if "loss" in r],
           "evals": [r for r in history if "eval/loss" in r],
           "rows": [r for r in history if "loss" in r],
           "engines": sorted(trainer.session.engines), "stages": {}}
    for role in trainer.session.roles:
        res["stages"][role] = trainer.session.zero_stage(role)
    return trainer, res


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res = {}
    trainer, res["zero2-zero3"] = run(tmp, "zero2-zero3", eval_dataset=EVAL, eval_strategy="steps", eval_steps=3,
                                      save_steps=3)
    main_process = trainer.session.is_main_process
    ckpt = tmp / "zero2-zero3" / "checkpoint-3"
    if main_process:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(ckpt / "policy")  # an HF-format policy
        res["metrics_lines"] = len((tmp / "zero2-zero3" / "metrics.jsonl").read_text().splitlines())
    for mix in ("zero2-replicated", "zero3"):
        _, res[mix] = run(tmp, mix, mix=mix)
    _, res["precomputed"] = run(tmp, "precomputed", precompute_ref_log_probs=True)
    _, res["resumed"] = run(tmp, "resumed", resume_from_checkpoint=str(ckpt))
    from peft import LoraConfig

    lora = dict(peft_config=LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0), learning_rate=1e-2,
                max_steps=12)
    _, res["lora_precomputed"] = run(tmp, "lora_precomputed", precompute_ref_log_probs=True, **lora)
    trainer, res["lora"] = run(tmp, "lora", eval_dataset=EVAL, eval_strategy="steps", eval_steps=12, **lora)
    trainer.save_model(tmp / "lora" / "final")
    if main_process:
        res["lora_files"] = sorted(p.name for p in (tmp / "lora" / "final").iterdir())
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
