"""One GPU, reward model: TRL's RewardTrainer against posttrain's RewardTrainer (issue 22).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):
``trl`` (``trl.RewardTrainer``) and ``posttrain`` (posttrain's RewardTrainer, default mix), both a
sequence classifier with one logit on the random-weight Llama 1.1B shape (benchmarks/harness/grpo_e2e.py's
``model_dir``; the score head is new, seeded), the same ``--pairs`` preference pairs per step
(prompt, chosen, rejected as text, each side close to ``--seq-len`` tokens and within
``max_length = --seq-len``, which both sides would otherwise drop), bf16 autocast, gradient
checkpointing (TRL's default), learning rate 1e-4 (TRL's default), dropout off (both defaults).
``--states bf16`` (default): TRL on a bf16 model against posttrain's ``master_weights: bf16``;
``fp32``: an fp32 model against fp32 master weights. posttrain runs its default
``single_process_engine: auto``: on one GPU the torch path at both precisions (no DeepSpeed engine;
the row records the ``engine``). Step time and peak memory as
benchmarks/races/race.py records them; tokens/s from the logged ``num_tokens`` (no padding).

    python benchmarks/races/reward_race.py --out DIR                       # one GPU
    DS_ACCELERATOR=cpu python benchmarks/races/reward_race.py --shape tiny --steps 1 --warmup 1 --rounds 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.race import Stamps  # noqa: E402

SIDES = ("trl", "posttrain")


def reward_pairs(n: int, seq_len: int) -> list[dict[str, str]]:
    """``n`` pairs whose prompt and completions are each a little under half of ``seq_len`` tokens
    (a retokenized boundary can add a token or two), so that no side passes ``max_length``."""
    from benchmarks.harness.bench_models import prompt_rows

    half = max(4, seq_len // 2 - 8)
    texts = prompt_rows(3 * n, half)
    return [{"prompt": texts[3 * i]["prompt"], "chosen": " " + texts[3 * i + 1]["prompt"],
             "rejected": " " + texts[3 * i + 2]["prompt"]} for i in range(n)]


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    import torch

    from benchmarks.harness.bench_models import model_dir

    path = model_dir(spec["shape"], torch.bfloat16)
    rows = reward_pairs(spec["pairs"] * (spec["warmup"] + spec["steps"]), spec["seq_len"])
    dtype = "bfloat16" if spec["states"] == "bf16" else "float32"
    common = dict(per_device_train_batch_size=spec["pairs"], max_length=spec["seq_len"], learning_rate=1e-4,
                  max_steps=spec["warmup"] + spec["steps"], bf16=True, gradient_checkpointing=True, logging_steps=1,
                  seed=0, disable_tqdm=True, model_init_kwargs={"dtype": dtype})
    if side == "trl":
        from datasets import Dataset
        from trl import RewardConfig, RewardTrainer

        from posttrain.demo import tiny

        args = RewardConfig(output_dir=str(out / side), save_strategy="no", report_to=[], dataloader_num_workers=0,
                            use_cpu=not torch.cuda.is_available(), **common)
        trainer = RewardTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(rows),
                                processing_class=tiny.load_tokenizer(path), callbacks=[stamps.callback()])
        pairs = len(trainer.train_dataset)
        stamps.mark()
        trainer.train()
        logs = stamps.logs
        return {"states": spec["states"], "pairs_kept": pairs, "losses": [r["loss"] for r in logs][spec["warmup"]:],
                "tokens_per_step": race.per_step_tokens([float(r["num_tokens"]) for r in logs])}
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    cfg = RewardConfig(output_dir=str(out / side), overwrite_output_dir=True, save_strategy="no",
                       master_weights=spec["states"], **common)
    trainer = RewardTrainer(str(path), args=cfg, train_dataset=rows)
    s = trainer.session
    history = stamps.train(trainer)
    return {"states": spec["states"], "pairs_kept": len(trainer.train_rows), "engine": s.engine_kind("reward"),
            "master_weights": s.master_weights("reward"), "losses": [h["loss"] for h in history][spec["warmup"]:],
            "tokens_per_step": race.per_step_tokens([float(h["num_tokens"]) for h in history]),
            "phase_s": race.phase_medians(history[spec["warmup"]:])}


RACE = race.Race(name="reward_race", doc=__doc__, script=__file__, sides=SIDES, run_side=run_side, steps=5, warmup=2,
                 knobs={"pairs": (8, 2, "preference pairs per step"),
                        "seq_len": (1024, 64, "tokens per side (max_length)"),
                        "states": ("bf16", "bf16", "optimizer precision on both sides: bf16 or fp32")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
