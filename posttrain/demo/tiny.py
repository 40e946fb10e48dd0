"""The built-in tiny default: a small Llama-shaped LM, reward model and BPE tokenizer on bundled text;
defaults ship prebuilt in ``posttrain/demo/data/tiny/``, other variants build into posttrain's cache."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from posttrain.data.sft import TINY_CHAT_TEMPLATE
from posttrain.demo import DATA, corpus
from posttrain.run import cache

ASSETS = DATA / "tiny"  # the prebuilt default assets, named as their cached builds would be
SPECIAL = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Small enough for two CPU processes, large enough to learn the bundled tasks.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
SFT_STEPS, REWARD_STEPS = 300, 200  # the defaults' recipe


def cache_dir() -> Path:
    """Where the tiny default is built: posttrain's cache, never site-packages."""
    return cache.cache_dir()


def _complete(path: Path) -> bool:
    # Assets are written aside and renamed, so a folder with its main file is whole.
    return (path / "config.json").is_file() or (path / "tokenizer.json").is_file()


def _resolve(name: str, build: Callable[[Path], None], what: str) -> Path:
    """The shipped asset ``name``, else ``cache_dir()/name``, built once under a file lock."""
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
    """The tiny causal LM fine-tuned on the bundled corpus: the policy PPO and DPO start from."""
    return _resolve(_name("sft", seed, steps, **overrides),
                    lambda path: _build_in_child("sft", path, seed, steps, overrides),
                    f"the tiny SFT policy ({steps} steps of posttrain's SFTTrainer on the bundled corpus)")


def reward_model_path(seed: int = 0, steps: int = REWARD_STEPS) -> Path:
    """The tiny reward model trained on synthetic preferences (Bradley-Terry): positive scores higher."""
    return _resolve(_name("reward-trained", seed, steps),
                    lambda path: _build_in_child("reward", path, seed, steps, {}),
                    f"the tiny reward model ({steps} steps of posttrain's RewardTrainer on bundled preferences)")


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
    fast.chat_template = TINY_CHAT_TEMPLATE
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
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it (TRL loads by it)
    return model


def _save(model, path: Path, tok_dir: Path, losses: dict | None = None) -> None:
    """Save an asset with its tokenizer (and losses) from this process (save_pretrained: rank 0 only)."""
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


# Launcher variables a child build must not inherit: its trainer would join the caller's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _build_in_child(kind: str, path: Path, seed: int, steps: int, overrides: dict) -> None:
    """Build one trained asset into ``path`` in a child process (a world of one)."""
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_ENV and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))}
    root = str(Path(__file__).resolve().parents[2])  # the folder posttrain is imported from
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "posttrain.demo.recipes", str(path.parent), "--asset", kind, "--seed", str(seed),
           "--steps", str(steps), "--overrides", json.dumps(overrides), "--name", path.name]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"building {path} failed (exit status {proc.returncode}): see the messages above")
