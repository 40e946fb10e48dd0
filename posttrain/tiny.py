"""The built-in tiny default: a small Llama-shaped causal LM, a sequence-classification reward
model with the same vocabulary, and a BPE tokenizer trained on text bundled with the package.

Built once into a cache folder and loaded with ``from_pretrained`` like any model, so tests and the
demo exercise the same loading code as a hub name or local path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import cache

DATA = Path(__file__).resolve().parent / "data"
SPECIAL = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small enough for two CPU processes, large enough to learn the bundled tasks.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)


def cache_dir() -> Path:
    """Where the tiny default is built: posttrain's cache (``posttrain.cache.cache_dir``), never site-packages."""
    return cache.cache_dir()


def corpus() -> list[str]:
    return (DATA / "tiny_corpus.txt").read_text().splitlines()


def words() -> dict[str, list[str]]:
    out = {}
    for line in (DATA / "words.txt").read_text().splitlines():
        key, value = line.split(": ", 1)
        out[key] = value.split("|") if key == "subjects" else value.split()
    return out


def _lock(name: str):
    from filelock import FileLock

    cache_dir().mkdir(parents=True, exist_ok=True)
    return FileLock(str(cache_dir() / f"{name}.lock"))


def tokenizer_path() -> Path:
    """A byte-level BPE tokenizer trained on the bundled corpus, with pad/eos and a chat template."""
    path = cache_dir() / "tokenizer"
    with _lock("tokenizer"):
        if not (path / "tokenizer.json").exists():
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
            fast.save_pretrained(str(path))
    return path


def load_tokenizer(path: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or tokenizer_path()))


def model_config(kind: str = "causal", **overrides):
    """A LlamaConfig of the tiny shape; ``kind`` is "causal" or "reward" (one-logit classifier)."""
    from transformers import LlamaConfig

    tok = load_tokenizer()
    shape = {**TINY_SHAPE, **overrides}
    cfg = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, tie_word_embeddings=False, **shape)
    if kind == "reward":
        cfg.num_labels = 1
    return cfg


def model_path(kind: str = "causal", seed: int = 0, **overrides) -> Path:
    """A randomly initialised tiny model saved with the tokenizer (cached; same seed, same weights)."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = cache_dir() / f"{kind}-s{seed}{'-' + tag if tag else ''}"
    with _lock(path.name):
        if not (path / "config.json").exists():
            import torch
            from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

            torch.manual_seed(seed)
            cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
            _save(cls.from_config(model_config(kind, **overrides)), path)
    return path


def _save(model, path: Path, note: str | None = None) -> None:
    """Save a cached asset with the tokenizer, whole or not at all (written aside, then renamed).

    Not plain ``model.save_pretrained``: once torch.distributed is up, transformers writes only on
    rank 0, and whichever rank takes the build lock first must write the asset.
    """
    from safetensors.torch import save_model

    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(tmp))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(tmp))
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer().save_pretrained(str(tmp))
    if note is not None:
        (tmp / "train_losses.txt").write_text(note)
    if path.exists():  # an incomplete earlier attempt
        shutil.rmtree(path)
    os.replace(tmp, path)


def _train(model, loss_fn, batches, lr: float) -> list[float]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / len(batches))
    losses = []
    model.train()
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fit_and_save(model, loss_fn, batches, path: Path) -> None:
    """Train a cached asset and save it with the tokenizer and its first and last loss."""
    import torch

    # torchrun sets OMP_NUM_THREADS=1; the one-off build of a cached asset may use every core.
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        losses = _train(model, loss_fn, batches, lr=3e-3)
    finally:
        torch.set_num_threads(before)
    _save(model, path, note=f"first {losses[0]:.4f} last {losses[-1]:.4f}\n")


def sft_model_path(seed: int = 0, steps: int = 300, **overrides) -> Path:
    """The tiny causal LM fine-tuned on the bundled corpus (each line ends with eos): a policy
    that writes sensible sentences, for PPO and DPO to start from. Built once, cached."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = cache_dir() / f"sft-s{seed}-n{steps}{'-' + tag if tag else ''}"
    with _lock(path.name):
        if not (path / "config.json").exists():
            import random

            import torch
            from transformers import AutoModelForCausalLM

            tok = load_tokenizer()
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(model_path("causal", seed, **overrides))
            lines = [line + tok.eos_token for line in corpus()]
            rng = random.Random(seed)
            batches = []
            for _ in range(steps):
                enc = tok(rng.sample(lines, 32), return_tensors="pt", padding=True)
                enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
                batches.append(enc)
            _fit_and_save(model, lambda m, b: m(**b).loss, batches, path)
    return path


def reward_model_path(seed: int = 0, steps: int = 200) -> Path:
    """The tiny sequence-classification reward model trained on bundled synthetic preferences
    (Bradley-Terry loss, as TRL's RewardTrainer): positive continuations score above negative."""
    path = cache_dir() / f"reward-trained-s{seed}-n{steps}"
    with _lock(path.name):
        if not (path / "config.json").exists():
            import torch
            import torch.nn.functional as F
            from transformers import AutoModelForSequenceClassification

            from . import synthetic

            tok = load_tokenizer()
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(model_path("reward", seed))
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

            _fit_and_save(model, loss_fn, batches, path)
    return path
