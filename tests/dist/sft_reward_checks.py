"""SFT and reward training on two processes, every multi-process check of tests/test_sft.py (SFT and reward)
in one launch: placements (ZeRO-2, ZeRO-3, an offloaded optimizer), resume, the first step's loss
against a direct computation over the whole global batch, evaluation, LoRA, and GRPO loading the
saved reward model as a reward function. Rank 0 writes what the tests check as JSON."""

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig

from posttrain.demo import synthetic, tiny
from posttrain.trainers.reward import RewardConfig, RewardTrainer, reward_loss
from posttrain.trainers.sft import SFTConfig, SFTTrainer, add_fused_head, token_terms

SFT_TRAIN = [{"text": t} for t in tiny.corpus()[:96]]
SFT_EVAL = [{"text": t} for t in tiny.corpus()[-20:]]
PAIRS = [{**r, "margin": 0.1 * (i % 3)} for i, r in enumerate(synthetic.preference_pairs(64, seed=0))]
PAIRS_EVAL = synthetic.preference_pairs(21, seed=1)  # odd: ranks get unequal shares
# ZeRO-2 with the optimizer states and step in CPU memory, the trainer's own AdamW kept (the
# zero2_train_offload preset brings DeepSpeed's optimizer and WarmupLR schedule instead).
OFFLOAD = {**json.loads((Path(__file__).resolve().parents[2] / "posttrain/presets/deepspeed/zero2_train.json").read_text()),
           "zero_force_ds_cpu_optimizer": False}
OFFLOAD["zero_optimization"] = {**OFFLOAD["zero_optimization"], "offload_optimizer": {"device": "cpu"}}
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, logging_steps=1,
              eval_strategy="steps", disable_tqdm=True, learning_rate=3e-3, gradient_checkpointing=False)


def record(trainer, history) -> dict:
    return {"rows": [r for r in history if "loss" in r], "evals": [r for r in history if "eval/loss" in r],
            "stages": {role: trainer.session.zero_stage(role) for role in trainer.session.roles}}


def sft(tmp: Path, name: str, peft_config=None, **fields) -> tuple[SFTTrainer, dict]:
    cfg = SFTConfig(output_dir=str(tmp / name), packing=True, max_length=32, **{**COMMON, **fields})
    trainer = SFTTrainer(str(tiny.model_path(seed=0)), args=cfg, train_dataset=SFT_TRAIN, eval_dataset=SFT_EVAL,
                         peft_config=peft_config)
    trainer.train()
    return trainer, record(trainer, trainer.state.log_history)


def reward(tmp: Path, name: str, peft_config=None, **fields) -> tuple[RewardTrainer, dict]:
    cfg = RewardConfig(output_dir=str(tmp / name), max_length=64, center_rewards_coefficient=0.01, **{**COMMON, **fields})
    trainer = RewardTrainer(str(tiny.model_path("reward", seed=0)), args=cfg, train_dataset=PAIRS,
                            eval_dataset=PAIRS_EVAL, peft_config=peft_config)
    trainer.train()
    return trainer, record(trainer, trainer.state.log_history)


def first_step_batches(trainer, world: int) -> list[list[dict]]:
    """The first optimizer step's micro-batches of every rank (what TRL's loader hands each)."""
    first = [next(trainer.loader.steps(trainer.schedule, rank)) for rank in range(world)]
    return [[trainer.collate([trainer.train_rows[i] for i in b.rows]) for b in step.batches] for step in first]


def grad_norm(model) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


def direct_sft_step(trainer, world: int) -> dict:
    """TRL's first step on one process: the summed NLL of every micro-batch of every rank over their
    trained tokens (num_items_in_batch), its value and its gradient's norm (before clipping)."""
    from transformers import AutoModelForCausalLM

    model = add_fused_head(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32))
    terms = [token_terms(model, b) for per_rank in first_step_batches(trainer, world) for b in per_rank]
    loss = sum(t["loss_sum"] for t in terms) / sum(t["tokens"] for t in terms)
    loss.backward()
    return {"loss": loss.item(), "grad_norm": grad_norm(model)}


