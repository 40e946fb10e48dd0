"""The recipes of the tiny default's trained assets (posttrain's SFTTrainer and RewardTrainer, one
process). ``python -m posttrain.demo.recipes DEST [--asset ...]`` builds them."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posttrain.demo import corpus
from posttrain.demo.tiny import (
    REWARD_STEPS,
    SFT_STEPS,
    TINY_SHAPE,
    _build_tokenizer,
    _init_model,
    _log,
    _name,
    _save,
    load_tokenizer,
    tokenizer_path,
)

RECIPE = dict(learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
              per_device_train_batch_size=32, gradient_checkpointing=False, mixed_precision="no",
              single_process_engine="torch", logging_steps=1, disable_tqdm=True, report_to=[], save_strategy="no")


def sft_recipe(tok_dir: Path, workdir: Path, seed: int = 0, steps: int = SFT_STEPS, **overrides):
    """posttrain's SFTTrainer on the bundled corpus from a random model saved in ``workdir``, not yet run."""
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    init = workdir / "init"
    _save(_init_model("causal", seed, tok_dir, **overrides), init, tok_dir)
    cfg = SFTConfig(output_dir=str(workdir / "run"), seed=seed, max_steps=steps,
                    max_length=TINY_SHAPE["max_position_embeddings"], **RECIPE)
    return SFTTrainer(str(init), args=cfg, train_dataset=[{"text": line} for line in corpus()],
                      processing_class=load_tokenizer(tok_dir))


def reward_recipe(tok_dir: Path, workdir: Path, seed: int = 0, steps: int = REWARD_STEPS):
    """posttrain's RewardTrainer on synthetic preference pairs from a random classifier, not yet run."""
    from posttrain.demo import synthetic
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    init = workdir / "init"
    _save(_init_model("reward", seed, tok_dir), init, tok_dir)
    cfg = RewardConfig(output_dir=str(workdir / "run"), seed=seed, max_steps=steps,
                       max_length=TINY_SHAPE["max_position_embeddings"], **RECIPE)
    pairs = synthetic.preference_pairs(RECIPE["per_device_train_batch_size"] * steps, seed=10_000 + seed)
    return RewardTrainer(str(init), args=cfg, train_dataset=pairs, processing_class=load_tokenizer(tok_dir))


RECIPES = {"sft": sft_recipe, "reward": reward_recipe}


@contextlib.contextmanager
def _all_threads() -> Iterator[None]:
    """Use every core for a one-off build (torchrun sets OMP_NUM_THREADS=1; results do not change)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def first_batch(trainer) -> dict:
    """The first micro-batch a recipe's trainer trains on (its data order, one process)."""
    first = next(trainer.loader.steps(trainer.schedule, 0)).batches[0]
    return trainer.collate([trainer.train_rows[i] for i in first.rows])


def final_loss(model, trainer) -> float:
    """A model's loss on its recipe's first batch, as recorded in train_losses.json."""
    import torch

    from posttrain.trainers.reward import RewardTrainer, reward_loss
    from posttrain.trainers.sft import model_inputs

    batch = first_batch(trainer)
    model.eval()
    with torch.no_grad():
        if isinstance(trainer, RewardTrainer):
            rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
            return reward_loss(rewards, None, None)[0].item()
        return model(**model_inputs(batch), labels=batch["labels"]).loss.item()


def replay(trainer, steps: int) -> list[float]:
    """The first ``steps`` losses of a recipe's trainer (the full run's learning-rate schedule)."""
    with _all_threads():
        return [trainer.training_step(step)["loss"] for step in range(1, steps + 1)]


def _fit_and_save(recipe: Callable[[Path], Any], path: Path, tok_dir: Path) -> None:
    """Train an asset by its recipe and save it with its losses (what tests/test_tiny.py checks)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"posttrain-{path.name}-") as work:
        trainer = recipe(Path(work))
        with _all_threads():
            trainer.train()
        history = trainer.state.log_history
        model = trainer.session.unwrap(trainer.roles["trained"][0])
        losses = [row["loss"] for row in history if "loss" in row]
        _save(model, path, tok_dir, losses={"losses": losses, "final_first_batch": final_loss(model, trainer)})


def build_assets(dest: str | os.PathLike) -> dict[str, Path]:
    """Build the default assets into ``dest``; returns each asset's path by name."""
    dest = Path(dest)
    tok_dir, sft, reward = dest / "tokenizer", dest / _name("sft", 0, SFT_STEPS), dest / _name("reward-trained", 0, REWARD_STEPS)
    for path, build in ((tok_dir, _build_tokenizer),
                        (sft, lambda p: _fit_and_save(lambda work: sft_recipe(tok_dir, work), p, tok_dir)),
                        (reward, lambda p: _fit_and_save(lambda work: reward_recipe(tok_dir, work), p, tok_dir))):
        _log(f"building {path}")
        start = time.perf_counter()
        build(path)
        _log(f"built {path.name} in {time.perf_counter() - start:.0f} s")
    return {p.name: p for p in (tok_dir, sft, reward)}


def _build_one(dest: Path, kind: str, seed: int, steps: int, overrides: dict, name: str) -> Path:
    tok_dir = tokenizer_path()
    path = dest / name
    if kind == "sft":
        _fit_and_save(lambda work: sft_recipe(tok_dir, work, seed, steps, **overrides), path, tok_dir)
    else:
        _fit_and_save(lambda work: reward_recipe(tok_dir, work, seed, steps), path, tok_dir)
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the tiny default's assets from their recipe.")
    parser.add_argument("dest", help="output folder (posttrain/demo/data/tiny to refresh the shipped copies)")
    parser.add_argument("--asset", choices=sorted(RECIPES), help="build one trained variant only (posttrain's "
                        "cache builds use this), with --seed, --steps, --overrides (model shape, JSON) and --name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--overrides", type=json.loads, default={})
    parser.add_argument("--name")
    opts = parser.parse_args()
    if opts.asset:
        print(_build_one(Path(opts.dest), opts.asset, opts.seed, opts.steps, opts.overrides, opts.name))
    else:
        for built in build_assets(opts.dest).values():
            print(built)
