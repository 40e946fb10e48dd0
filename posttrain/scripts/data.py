"""A script's training and held-out data: ``--dataset_name``'s splits (TRL's way) or the bundled rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from trl import ScriptArguments

from posttrain.data.preference import load_dataset_source
from posttrain.demo import synthetic
from posttrain.errors import ConfigError
from posttrain.scripts.args import note
from posttrain.trainers.config import TrainConfig

Trainer = TypeVar("Trainer")


def load_train_eval(script: ScriptArguments, test_split_size: float, cfg: TrainConfig,
                    check: Callable[[Any, str], None] | None = None) -> tuple[Any, Any]:
    """(train, eval) datasets: eval is the test split or, with ``test_split_size``, part of train;
    None under ``eval_strategy: no`` or when there is none. ``check(dataset, name)`` validates each."""
    name = script.dataset_name
    train = load_dataset_source(name, script.dataset_train_split, script.dataset_config)
    if check is not None:
        check(train, f"{name} (split {script.dataset_train_split!r})")
    if cfg.eval_strategy == "no":
        if test_split_size or cfg.eval_steps:
            note("no evaluation will run: eval_strategy is 'no'; add --eval_strategy steps to evaluate")
        return train, None
    if test_split_size:
        size = int(test_split_size) if test_split_size >= 1 else test_split_size
        split = train.train_test_split(test_size=size, seed=cfg.seed)
        return split["train"], split["test"]
    try:
        test = load_dataset_source(name, script.dataset_test_split, script.dataset_config)
    except ConfigError:
        raise
    except (ValueError, KeyError):  # a single file, or a hub dataset without that split
        note(f"no evaluation will run: {name} has no {script.dataset_test_split!r} split; hold out part of the "
             "training data with --test_split_size 0.1, or pass --eval_strategy no")
        cfg.eval_strategy = "no"  # as the note says (the trainer refuses evaluation without an eval_dataset)
        return train, None
    if check is not None:
        check(test, f"{name} (split {script.dataset_test_split!r})")
    return train, test


def trainer_on_data(trainer_cls: Callable[..., Trainer], cfg: TrainConfig, script: ScriptArguments,
                    test_split_size: float, bundled: Callable[[], tuple[list[dict], list[dict]]],
                    check: Callable[[Any, str], None] | None = None, model: Any = None,
                    peft_config: Any = None, **trainer_kwargs: Any) -> tuple[Trainer, dict]:
    """A rows trainer on the script's data (or ``bundled()``) and its held-out metrics before training."""
    if script.dataset_name is None:
        from datasets import Dataset

        train_rows, test_rows = bundled()
        train, test = Dataset.from_list(train_rows), Dataset.from_list(test_rows)
        test = test if cfg.eval_strategy != "no" else None  # TRL's scripts pass none then
    else:
        train, test = load_train_eval(script, test_split_size, cfg, check=check)
    trainer = trainer_cls(model=model, args=cfg, train_dataset=train, eval_dataset=test, peft_config=peft_config,
                          **trainer_kwargs)
    return trainer, (trainer.evaluate() if test is not None else {})


def bundled_pairs(train_size: int, eval_size: int) -> tuple[list[dict], list[dict]]:
    """The bundled synthetic preference pairs as (train, held-out) rows, the latter of another seed."""
    return synthetic.preference_pairs(train_size, seed=0), synthetic.preference_pairs(eval_size, seed=1)


BUNDLED_PROMPTS = "posttrain's bundled synthetic prompts"


@dataclass
class PromptArguments:
    """Beside TRL's ScriptArguments in ``posttrain grpo``, ``rloo`` and ``ppo``."""

    num_prompts: int = 2048  # bundled prompts (no dataset_name)


def bundled_prompts(count: int, seed: int = 42) -> list[dict]:
    """The tiny default's bundled prompts as rows with a "prompt"."""
    return [{"prompt": p} for p in synthetic.prompts(count, seed=seed)]


def load_prompts(script: ScriptArguments, num_prompts: int, seed: int, algorithm: str) -> tuple[list[dict], str]:
    """The online scripts' prompt rows (the dataset's or bundled) and what the model card calls them."""
    from posttrain.data.prompts import check_prompt_rows

    if script.dataset_name is None:
        return bundled_prompts(num_prompts, seed), BUNDLED_PROMPTS
    name, split = script.dataset_name, script.dataset_train_split
    try:
        dataset = load_dataset_source(name, split, script.dataset_config)
    except ConfigError:
        raise
    except (ValueError, KeyError) as err:  # a single file, or a hub dataset without that split
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{name} (split {split!r}): {first}; set --dataset_train_split to one of its splits") from None
    return check_prompt_rows(dataset, name, algorithm), name
