"""PPO checkpoints and rewards on two processes, for test_checkpoints.py; rank 0 writes JSON.

    OUT full TMP OTHER_REWARD   val/ratio_var's gathering; an uninterrupted run (4 updates, a
                                checkpoint every 2, save_total_limit 1); PPO with a reward model of
                                another vocabulary on conversational prompts
    OUT killed TMP              the same run; rank 1 exits in the middle of saving checkpoint-4
    OUT full-then-killed TMP OTHER_REWARD
                                full's runs, OUT written, then killed's run in the same launch (one start-up)
    OUT resume TMP              resume_from_checkpoint latest in the killed run's dir, after
                                load_state refuses a state lacking rank 1's RNG file; then KTO's
                                uninterrupted run and its killed run resumed (latest)
    OUT kto-killed TMP          KTO (4 steps, a checkpoint every 2); rank 1 exits while saving checkpoint-4
    OUT grpo-streaming-killed TMP
                                GRPO with streaming generation (4 steps, a checkpoint every 2, finished untrained
                                groups in each rank's state); rank 1 exits while saving checkpoint-4; "resume" runs
                                its uninterrupted twin and resumes it
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from ppo_run import prompts as ppo_prompts
from ppo_run import trainer_models

from posttrain.data.preference import write_jsonl
from posttrain.errors import ConfigError
from posttrain.rewards import models as rewards
from posttrain.trainers.ppo import PPOConfig, PPOTrainer, gather_ranks

BASE = dict(learning_rate=3e-4, lr_scheduler_type="constant", per_device_train_batch_size=8, num_mini_batches=2,
            num_ppo_epochs=2, response_length=8, temperature=1.0, stop_token="eos", kl_coef=0.05,
            local_rollout_forward_batch_size=16, disable_tqdm=True, num_sample_generations=1,
            total_episodes=128, save_steps=2, logging_steps=1)  # 4 updates of 2 x 16 rollouts


def run(dataset_name: str | None = None, **kw) -> PPOTrainer:
    models = trainer_models(kw)  # the tiny default's policy and reward model unless kw names others
    cfg = PPOConfig(**{**BASE, **kw})
    trainer = PPOTrainer(args=cfg, train_dataset=ppo_prompts(cfg, dataset_name), **models)
    trainer.train()
    return trainer


def die_while_saving(step: int) -> None:
    """Rank 1 exits after writing its policy state and before its value state of checkpoint-``step``."""
    import accelerate

    original = accelerate.Accelerator.save_state

    def save_state(self, output_dir=None, **kw):
        if int(os.environ["RANK"]) == 1 and f"checkpoint-{step}.tmp" in str(output_dir) and str(output_dir).endswith("value"):
            os._exit(3)
        return original(self, output_dir, **kw)

    accelerate.Accelerator.save_state = save_state


def kto_run(tmp: Path, name: str, **fields) -> list[dict]:
    """KTO on the tiny SFT model, 4 steps of 2 x 4 unpaired rows, a checkpoint every 2; its logged rows."""
    from kto_train import rows

    from posttrain.demo import tiny
    from posttrain.trainers.kto import KTOConfig, KTOTrainer

    cfg = KTOConfig(**{**dict(output_dir=str(tmp / name), per_device_train_batch_size=4, learning_rate=1e-3,
                              max_steps=4, save_steps=2, logging_steps=1, max_length=64, disable_tqdm=True,
                              gradient_checkpointing=False), **fields})
    trainer = KTOTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=rows())
    trainer.train()
    return trainer.state.log_history


def grpo_streaming_run(tmp: Path, name: str, **fields) -> list[dict]:
    """GRPO with streaming generation on the tiny SFT model: max_staleness 2 through 4 slots per process, 4 steps,
    a checkpoint every 2; its logged rows."""
    from posttrain.demo import tiny
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(**{**dict(output_dir=str(tmp / name), per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=10, max_steps=4, save_steps=2, logging_steps=1, seed=7,
                               learning_rate=3e-3, disable_tqdm=True, async_generation=True, max_staleness=2,
                               generation_kv_slots=4), **fields})
    trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=["posttrain.demo.synthetic.sentiment_reward"],
                          args=cfg, train_dataset=bundled_prompts(64, cfg.seed))
    trainer.train()
    return trainer.state.log_history


def die_while_saving_policy(step: int) -> None:
    """Rank 1 exits as it starts writing its policy state of checkpoint-``step`` (KTO saves no other)."""
    import accelerate

    original = accelerate.Accelerator.save_state

    def save_state(self, output_dir=None, **kw):
        if int(os.environ["RANK"]) == 1 and f"checkpoint-{step}.tmp" in str(output_dir):
            os._exit(3)
        return original(self, output_dir, **kw)

    accelerate.Accelerator.save_state = save_state


def other_vocabulary(tmp: Path, reward_path: str) -> dict:
    """PPO with a reward model of another tokenizer: its scores equal the reward model's own
    (plain transformers, one row at a time) on the prompt + completion re-encoded with its
    tokenizer and chat template."""
    from transformers import AutoModelForSequenceClassification

    prompts = write_jsonl([{"prompt": [{"role": "user", "content": p}]} for p in ["the cat is", "my friend felt"] * 16],
                          tmp / f"conversational-{os.environ['RANK']}.jsonl")
    trainer = run(output_dir=str(tmp / "other-vocab"), reward_model_path=reward_path, dataset_name=str(prompts),
                  total_episodes=32, save_steps=None)
    idx = list(range(4))
    batch = trainer.rollout(trainer._queries(idx), prompts=[trainer.raw_prompts[i] for i in idx])
    rin = trainer.rewards.models[0].reads
    model = AutoModelForSequenceClassification.from_pretrained(reward_path).eval()
    want = []
    for p, c in zip([trainer.raw_prompts[i] for i in idx], batch["texts"]):
        enc = rin.tokenizer(rewards.reward_texts([p], [c], rin.tokenizer), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            want.append(float(model(**enc).logits[0, 0]))
    return {"shares_policy_ids": rin.shares_policy_ids, "got": batch["scores"].tolist(), "want": want,
            "texts": batch["texts"], "updates": len(trainer.history)}


def main(out: str, mode: str, tmp: str, *rest: str) -> None:
    tmp, res = Path(tmp), {}
    if mode in ("full", "full-then-killed"):
        trainer = run(output_dir=str(tmp / "full"), save_total_limit=1)
        res["history"] = trainer.history
        res["saved"] = str(trainer.save_model())  # the policy at the top of the output dir, the value model in value/
        s = trainer.session
        # Rank 0 holds [0, 0], rank 1 [1, 1]: the variance over all four is 1/3, each rank's own is 0.
        values = torch.full((2,), float(s.process_index), dtype=torch.float64)
        res["gathered_var"] = gather_ranks(s, values).var().item()
        res["other_vocab"] = other_vocabulary(tmp, rest[0])
        if mode == "full-then-killed":
            if int(os.environ["RANK"]) == 0:
                Path(out).write_text(json.dumps(res))
            s.accelerator.wait_for_everyone()
            mode = "killed"  # the killed run, its own output dir, after the full one
    if mode == "killed":
        die_while_saving(4)
        run(output_dir=str(tmp / "killed"))
    elif mode == "kto-killed":
        die_while_saving_policy(4)
        kto_run(tmp, "kto-killed")
    elif mode == "grpo-streaming-killed":
        die_while_saving_policy(4)
        grpo_streaming_run(tmp, "grpo-killed")
    elif mode == "resume":
        cfg = PPOConfig(**{**BASE, "output_dir": str(tmp / "killed"), "resume_from_checkpoint": "latest"})
        trainer = PPOTrainer(args=cfg, train_dataset=ppo_prompts(cfg), **trainer_models({}))
        s = trainer.session
        # A state missing one rank's RNG file (what the old save order could leave) is refused on every rank.
        broken = tmp / "broken-state"
        if s.is_main_process:
            shutil.copytree(tmp / "killed" / "checkpoint-2" / "state", broken)
            (broken / "policy" / "random_states_1.pkl").unlink()
        s.accelerator.wait_for_everyone()
        try:
            s.load_state(broken)
            res["refused"] = None
        except ConfigError as e:
            res["refused"] = str(e)
        res["start"] = trainer.start
        trainer.train()
        res["history"] = trainer.state.log_history
        # KTO after its kill: the uninterrupted run, then the killed one resumed from its latest checkpoint.
        res["kto_full"] = kto_run(tmp, "kto-full")
        res["kto_resumed"] = kto_run(tmp, "kto-killed", resume_from_checkpoint="latest")
        res["grpo_full"] = grpo_streaming_run(tmp, "grpo-full")
        res["grpo_resumed"] = grpo_streaming_run(tmp, "grpo-killed", resume_from_checkpoint="latest")
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:])
