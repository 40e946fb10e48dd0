"""Two-process LoRA checks for PPO and distillation, one launch: every mix, a checkpoint and its
resume; rank 0 writes the findings as JSON for tests/test_lora_ppo_distill.py."""

import json
import sys
from pathlib import Path

from distill_checks import SETTINGS, TEACHER, losses, rows, train
from ppo_run import BASE, prompts, trainer_models
from trl import ModelConfig, get_peft_config

from posttrain.demo import tiny
from posttrain.trainers.distill import DistillationConfig, DistillationTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

# The mixes that place the LoRA role differently (ZeRO-2, ZeRO-3: its frozen base sharded); the frozen
# reward/teacher placements, which adapters do not touch, are covered by test_ppo.py and test_distill.py.
MIXES = ["zero2-zero3", "zero3"]
PEFT = get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["all-linear"]))
PPO_KEYS = ["objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "loss/value_avg",
            "policy/approxkl_avg", "val/clipfrac_avg"]


def ppo(tmp: Path, name: str, **kw) -> tuple[PPOTrainer, list[dict]]:
    cfg = PPOConfig(output_dir=str(tmp / name), **{**BASE, "learning_rate": 1e-2, "total_episodes": 64, **kw})
    trainer = PPOTrainer(args=cfg, train_dataset=prompts(cfg), peft_config=PEFT, **trainer_models({}))
    trainer.train()
    return trainer, [{k: h[k] for k in PPO_KEYS} for h in trainer.state.log_history]


def distill(tmp: Path, name: str, **kw) -> DistillationTrainer:
    cfg = DistillationConfig(output_dir=str(tmp / name), **{**SETTINGS, "learning_rate": 1e-2, "temperature": 2.0, **kw})
    return DistillationTrainer(str(tiny.model_path()), str(TEACHER), args=cfg, train_dataset=rows(tiny.corpus()[:64]),
                               peft_config=PEFT)


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res = {"ppo": {}, "distill": {}}
    for mix in MIXES:
        trainer, res["ppo"][mix] = ppo(tmp, f"ppo-{mix}", mix=mix, **({"save_steps": 1} if mix == MIXES[0] else {}))
        s = trainer.session
        res.setdefault("ppo_engines", {})[mix] = {r: s.zero_stage(r) for r in sorted(s.engines)}
    _, res["ppo"]["resumed"] = ppo(tmp, "ppo-resumed", resume_from_checkpoint=str(tmp / f"ppo-{MIXES[0]}" / "checkpoint-1"))
    # Every source of sequences (the student generates with its adapters), then resume at step 2.
    for mix in MIXES:
        kw = dict(lmbda=0.5, seq_kd=True, gradient_accumulation_steps=2, max_steps=4)
        t = distill(tmp, f"distill-{mix}", mix=mix, **kw, **({"save_steps": 2} if mix == MIXES[0] else {}))
        res["distill"][mix] = losses(train(t))
        res.setdefault("distill_engines", {})[mix] = {r: t.session.zero_stage(r) for r in sorted(t.session.engines)}
    t = distill(tmp, "distill-resumed", lmbda=0.5, seq_kd=True, gradient_accumulation_steps=2, max_steps=4,
                resume_from_checkpoint=str(tmp / f"distill-{MIXES[0]}" / "checkpoint-2"))
    res["distill"]["resumed"] = losses(train(t))
    t.save_model()
    res["distill_files"] = sorted(p.name for p in (tmp / "distill-resumed").iterdir())
    res["ppo_files"] = sorted(p.name for p in (tmp / f"ppo-{MIXES[0]}" / "checkpoint-1" / "policy").iterdir())
    if t.session.is_main_process:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
