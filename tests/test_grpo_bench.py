"""The GRPO end-to-end benchmark (benchmarks/races/grpo_bench.py) on two CPU processes: posttrain's
trainer and TRL's own GRPOTrainer (its ZeRO-2 placement) both run and land in the results."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_grpo_bench_runs_posttrain_and_trl(tmp_path):
    cmd = [sys.executable, "benchmarks/races/grpo_bench.py", "--shape", "tiny", "--nproc", "2", "--micro-batch", "4",
           "--seq-len", "20", "--response-len", "4", "--num-generations", "4", "--warmup", "1", "--steps", "1",
           "--mixes", "zero2-zero3,trl-zero2", "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["mix"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"zero2-zero3", "trl-zero2"}
    for row in rows.values():
        assert row["status"] == "ok" and row["step_s"] > 0 and row["world_size"] == 2, row
        assert row["canary"] == {"reference": 0.0} or row["canary"]["reference"] < row["canary_tolerance"]
    assert {"generate", "score", "train"} <= set(rows["zero2-zero3"]["phase_s"])
    assert "grpo_bench.py" in (tmp_path / "commands.txt").read_text()