def direct_reward_step(trainer, world: int) -> dict:
    """TRL's first step on one process: DDP averages ranks and accumulation averages micro-batches,
    so the gradient is that of the mean of the micro-batch losses, which is also the logged loss."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny.model_path("reward", seed=0), dtype=torch.float32)
    model.config.pad_token_id = trainer.tokenizer.pad_token_id
    losses = []
    for per_rank in first_step_batches(trainer, world):
        for b in per_rank:
            r = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.squeeze(-1)
            losses.append(reward_loss(r, b.get("margin"), trainer.cfg.center_rewards_coefficient)[0])
    loss = sum(losses) / len(losses)
    loss.backward()
    return {"loss": loss.item(), "grad_norm": grad_norm(model)}


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res: dict = {"sft": {}, "reward": {}}
    trainer, res["sft"]["zero2"] = sft(tmp, "sft-zero2", save_steps=2, eval_steps=2)
    main_process, world = trainer.session.is_main_process, trainer.session.num_processes
    res["world"] = world
    res["sft"]["direct_first_step"] = direct_sft_step(trainer, world)
    res["sft"]["padding_free_batch_keys"] = sorted(trainer.collate(trainer.train_rows[:2]))
    trainer.save_model(tmp / "sft-zero2" / "final")
    _, res["sft"]["zero3"] = sft(tmp, "sft-zero3", mix="zero3", eval_steps=2)
    _, res["sft"]["offload"] = sft(tmp, "sft-offload", role_configs={"policy": OFFLOAD}, eval_steps=2)
    _, res["sft"]["resumed"] = sft(tmp, "sft-resumed", resume_from_checkpoint=str(tmp / "sft-zero2" / "checkpoint-2"),
                                   eval_steps=2)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)
    trainer, res["sft"]["lora"] = sft(tmp, "sft-lora", peft_config=lora, learning_rate=1e-2)
    trainer.save_model(tmp / "sft-lora" / "final")
    if main_process:
        res["sft"]["lora_files"] = sorted(p.name for p in (tmp / "sft-lora" / "final").iterdir())
        res["sft"]["files"] = sorted(p.name for p in (tmp / "sft-zero2").iterdir())

    trainer, res["reward"]["zero2"] = reward(tmp, "rw-zero2", save_steps=2, eval_steps=2)
    res["reward"]["direct_first_step"] = direct_reward_step(trainer, world)
    final = tmp / "rw-zero2" / "final"
    trainer.save_model(final)
    _, res["reward"]["zero3"] = reward(tmp, "rw-zero3", mix="zero3", eval_steps=2)
    _, res["reward"]["offload"] = reward(tmp, "rw-offload", role_configs={"reward": OFFLOAD}, eval_steps=2)
    _, res["reward"]["resumed"] = reward(tmp, "rw-resumed", resume_from_checkpoint=str(tmp / "rw-zero2" / "checkpoint-2"),
                                         eval_steps=2)

    trainer, res["reward"]["lora"] = reward(tmp, "rw-lora", learning_rate=1e-2,
                                            peft_config=LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0))
    trainer.save_model(tmp / "rw-lora" / "final")
    if main_process:
        from transformers import AutoModelForSequenceClassification

        res["reward"]["lora_files"] = sorted(p.name for p in (tmp / "rw-lora" / "final").iterdir())

        loaded = AutoModelForSequenceClassification.from_pretrained(final)
        res["reward"]["saved"] = {"num_labels": loaded.config.num_labels, "pad_token_id": loaded.config.pad_token_id,
                                  "class": type(loaded).__name__}

    # GRPO takes the saved reward model unchanged as its reward function (a ZeRO-3 role of its own).
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    grpo = GRPOTrainer(str(tmp / "sft-zero2" / "final"), reward_funcs=[str(final)], train_dataset=bundled_prompts(2048),
                       args=GRPOConfig(output_dir=str(tmp / "grpo"), per_device_train_batch_size=4, num_generations=4,
                                       max_completion_length=4, max_prompt_length=8, max_steps=1, logging_steps=1,
                                       save_strategy="no", disable_tqdm=True, gradient_checkpointing=False))
    grpo.train()
    rows = grpo.state.log_history
    res["grpo"] = {"roles": sorted(grpo.session.roles), "rewards": [r.get("reward") for r in rows],
                   "reward_std": [r.get("reward_std") for r in rows]}
    if main_process:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
