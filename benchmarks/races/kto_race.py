"""One GPU, KTO: TRL's own KTOTrainer against posttrain's, fp32 and bf16 optimizer states (issue 41).

Rows (each a fresh process, alternating, ``--rounds`` times; benchmarks/races/race.py runs them):

- ``trl``: ``trl.KTOTrainer`` on a bf16 model with a bf16 reference, no DeepSpeed, AdamW on the
  bf16 parameters (no fp32 master weights): TRL's strongest single-GPU setting;
- ``posttrain-{auto,ds,torch}-{bf16,fp32}``: posttrain's KTOTrainer, default mix, ``master_weights``
  bf16 or fp32, under ``single_process_engine`` ``auto`` (posttrain's default: on one GPU the torch
  path, posttrain/plain.py), ``deepspeed`` (DeepSpeed's ZeRO-2 engine) or ``torch`` (forced; the
  same run as auto's here, so not a default row). Each row records the ``engine`` that ran.

Both sides: the same random-weight model (Llama 1.1B shape, hidden 2048, 22 layers, built from a
config and saved once, as benchmarks/harness/grpo_e2e.py does), ``--rows`` unpaired rows a step
(labels alternating, so every batch holds both kinds) of ``--seq-len`` tokens, each row's KL sequence
as long, bf16, gradient checkpointing, learning rate 1e-6, one optimizer step per batch, a log line
every step. Timing, memory and output as benchmarks/races/race.py says.

    python benchmarks/races/kto_race.py --out DIR                       # one GPU
    DS_ACCELERATOR=cpu python benchmarks/races/kto_race.py --shape tiny --steps 2 --warmup 1 --rounds 1   # CPU check
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.races import race  # noqa: E402
from benchmarks.races.dpo_race import (  # noqa: E402  # the same sides as DPO's race
    DEFAULT_SIDES,
    SIDES,
    run_posttrain_with_reference,
    run_trl_with_reference,
)
from benchmarks.races.race import Stamps  # noqa: E402


def feedback_rows(n: int, seq_len: int) -> list[dict[str, Any]]:
    """``n`` rows whose prompt + completion (and prompt + a neighbour's completion, the KL sequence) is
    longer than ``seq_len`` tokens, so truncation to ``max_length = seq_len`` makes every sequence that long."""
    from benchmarks.harness.bench_models import prompt_rows

    texts = prompt_rows(2 * n, seq_len // 2 + 8)
    return [{"prompt": texts[2 * i]["prompt"], "completion": texts[2 * i + 1]["prompt"], "label": i % 2 == 0}
            for i in range(n)]


def run_trl(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps) -> None:
    from trl import KTOConfig, KTOTrainer

    run_trl_with_reference(spec, path, rows, out, stamps, KTOConfig, KTOTrainer, spec["rows"])


def run_posttrain(spec: dict[str, Any], path: Path, rows: list[dict], out: Path, stamps: Stamps,
                  engine: str, master_weights: str) -> dict[str, Any]:
    from posttrain.trainers.kto import KTOConfig, KTOTrainer

    return run_posttrain_with_reference(spec, path, rows, out, stamps, engine, master_weights, KTOConfig, KTOTrainer,
                                        spec["rows"])


def run_side(side: str, spec: dict[str, Any], out: Path, stamps: Stamps) -> dict[str, Any]:
    """One row, in this process: the side's trainer for warm-up + measured steps."""
    import torch

    from benchmarks.harness.bench_models import model_dir

    path = model_dir(spec["shape"], torch.bfloat16)
    rows = feedback_rows(spec["rows"] * (spec["warmup"] + spec["steps"]), spec["seq_len"])
    if side == "trl":
        run_trl(spec, path, rows, out, stamps)
        return {}
    _, engine, master_weights = side.split("-")
    return run_posttrain(spec, path, rows, out, stamps, engine, master_weights)


def targets(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 41's target: posttrain's default row no slower and no larger than TRL's."""
    lines = []
    for side in ("posttrain-auto-bf16", "posttrain-auto-fp32"):
        s = summary.get(side, {})
        if "speedup" in s and "memory_ratio" in s:
            lines.append(f"{side}: {s['speedup']:.2f}x TRL's speed, {s['memory_ratio']:.2f}x its peak memory "
                         f"(target: >= 1.00x speed, <= 1.00x memory)")
    return lines


RACE = race.Race(name="kto_race", doc=__doc__, script=__file__, sides=SIDES, default_sides=DEFAULT_SIDES,
                 run_side=run_side, targets=targets,
                 knobs={"rows": (8, 4, "unpaired rows per step"),
                        "seq_len": (512, 64, "tokens per sequence (the KL sequences as long)")})

if __name__ == "__main__":
    sys.exit(race.main(RACE))
