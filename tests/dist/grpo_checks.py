"""One 2-process launch for the GRPO/RLOO checks (tests/test_grpo_dist.py reads its JSON):

- the same short GRPO run (a reward function and the tiny reward model as a frozen role, a
  reference synced into every step, generation batches reused over two steps so old log-probs
  are kept) under zero2-zero3, zero2-replicated and zero3, and with the hf generation backend;
- that run resumed from its step-2 checkpoint;
- beta 0: the roles of the session (no reference);
- a learning run on the bundled reward (GRPO), its policy saved, and short RLOO runs (num_iterations 2) under two placements;
- two generations per step (gradient accumulation 2, steps_per_generation 1);
- a reward function that raises on rank 1 only;
- LoRA GRPO under three placements (one resumed, one saved merged) and LoRA RLOO under two;
- dynamic sampling with a reward that saturates on half the prompts, under two placements and resumed;
- streaming generation (max_staleness 2 through 4 slots per process) under two placements and resumed.
"""

import json
import sys

from posttrain.demo import tiny
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

SENTIMENT = "posttrain.demo.synthetic.sentiment_reward"  # the bundled reward
POLICY = str(tiny.sft_model_path())
SHORT = dict(learning_rate=3e-3, lr_scheduler_type="constant", per_device_train_batch_size=8, num_generations=4,
             max_completion_length=6, steps_per_generation=2, max_steps=4, beta=0.04, sync_ref_model=True,
             ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, epsilon=0.05, save_steps=2, logging_steps=1,
             disable_tqdm=True, seed=7, reward_weights=[1.0, 0.25], overwrite_output_dir=True)
LEARN = dict(learning_rate=2e-4, lr_scheduler_type="constant", per_device_train_batch_size=16, num_generations=8,
             max_completion_length=8, max_steps=40, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=42,
             overwrite_output_dir=True)


def saturating(prompts, completion_ids, **_):
    """Every completion of a "<subject> felt" prompt scores 1 (a group without spread)."""
    return [1.0 if p.endswith("felt") else float(sum(c) % 3) for p, c in zip(prompts, completion_ids)]


def lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)


def run(config_cls, trainer_cls, reward_funcs, save=False, peft_config=None, **fields
        ) -> tuple[list[dict], list[str], dict]:
    cfg = config_cls(**fields)
    trainer = trainer_cls(POLICY, reward_funcs=reward_funcs, args=cfg, peft_config=peft_config,
                          train_dataset=bundled_prompts(2048, cfg.seed))  # `posttrain grpo`'s prompts
    trainer.train()
    if save:
        trainer.save_model()  # the output dir itself, as TRL
    return trainer.state.log_history, sorted(trainer.session.roles), dict(trainer.rollout.stats)


def placed_and_resumed(tmp: str, name: str, rewards: list, **fields) -> dict:
    """GRPO runs under zero2-zero3 and zero3, and the first resumed from its step-2 checkpoint: each one's rows."""
    runs = {mix: run(GRPOConfig, GRPOTrainer, rewards, mix=mix, output_dir=f"{tmp}/{name}-{mix}", **fields)[0]
            for mix in ("zero2-zero3", "zero3")}
    runs["resumed"] = run(GRPOConfig, GRPOTrainer, rewards, mix="zero2-zero3", output_dir=f"{tmp}/{name}-zero2-zero3",
                          resume_from_checkpoint=f"{tmp}/{name}-zero2-zero3/checkpoint-2",
                          **{**fields, "overwrite_output_dir": False})[0]
    return runs


