"""The built-in tiny default: a small Llama-shaped causal LM, a sequence-classification reward
model with the same vocabulary, and a BPE tokenizer trained on text bundled with the package.

Loaded with ``from_pretrained`` like any model, so tests and the demo exercise the same loading
code as a hub name or local path. The default assets (the tokenizer, the SFT policy and the
trained reward model, about 2 MB) ship prebuilt in ``posttrain/demo/data/tiny/``: building them takes
minutes on a small shared CPU, which a first ``make demo`` should not pay. ``build_assets`` is
their recipe (``python -m posttrain.demo.tiny posttrain/demo/data/tiny`` rebuilds them): the
policy is trained by posttrain's own SFTTrainer and the reward model by its RewardTrainer, on one
process without DeepSpeed, and tests/test_tiny.py checks that the recipe reproduces the shipped files. Any other variant (another seed,
shape or step count, the randomly initialised models) is built on first use into posttrain's cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import cache
from . import DATA, corpus

ASSETS = DATA / "tiny"  # the prebuilt default assets, named as their cached builds would be
SPECIAL = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small enough for two CPU processes, large enough to learn the bundled tasks.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
SFT_STEPS, REWARD_STEPS = 300, 200  # the defaults' recipe (each step a batch of 32 lines or pairs)


def cache_dir() -> Path:
    """Where the tiny default is built: posttrain's cache (``posttrain.cache.cache_dir``), never site-packages."""
    return cache.cache_dir()


# -- where an asset comes from -----------------------------------------------------------------
def _complete(path: Path) -> bool:
    # Assets are written aside and renamed, so a folder with its main file is whole.
    return (path / "config.json").is_file() or (path / "tokenizer.json").is_file()


def _resolve(name: str, build: Callable[[Path], None], what: str) -> Path:
    """The shipped asset ``name`` when the package has it, else ``cache_dir()/name``, built there
    once by whichever process takes the lock first (the others wait and load it)."""
    if _complete(ASSETS / name):
        return ASSETS / name
    path = cache_dir() / name
    cache_dir().mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(cache_dir() / f"{name}.lock")):
        if not _complete(path):
            _log(f"building {what} once into {path}")
            start = time.perf_counter()
            build(path)
            _log(f"built {name} in {time.perf_counter() - start:.0f} s")
    return path


def _log(message: str) -> None:
    # Only the process that builds an asset gets here (once per machine): no rank check needed.
    print(f"posttrain.demo.tiny: {message}", file=sys.stderr, flush=True)


def _name(prefix: str, seed: int, steps: int | None = None, **overrides) -> str:
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return f"{prefix}-s{seed}" + (f"-n{steps}" if steps is not None else "") + (f"-{tag}" if tag else "")


# -- public paths ------------------------------------------------------------------------------
def tokenizer_path() -> Path:
    """A byte-level BPE tokenizer trained on the bundled corpus, with pad/eos and a chat template."""
    return _resolve("tokenizer", _build_tokenizer, "the tiny tokenizer")


def load_tokenizer(path: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or tokenizer_path()))


def model_config(kind: str = "causal", **overrides):
    """A LlamaConfig of the tiny shape; ``kind`` is "causal" or "reward" (one-logit classifier)."""
    return _config(kind, load_tokenizer(), **overrides)


def model_path(kind: str = "causal", seed: int = 0, **overrides) -> Path:
    """A randomly initialised tiny model saved with the tokenizer (cached; same seed, same weights)."""
    tok_dir = tokenizer_path()
    return _resolve(_name(kind, seed, **overrides),
                    lambda path: _save(_init_model(kind, seed, tok_dir, **overrides), path, tok_dir),
                    f"a random tiny {kind} model")


def sft_model_path(seed: int = 0, steps: int = SFT_STEPS, **overrides) -> Path:
    """The tiny causal LM fine-tuned on the bundled corpus (each line ends with eos): a policy
    that writes sensible sentences, for PPO and DPO to start from. Shipped for the defaults."""
    return _resolve(_name("sft", seed, steps, **overrides),
                    lambda path: _build_in_child("sft", path, seed, steps, overrides),
                    f"the tiny SFT policy ({steps} steps of posttrain's SFTTrainer on the bundled corpus)")


def reward_model_path(seed: int = 0, steps: int = REWARD_STEPS) -> Path:
    """The tiny sequence-classification reward model trained on bundled synthetic preferences
    (Bradley-Terry loss, as TRL's RewardTrainer): positive continuations score above negative.
    Shipped for the defaults."""
    return _resolve(_name("reward-trained", seed, steps),
                    lambda path: _build_in_child("reward", path, seed, steps, {}),
                    f"the tiny reward model ({steps} steps of posttrain's RewardTrainer on bundled preferences)")


def build_assets(dest: str | os.PathLike) -> dict[str, Path]:
    """Build the default assets from their recipe into ``dest`` (the shipped copies are not
    consulted): what ``posttrain/demo/data/tiny/`` holds. Returns each asset's path by name."""
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


# -- the recipes -------------------------------------------------------------------------------
def _write_aside(path: Path, write: Callable[[Path], None]) -> None:
    """Write an asset whole or not at all: into a sibling folder, then renamed."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    if path.exists():  # an incomplete earlier attempt
        shutil.rmtree(path)
    os.replace(tmp, path)


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=128)
    fast.chat_template = CHAT_TEMPLATE
    _write_aside(path, lambda tmp: fast.save_pretrained(str(tmp)))


def _config(kind: str, tok, **overrides):
    from transformers import LlamaConfig

    shape = {**TINY_SHAPE, **overrides}
    cfg = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, tie_word_embeddings=False, **shape)
    if kind == "reward":
        cfg.num_labels = 1
    return cfg


def _init_model(kind: str, seed: int, tok_dir: Path, **overrides):
    """A randomly initialised tiny model: the same seed gives the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    model = cls.from_config(_config(kind, load_tokenizer(tok_dir), **overrides))
    model.config.dtype = model.dtype  # recorded in config.json, as from_pretrained does
    return model


