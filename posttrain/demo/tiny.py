"""The built-in tiny default: a small Llama-shaped causal LM, a sequence-classification reward
model with the same vocabulary, and a BPE tokenizer trained on text bundled with the package.

Loaded with ``from_pretrained`` like any model, so tests and the demo exercise the same loading
code as a hub name or local path. The default assets (the tokenizer, the SFT policy and the
trained reward model, about 2 MB) ship prebuilt in ``posttrain/demo/data/tiny/``: building them takes
minutes on a small shared CPU, which a first ``make demo`` should not pay. ``build_assets`` is
their recipe (``python -m posttrain.demo.tiny posttrain/demo/data/tiny`` rebuilds them) and
tests/test_tiny.py checks that it reproduces the shipped files. Any other variant (another seed,
shape or step count, the randomly initialised models) is built on first use into posttrain's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
    tok_dir = tokenizer_path()
    return _resolve(_name("sft", seed, steps, **overrides),
                    lambda path: _fit_and_save(sft_recipe(tok_dir, seed, steps, **overrides), path, tok_dir),
                    f"the tiny SFT policy ({steps} steps on the bundled corpus)")


def reward_model_path(seed: int = 0, steps: int = REWARD_STEPS) -> Path:
    """The tiny sequence-classification reward model trained on bundled synthetic preferences
    (Bradley-Terry loss, as TRL's RewardTrainer): positive continuations score above negative.
    Shipped for the defaults."""
    tok_dir = tokenizer_path()
    return _resolve(_name("reward-trained", seed, steps),
                    lambda path: _fit_and_save(reward_recipe(tok_dir, seed, steps), path, tok_dir),
                    f"the tiny reward model ({steps} steps on bundled preferences)")


def build_assets(dest: str | os.PathLike) -> dict[str, Path]:
    """Build the default assets from their recipe into ``dest`` (the shipped copies are not
    consulted): what ``posttrain/demo/data/tiny/`` holds. Returns each asset's path by name."""
    dest = Path(dest)
    tok_dir, sft, reward = dest / "tokenizer", dest / _name("sft", 0, SFT_STEPS), dest / _name("reward-trained", 0, REWARD_STEPS)
    for path, build in ((tok_dir, _build_tokenizer),
                        (sft, lambda p: _fit_and_save(sft_recipe(tok_dir), p, tok_dir)),
                        (reward, lambda p: _fit_and_save(reward_recipe(tok_dir), p, tok_dir))):
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


def _train(model, loss_fn, batches, desc: str, stop_after: int | None = None) -> list[float]:
    """AdamW at lr 3e-3 decaying linearly to 0 over ``batches``; ``stop_after`` ends it early (the
    same first steps, for checking a recipe against an asset's recorded losses)."""
    import torch
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / len(batches))
    losses = []
    model.train()
    # torchrun sets OMP_NUM_THREADS=1; the one-off build of an asset may use every core (the
    # result does not depend on the thread count: checked bitwise with 1 and 2).
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        for batch in tqdm(batches[:stop_after], desc=desc, mininterval=2.0, file=sys.stderr, disable=stop_after is not None):
            loss = loss_fn(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(before)
    return losses


def final_loss(model, recipe: tuple) -> float:
    """A trained asset's loss on its recipe's first batch, as recorded in train_losses.json."""
    import torch

    _, loss_fn, batches = recipe
    model.eval()
    with torch.no_grad():
        return loss_fn(model, batches[0]).item()


def _fit_and_save(recipe: tuple, path: Path, tok_dir: Path) -> None:
    """Train an asset by its recipe and save it with every step's loss and the final weights' loss
    on the first batch (what tests/test_tiny.py checks the recipe and the weights against)."""
    model = recipe[0]
    losses = _train(*recipe, desc=path.name)
    _save(model, path, tok_dir, losses={"losses": losses, "final_first_batch": final_loss(model, recipe)})


def sft_recipe(tok_dir: Path, seed: int = 0, steps: int = SFT_STEPS, **overrides) -> tuple:
    """(random model, loss function, batches): the SFT policy's training, not yet run."""
    import random

    import torch

    tok = load_tokenizer(tok_dir)
    model = _init_model("causal", seed, tok_dir, **overrides)
    torch.manual_seed(seed)
    lines = [line + tok.eos_token for line in corpus()]
    rng = random.Random(seed)
    batches = []
    for _ in range(steps):
        enc = tok(rng.sample(lines, 32), return_tensors="pt", padding=True)
        enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        batches.append(enc)
    return model, lambda m, b: m(**b).loss, batches


def reward_recipe(tok_dir: Path, seed: int = 0, steps: int = REWARD_STEPS) -> tuple:
    """(random model, loss function, batches): the reward model's Bradley-Terry training, not yet run."""
    import torch
    import torch.nn.functional as F

    from . import synthetic

    tok = load_tokenizer(tok_dir)
    model = _init_model("reward", seed, tok_dir)
    torch.manual_seed(seed)
    pairs = synthetic.preference_pairs(32 * steps, seed=10_000 + seed)
    batches = []
    for i in range(steps):
        rows = pairs[i * 32 : (i + 1) * 32]
        texts = [r["prompt"] + r["chosen"] + tok.eos_token for r in rows]
        texts += [r["prompt"] + r["rejected"] + tok.eos_token for r in rows]
        batches.append(tok(texts, return_tensors="pt", padding=True))

    def loss_fn(m, b):
        r = m(**b).logits.squeeze(-1)
        chosen, rejected = r.chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()

    return model, loss_fn, batches


def replay(recipe: tuple, steps: int) -> list[float]:
    """The first ``steps`` losses of a recipe (the full run's learning-rate schedule)."""
    return _train(*recipe, desc="replay", stop_after=steps)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the tiny default's assets from their recipe.")
    parser.add_argument("dest", help="output folder (posttrain/demo/data/tiny to refresh the shipped copies)")
    for built in build_assets(parser.parse_args().dest).values():
        print(built)
