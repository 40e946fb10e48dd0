"""One GPU, SFT: TRL's SFTTrainer against posttrain's SFTTrainer, packed and padding-free (issue 22).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl-packed`` / ``posttrain-packed``: ``packing=True`` with TRL's default strategy ``bfd`` on
  both sides (documents packed into rows of ``--seq-len`` tokens, padding-free batches: one row,
  position ids restarting per document), ``--batch`` packed rows per step;
- on documents of mixed lengths, ``--batch`` documents per step, no packing:
  ``posttrain-padded`` / ``trl-padded`` (right-padded to the longest of the batch) and
  ``posttrain-padding-free`` / ``trl-padding-free`` (TRL's collator: the batch as one row,
  no pad tokens). The issue's target is padding-free over padded, posttrain's own, >= 1.3x.

Both sides: the same random-weight model (Llama 1.1B shape built from a config and saved once,
benchmarks/harness/grpo_e2e.py's ``model_dir``), the same documents (text of the tiny corpus, see
``documents``), bf16 autocast, gradient checkpointing (TRL's default), learning rate 2e-5, ``--attn`` attention on both.
``--states bf16`` (default): TRL on a bf16 model (AdamW on bf16 weights: its strongest one-GPU
setting) against posttrain's ``master_weights: bf16``; ``fp32``: TRL on an fp32 model against
posttrain's fp32 master weights. posttrain runs its default ``single_process_engine: auto``, which
for SFT on one GPU is the torch path at both precisions (no DeepSpeed engine; fp32 weights and Adam
states with a bf16 autocast forward for ``fp32``); the row records the ``engine``. tokens/s counts the
tokens fed to the model (no padding: TRL's and posttrain's logged ``num_tokens``) over the timed
steps. Attention: with ``sdpa`` a padding-free row gets a block-diagonal mask (transformers builds
it from the position ids), so its attention covers the whole row; ``flash_attention_2`` (where
installed), ``flex_attention`` and posttrain's ``varlen`` (torch's own FlashAttention varlen kernel,
posttrain/varlen_attention.py) attend per document. ``--attn-posttrain varlen`` runs posttrain's
padding-free and packed rows with it while every other row keeps ``--attn``; each row records the
attention it ran (``attn_implementation``, and the summary's "attention:" line).

    python benchmarks/races/sft_race.py --out DIR                           # one GPU
    DS_ACCELERATOR=cpu python benchmarks/races/sft_race.py --shape tiny --steps 1 --warmup 1 --rounds 1
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import Stamps  # noqa: E402

SIDES = ("trl-packed", "posttrain-packed", "posttrain-padded", "posttrain-padding-free", "trl-padding-free",
         "trl-padded")
BASELINES = {"posttrain-packed": "trl-packed", "posttrain-padding-free": "trl-padding-free",
             "posttrain-padded": "trl-padded", "trl-padding-free": "trl-padded"}
# Packed documents are a quarter to all of a row long; mixed-length ones 1/16 to all of --seq-len.
PACKED_MIN, MIXED_MIN = 4, 16


def documents(seq_len: int, min_fraction: int, *, tokens: int = 0, count: int = 0,
              seed: int = 0) -> list[dict[str, str]]:
    """Text documents of the tiny corpus of about uniform lengths in [seq_len // min_fraction,
    seq_len] tokens with the EOS both trainers add (never more: no side truncates), ``count`` of
    them or until they hold ``tokens`` tokens; the same for every side that asks the same. (Text,
    not token ids: both sides also take a pre-tokenized ``input_ids`` dataset, tested equal to its
    text in tests/test_sft.py, but the race times them on the path most users take.)"""
    from posttrain.demo import tiny

    tok = tiny.load_tokenizer()
    stream: list[int] = []
    for line in tiny.corpus():
        stream += tok(line + " ", add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    docs, total = [], 0
    while len(docs) < count or total < tokens:
        limit = rng.randint(max(2, seq_len // min_fraction), seq_len) - 1  # room for the EOS
        start = rng.randrange(len(stream))
        ids = (stream[start:] + stream * (1 + limit // len(stream)))[:limit]
        while True:  # a decoded slice can retokenize a little longer: trim until it fits
            text = tok.decode(ids, skip_special_tokens=True).strip()
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= limit:
                break
            ids = ids[: limit - (len(ids) - limit)]
        docs.append({"text": text})
        total += len(ids) + 1
    return docs


def side_data(side: str, spec: dict[str, Any]) -> tuple[list[dict], bool, bool]:
    """(documents, packing, padding_free) of a side."""
    steps = spec["warmup"] + spec["steps"]
    if side.endswith("packed"):  # enough to fill every step's rows, with room for bfd's partly filled bins
        return documents(spec["seq_len"], PACKED_MIN, tokens=int(1.3 * steps * spec["batch"] * spec["seq_len"])), True, False
    return documents(spec["seq_len"], MIXED_MIN, count=steps * spec["batch"], seed=1), False, side.endswith("padding-free")


def attention(spec: dict[str, Any]) -> str:
    """``--attn auto``: flash-attention 2 where the package is installed, else sdpa."""
    if spec["attn"] != "auto":
        return spec["attn"]
    import importlib.util

    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import model_dir

    path = model_dir(spec["shape"], torch.bfloat16)
    rows, packing, padding_free = side_data(side, spec)
    attn = attention(spec)
    if side.startswith("posttrain") and (packing or padding_free) and spec["attn_posttrain"] != "same":
        attn = None if spec["attn_posttrain"] == "default" else spec["attn_posttrain"]  # None: posttrain's choice
    dtype = "bfloat16" if spec["states"] == "bf16" else "float32"
    init = {"dtype": dtype, **({"attn_implementation": attn} if attn else {})}
    common = dict(per_device_train_batch_size=spec["batch"], learning_rate=2e-5, max_steps=spec["warmup"] + spec["steps"],
                  bf16=True, gradient_checkpointing=True, logging_steps=1, seed=0, disable_tqdm=True,
                  packing=packing, padding_free=padding_free,
                  # padding-free without packing bounds nothing by max_length (both refuse it): the rows fit.
                  max_length=None if padding_free else spec["seq_len"],
                  model_init_kwargs=init)
    info = {"states": spec["states"], "documents": len(rows)}
    if side.startswith("trl"):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from posttrain.demo import tiny

        args = SFTConfig(output_dir=str(out / side), save_strategy="no", report_to=[], dataloader_num_workers=0,
                         use_cpu=not torch.cuda.is_available(), **common)
        trainer = SFTTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tiny.load_tokenizer(path), callbacks=[stamps.callback()])
        stamps.mark()
        trainer.train()
        logs = stamps.logs
        return {**info, "attn_implementation": trainer.model.config._attn_implementation, "losses": [r["loss"] for r in logs][spec["warmup"]:],
                "tokens_per_step": race.per_step_tokens([float(r["num_tokens"]) for r in logs])}
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    cfg = SFTConfig(output_dir=str(out / side), overwrite_output_dir=True, master_weights=spec["states"], **common)
    trainer = SFTTrainer(str(path), args=cfg, train_dataset=rows)
    s = trainer.session
    history = stamps.train(trainer)
    return {**info, "attn_implementation": s.unwrap("policy").config._attn_implementation,
            "engine": s.engine_kind("policy"), "master_weights": s.master_weights("policy"),
            "losses": [h["loss"] for h in history][spec["warmup"]:],
            "tokens_per_step": race.per_step_tokens([float(h["num_tokens"]) for h in history]),
            "phase_s": race.phase_medians(history[spec["warmup"]:])}


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 22's targets, as measured."""
    lines = []

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = summary.get(a, {}).get(key), summary.get(b, {}).get(key)
        return x / y if x and y else None

    speed, memory = ratio("posttrain-packed", "trl-packed", "tokens_per_s"), ratio(
        "posttrain-packed", "trl-packed", "peak_allocated_gib")
    if speed is not None:
        lines.append(f"packed: posttrain tokens/s {speed:.2f}x TRL's (target >= 1.0: {'met' if speed >= 1 else 'missed'})")
    if memory is not None:
        lines.append(f"packed: posttrain peak memory {memory:.2f}x TRL's (target <= 1.0: "
                     f"{'met' if memory <= 1 else 'missed'})")
    for who in ("posttrain", "trl"):
        r = ratio(f"{who}-padding-free", f"{who}-padded", "tokens_per_s")
        if r is not None:
            goal = f" (target >= 1.3: {'met' if r >= 1.3 else 'missed'})" if who == "posttrain" else ""
            lines.append(f"mixed lengths: {who} padding-free tokens/s {r:.2f}x padded{goal}")
    attn = {r["side"]: r.get("attn_implementation") for r in rows if r.get("attn_implementation")}
    if attn:
        lines.append("attention: " + ", ".join(f"{side} {name}" for side, name in attn.items()))
    return lines


RACE = race.Race(name="sft_race", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side, baselines=BASELINES,
                 targets=targets, steps=5, warmup=2,
                 knobs={"batch": (8, 2, "packed rows (packed sides) or documents (the others) per step"),
                        "seq_len": (2048, 64, "tokens per packed row, the longest document"),
                        "states": ("bf16", "bf16", "optimizer precision on both sides: bf16 or fp32"),
                        "attn": ("sdpa", "sdpa", "attention implementation on both sides (auto: flash-attention 2 "
                                                 "if installed)"),
                        "attn_posttrain": ("same", "same", "attention of posttrain's padding-free and packed rows: "
                                           "same (--attn), default (posttrain's own choice: varlen on CUDA) or a "
                                           "name such as varlen (posttrain.models.varlen_attention)")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
