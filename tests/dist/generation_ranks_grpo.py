"""GRPO with separate generation ranks on 3 CPU processes over gloo (ranks 0 and 1 train, rank 2 generates), run by
tests/dist/generation_ranks_checks.py after its own checks (one launch): the same short streaming run
(max_staleness 1, 6 slots for 16 sequences a generation batch, save_steps 2, an evaluation at step 4) under the
zero2-zero3 and zero3 mixes, the first resumed from its step-2 checkpoint, a LoRA run and an RLOO run. Per rank: each run's logged rows (the
generation rank's: none) and train() metrics; on rank 0 whether the generation rank's final weights equal the trained
policy's."""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.demo import tiny
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

SHORT = dict(learning_rate=3e-3, lr_scheduler_type="constant", per_device_train_batch_size=8, num_generations=4,
             max_completion_length=10, max_steps=4, beta=0.04, save_steps=2, logging_steps=1, disable_tqdm=True,
             seed=7, async_generation=True, max_staleness=1, generation_processes=1, generation_kv_slots=6,
             eval_strategy="steps",
             eval_steps=4, per_device_eval_batch_size=4, overwrite_output_dir=True)


def reward(completion_ids, **_):
    return [float(sum(c) % 7) for c in completion_ids]


def run(tmp: Path, name: str, peft_config=None, rloo: bool = False, **fields) -> dict:
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    start = time.perf_counter()
    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    cfg = config_cls(output_dir=str(tmp / name), **{**SHORT, **fields})
    t = trainer_cls(str(tiny.sft_model_path()), reward_funcs=reward, args=cfg, train_dataset=bundled_prompts(64, 7),
                    eval_dataset=bundled_prompts(4, 1), peft_config=peft_config)
    out = t.train()
    t.save_model()
    if t.session.generates:
        weights = {n: p.detach().clone() for n, p in t.generation_rank.copy.named_parameters()}
    else:
        weights = t.session.state_dict("policy")  # gathered under ZeRO-3 (collective over the training ranks)
    if dist.get_rank() in (0, 2):
        torch.save(weights, tmp / f"{name}-rank{dist.get_rank()}.pt")
    t.end()
    res = {"rows": t.state.log_history, "metrics": out.metrics, "seconds": round(time.perf_counter() - start, 1)}
    dist.barrier()
    if dist.get_rank() == 0:
        trained, copy = (torch.load(tmp / f"{name}-rank{r}.pt") for r in (0, 2))
        res["copy_equal"] = set(copy) <= set(trained) and all(torch.equal(trained[k], copy[k]) for k in copy)
    return res


def main(tmp: str) -> dict:
    tmp = Path(tmp)
    res = {mix: run(tmp, mix, mix=mix) for mix in ("zero2-zero3", "zero3")}
    res["resumed"] = run(tmp, "zero2-zero3", mix="zero2-zero3", overwrite_output_dir=False,
                         resume_from_checkpoint=str(tmp / "zero2-zero3" / "checkpoint-2"))
    from peft import LoraConfig

    # LoRA: the generation rank's copy takes the same adapters; the first sync sends every weight, later ones the
    # adapters (merged into the engine's weights after each).
    res["lora"] = run(tmp, "lora", mix="zero2-zero3", learning_rate=2e-2, save_strategy="no", eval_strategy="no",
                      peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))
    res["rloo"] = run(tmp, "rloo", rloo=True, mix="zero2-zero3", save_strategy="no", eval_strategy="no")
    res["saved"] = sorted(p.name for p in (tmp / "zero2-zero3" / "checkpoint-2" / "state").glob("streaming_*"))
    return res

