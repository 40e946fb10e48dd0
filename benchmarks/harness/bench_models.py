"""What the benchmarks train on: random-weight models of a preset's shape saved once (a preset has no
checkpoint, and the trainers, posttrain's and TRL's alike, load models from a path), and rows of the
tiny corpus's text cut to exact token lengths.

Every model is saved with the tiny default's tokenizer: its 547 ids are valid in every preset's
vocabulary, so one tokenizer serves every role of a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.demo import tiny
from posttrain.planner import memory, shapes


def model_dir(shape: str, dtype: torch.dtype, kind: str = "causal", vocab_size: int | None = None,
              seed: int = 0) -> Path:
    """A model of ``shape`` (a preset) with random weights (``seed``), saved once under
    ``.cache/posttrain/bench-models``: ``kind`` "causal" or "sequence" (a one-logit classifier, as
    reward and value models), ``vocab_size`` the run's shared vocabulary (default the preset's).
    A hub name or local path is returned as it is: the trainers load its weights."""
    from filelock import FileLock

    if shape not in memory.SHAPES:
        return Path(shape)
    base = tiny.cache_dir() / "bench-models"
    base.mkdir(parents=True, exist_ok=True)
    # The name of a default causal model is the one benchmarks/races/dpo_race.py and distill_race.py share.
    parts = [shape, *([kind] if kind != "causal" else []),
             *([f"v{vocab_size}"] if vocab_size not in (None, memory.SHAPES[shape]["vocab_size"]) else []),
             *([f"seed{seed}"] if seed else []), str(dtype).removeprefix("torch.")]
    path = base / "-".join(parts)
    with FileLock(str(base / f"{path.name}.lock")):
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            tok = tiny.load_tokenizer()
            cfg = memory.model_config(shape, kind, vocab_size)
            cfg.eos_token_id, cfg.pad_token_id = tok.eos_token_id, tok.pad_token_id
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is fast there
                model = shapes.model_class(kind).from_config(cfg, dtype=dtype)
            model.save_pretrained(str(path))
            del model
            if torch.cuda.is_available():  # the run's peak is the trainer's, not this
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            tok.save_pretrained(str(path))
    return path


def prompt_rows(n: int, prompt_len: int) -> list[dict[str, str]]:
    """``n`` distinct prompts of the tiny corpus's text, each about ``prompt_len`` tokens."""
    tok = tiny.load_tokenizer()
    lines = tiny.corpus()
    rows = []
    for i in range(n):
        text, k = "", i
        while len(tok(text)["input_ids"]) < prompt_len:
            text += lines[k % len(lines)] + " "
            k += 7
        ids = tok(text)["input_ids"][:prompt_len]
        rows.append({"prompt": tok.decode(ids)})
    return rows


def preference_rows(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` pairs whose prompt + completion is longer than ``seq_len`` tokens on either side, so
    that truncation to ``max_length = seq_len`` makes every sequence exactly that long."""
    texts = prompt_rows(3 * n, seq_len // 2 + 8)
    return [{"prompt": texts[3 * i]["prompt"], "chosen": " " + texts[3 * i + 1]["prompt"],
             "rejected": " " + texts[3 * i + 2]["prompt"]} for i in range(n)]


def completion_rows(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` prompt-completion rows longer than ``seq_len`` tokens (cut to it by ``max_length``)."""
    texts = prompt_rows(2 * n, seq_len // 2 + 8)
    return [{"prompt": texts[2 * i]["prompt"], "completion": " " + texts[2 * i + 1]["prompt"]} for i in range(n)]
