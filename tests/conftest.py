"""Shared test helpers: launching a script on two CPU processes, as a user would with torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None) -> str:
    """Run ``script`` on ``nproc`` CPU processes; fail the test with the output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


def run_json(script: str, *args: str, tmp_path: Path, name: str = "out.json", **kw) -> dict:
    out = tmp_path / name
    torchrun(ROOT / "tests" / "dist" / script, out, *args, **kw)
    return json.loads(out.read_text())