def _save(model, path: Path, tok_dir: Path, losses: dict | None = None) -> None:
    """Save an asset with its tokenizer (and, for a trained one, its training losses).

    Not plain ``model.save_pretrained``: once torch.distributed is up, transformers writes only on
    rank 0, and whichever rank takes the build lock first must write the asset.
    """
    from safetensors.torch import save_model

    def write(tmp: Path) -> None:
        model.config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        load_tokenizer(tok_dir).save_pretrained(str(tmp))
        if losses is not None:
            (tmp / "train_losses.json").write_text(json.dumps(losses))

    _write_aside(path, write)


# The recipes' settings: AdamW at lr 3e-3 (weight decay 0.01), decaying linearly to 0, clipped at 1,
# 32 lines or pairs a step, fp32, one process.
RECIPE = dict(learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
              per_device_train_batch_size=32, gradient_checkpointing=False, mixed_precision="no",
              single_process_engine="torch", logging_steps=1, disable_tqdm=True, report_to=[])


def sft_recipe(tok_dir: Path, workdir: Path, seed: int = 0, steps: int = SFT_STEPS, **overrides):
    """posttrain's SFTTrainer on the bundled corpus (each line ends with eos), from a randomly
    initialised model saved in ``workdir``: the SFT policy's training, set up but not yet run."""
    from ..trainers.sft import SFTConfig, SFTTrainer

    init = workdir / "init"
    _save(_init_model("causal", seed, tok_dir, **overrides), init, tok_dir)
    cfg = SFTConfig(output_dir=str(workdir / "run"), model_name_or_path=str(init), seed=seed, max_steps=steps,
                    max_length=TINY_SHAPE["max_position_embeddings"], **RECIPE)
    return SFTTrainer(cfg, train_dataset=[{"text": line} for line in corpus()], tokenizer=load_tokenizer(tok_dir))


def reward_recipe(tok_dir: Path, workdir: Path, seed: int = 0, steps: int = REWARD_STEPS):
    """posttrain's RewardTrainer (Bradley-Terry) on bundled synthetic preference pairs, one pass,
    from a randomly initialised classifier saved in ``workdir``: set up but not yet run."""
    from ..trainers.reward import RewardConfig, RewardTrainer
    from . import synthetic

    init = workdir / "init"
    _save(_init_model("reward", seed, tok_dir), init, tok_dir)
    cfg = RewardConfig(output_dir=str(workdir / "run"), model_name_or_path=str(init), seed=seed, max_steps=steps,
                       max_length=TINY_SHAPE["max_position_embeddings"], **RECIPE)
    pairs = synthetic.preference_pairs(RECIPE["per_device_train_batch_size"] * steps, seed=10_000 + seed)
    return RewardTrainer(cfg, train_dataset=pairs, tokenizer=load_tokenizer(tok_dir))


RECIPES = {"sft": sft_recipe, "reward": reward_recipe}


@contextlib.contextmanager
def _all_threads() -> Iterator[None]:
    """torchrun sets OMP_NUM_THREADS=1; the one-off build of an asset may use every core (the result
    does not depend on the thread count: checked bitwise with 1 and 2)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def first_batch(trainer) -> dict:
    """The first micro-batch a recipe's trainer trains on (its data order on one process)."""
    from ..trainers.common import rank_batches

    idx = next(rank_batches(len(trainer.train_rows), trainer.cfg.per_device_train_batch_size, trainer.cfg.seed, 0, 1))
    return trainer.collate([trainer.train_rows[i] for i in idx])


def final_loss(model, trainer) -> float:
    """A model's loss on its recipe's first batch, as recorded in train_losses.json (the SFT model's
    token-mean NLL, the reward model's Bradley-Terry loss)."""
    import torch

    from ..trainers.reward import RewardTrainer, reward_loss
    from ..trainers.sft import model_inputs

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
    """Train an asset by its recipe (given a scratch folder) and save it with every step's loss and
    the final weights' loss on the first batch (what tests/test_tiny.py checks the recipe and the
    weights against)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"posttrain-{path.name}-") as work:
        trainer = recipe(Path(work))
        with _all_threads():
            history = trainer.train()
        model = trainer.session.unwrap(trainer.roles["trained"][0])
        losses = [row["loss"] for row in history if "loss" in row]
        _save(model, path, tok_dir, losses={"losses": losses, "final_first_batch": final_loss(model, trainer)})


# Launcher variables a child build must not inherit: its trainer would join the caller's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _build_in_child(kind: str, path: Path, seed: int, steps: int, overrides: dict) -> None:
    """Build one trained asset into ``path`` with its trainer in a process of its own (a world of
    one, whatever process asked for it: a rank of a launched run waits on the build lock)."""
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_ENV and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))}
    root = str(Path(__file__).resolve().parents[2])  # the folder posttrain is imported from
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "posttrain.demo.tiny", str(path.parent), "--asset", kind, "--seed", str(seed),
           "--steps", str(steps), "--overrides", json.dumps(overrides), "--name", path.name]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"building {path} failed (exit status {proc.returncode}): see the messages above")


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