def main(out: str, tmp: str) -> None:
    rewards = [SENTIMENT, str(tiny.reward_model_path())]
    res: dict = {"placements": {}, "roles": {}}
    for mix in ("zero2-zero3", "zero2-replicated", "zero3"):
        hist, roles, stats = run(GRPOConfig, GRPOTrainer, rewards, mix=mix, output_dir=f"{tmp}/{mix}", **SHORT)
        res["placements"][mix] = hist
        res["roles"][mix] = roles
        res.setdefault("rollout", {})[mix] = stats
    # transformers' generate instead of the engine: the same samples for the same seed.
    res["placements"]["hf"], res["roles"]["hf"], res["rollout"]["hf"] = run(GRPOConfig, GRPOTrainer, rewards,
                                                                          output_dir=f"{tmp}/hf",
                                                                          generation_backend="hf", **SHORT)
    resume = {**SHORT, "overwrite_output_dir": False}
    res["resumed"], _, _ = run(GRPOConfig, GRPOTrainer, rewards, mix="zero2-zero3", output_dir=f"{tmp}/zero2-zero3",
                               resume_from_checkpoint=f"{tmp}/zero2-zero3/checkpoint-2", **resume)
    res["learn"], res["roles"]["beta0"], _ = run(GRPOConfig, GRPOTrainer, [SENTIMENT], output_dir=f"{tmp}/learn",
                                                 beta=0.0, save=True, **LEARN)
    res["learn_dir"] = f"{tmp}/learn"
    # RLOO with num_iterations 2: each generation batch trained twice (steps 1-4 share one batch).
    rloo = dict(SHORT, sync_ref_model=False, reward_weights=None, num_iterations=2, save_strategy="no")
    for mix in ("zero2-zero3", "zero2-replicated"):
        res.setdefault("rloo", {})[mix], _, _ = run(RLOOConfig, RLOOTrainer, [SENTIMENT], mix=mix,
                                                    output_dir=f"{tmp}/rloo-{mix}", **rloo)
    # LoRA (tests/test_lora_online.py): the policy's adapters train, the reference is its base with
    # adapters disabled; policy ZeRO-2 or ZeRO-3 (the frozen base sharded), reward replicated or
    # ZeRO-3; resumed from step 2; the ZeRO-3 run saves the merged model, the others the adapter.
    lora_fields = dict(SHORT, sync_ref_model=False, learning_rate=2e-2, generation_backend="hf")
    for mix in ("zero2-zero3", "zero2-replicated", "zero3"):
        res.setdefault("lora", {})[mix], res["roles"][f"lora-{mix}"], _ = run(
            GRPOConfig, GRPOTrainer, rewards, save=True, peft_config=lora(), mix=mix, output_dir=f"{tmp}/lora-{mix}",
            merge_adapters=mix == "zero3", **lora_fields)
    res["lora"]["resumed"], _, _ = run(GRPOConfig, GRPOTrainer, rewards, peft_config=lora(), mix="zero2-zero3",
                                       output_dir=f"{tmp}/lora-zero2-zero3",
                                       **{**lora_fields, "overwrite_output_dir": False},
                                       resume_from_checkpoint=f"{tmp}/lora-zero2-zero3/checkpoint-2")
    rloo_lora = dict(lora_fields, reward_weights=None, num_iterations=2, save_strategy="no")
    for mix in ("zero2-zero3", "zero3"):
        res["lora"][f"rloo-{mix}"], _, _ = run(RLOOConfig, RLOOTrainer, [SENTIMENT], peft_config=lora(), mix=mix,
                                               output_dir=f"{tmp}/lora-rloo-{mix}", **rloo_lora)
    res["lora_dir"] = tmp
    # Gradient accumulation with one generation per micro-step: num_tokens is the cumulative count.
    trainer = GRPOTrainer(POLICY, reward_funcs=[SENTIMENT], train_dataset=bundled_prompts(2048, LEARN["seed"]),
                          args=GRPOConfig(**{**LEARN, "max_steps": 2, "gradient_accumulation_steps": 2,
                                             "steps_per_generation": 1}, output_dir=f"{tmp}/ga2"))
    trainer.train()
    res["ga2"] = {"history": trainer.state.log_history, "num_tokens": trainer.num_tokens}

    # Dynamic sampling: the same kept groups, losses and counters whatever the placement, and after a resume
    # (the extra generation batches drawn before the checkpoint move the prompt order on).
    dynamic = dict(SHORT, dynamic_sampling=True, sync_ref_model=False, reward_weights=None)
    res["dynamic"] = placed_and_resumed(tmp, "dynamic", [saturating], **dynamic)

    # Streaming: each process streams its own groups; the same rows whatever the placement, and after a resume
    # from the step-2 checkpoint (each rank's finished, untrained groups saved with it).
    streaming = dict(SHORT, async_generation=True, max_staleness=2, generation_kv_slots=4, steps_per_generation=None,
                     sync_ref_model=False, reward_weights=None, max_completion_length=10)
    res["streaming"] = placed_and_resumed(tmp, "streaming", [SENTIMENT], **streaming)

    import torch.distributed as dist
    from accelerate.utils import gather_object

    from posttrain.rewards.functions import RewardFuncError

    def judge_down_on_rank_1(completions, **_):
        if dist.get_rank() == 1:
            raise ConnectionError("the judge is down")
        return [0.0] * len(completions)

    # A reward function failing on one rank: every rank stops with its sentence (none hangs in a gather).
    trainer = GRPOTrainer(POLICY, args=GRPOConfig(**{**LEARN, "max_steps": 1}, output_dir=f"{tmp}/fail"),
                          reward_funcs=[judge_down_on_rank_1], train_dataset=bundled_prompts(2048, LEARN["seed"]))
    try:
        trainer.train()
        said = "no error"
    except RewardFuncError as err:
        said = str(err)
    res["failure"] = gather_object([said])
    if dist.get_rank() == 0:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
