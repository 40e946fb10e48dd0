"""A KTO run on the ranks of the launch that imports it (tests/dist/world_checks.py: the mixes at 3 ranks)."""

from pathlib import Path

from posttrain.demo import synthetic, tiny
from posttrain.trainers.kto import KTOConfig, KTOTrainer


def rows(n: int = 48, seed: int = 0) -> list[dict]:
    """Unpaired rows with both labels in every micro-batch of 4."""
    pairs = synthetic.preference_pairs(n, seed=seed)
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 3 else p["rejected"], "label": bool(i % 3)}
            for i, p in enumerate(pairs)]


def run(tmp: Path, name: str, callbacks: list | None = None, **fields) -> dict:
    """Three steps and an evaluation whose 4 batches of 3 rows leave two processes of three a filler batch."""
    base = dict(output_dir=str(tmp / name), per_device_train_batch_size=4, learning_rate=1e-3, max_steps=3,
                logging_steps=1, max_length=64, disable_tqdm=True, save_strategy="no", gradient_checkpointing=False,
                eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=3)
    trainer = KTOTrainer(str(tiny.sft_model_path()), args=KTOConfig(**{**base, **fields}), train_dataset=rows(),
                         eval_dataset=rows(10, seed=1), callbacks=callbacks)
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    evaluated = next(r for r in trainer.state.log_history if "eval/loss" in r)
    out = {key: [r[key] for r in logged] for key in ("loss", "kl", "rewards/margins", "grad_norm")}
    out["eval"] = [evaluated[f"eval/{key}"] for key in ("loss", "kl", "rewards/chosen", "rewards/rejected")]
    return out
