"""Shared test helpers: launching a script on two CPU processes, as a user would with torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# posttrain's Triton kernel runs in Triton's interpreter on this CPU; Triton reads this when a
# kernel's module is imported, so it is set before any test imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Set by an in-process session or accelerate (ACCELERATE_USE_DEEPSPEED, WORLD_SIZE, MASTER_PORT, ...):
# never handed to a launched run (torchrun sets its own world; a child TRL trainer would read
# ACCELERATE_USE_DEEPSPEED and train under DeepSpeed).
LEAKED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env(**extra: str) -> dict[str, str]:
    """The environment for a launched test run: this one without what in-process runs left in it."""
    env = {k: v for k, v in os.environ.items() if k not in LEAKED and not k.startswith("ACCELERATE_")}
    return {**env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", **extra}


def compile_ahead_of_time(source: str, cache: Path) -> str:
    """Run ``source`` (Triton kernels compiled for a GPU target with ``triton.compile``) in a
    subprocess without the interpreter, its Triton cache in ``cache``; its stdout (it must pass)."""
    import subprocess
    import sys

    env = {k: v for k, v in launch_env(TRITON_CACHE_DIR=str(cache)).items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_the_process_clean():
    """In-process trainers leave their process group, accelerate's process-wide state, transformers'
    DeepSpeed config and the environment they set (ACCELERATE_USE_DEEPSPEED, the one-process world's
    WORLD_SIZE and MASTER_PORT, ...) behind; later modules, and what they launch, would run under
    them. Each module leaves the process as it found it (the next session builds its own group)."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from posttrain.placement.world import forget_destroyed_group

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_destroyed_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None) -> str:
    """Run ``script`` on ``nproc`` CPU processes; fail the test with the output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    full_env = launch_env(**(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


def run_json(script: str, *args: str, tmp_path: Path, name: str = "out.json", **kw) -> dict:
    out = tmp_path / name
    torchrun(ROOT / "tests" / "dist" / script, out, *args, **kw)
    return json.loads(out.read_text())


# Trainer-run check scripts (each main(out, tmp), several trainers a launch already) that share one two-process
# launch, by the test module reading each one's JSON: the start-up of each launch saved.
TOGETHER = {"test_frozen": "frozen_checks",  # first: it checks that it leaves nothing patched process-wide
            "test_distill": "distill_checks", "test_lora_ppo_distill": "lora_ppo_distill",
            "test_sft": "sft_reward_checks",
            "test_grpo_dist": "grpo_checks"}  # last: its final trainer fails on purpose


@pytest.fixture(scope="session")
def launched_together(request, tmp_path_factory) -> Path:
    """tests/dist/together.py over the TOGETHER scripts of the selected test modules; the folder of their JSON."""
    modules = {getattr(getattr(item, "module", None), "__name__", None) for item in request.session.items}
    scripts = [script for module, script in TOGETHER.items() if module in modules]
    out = tmp_path_factory.mktemp("together")
    torchrun(ROOT / "tests" / "dist" / "together.py", out, *scripts)
    return out


def together_json(folder: Path, module: str) -> dict:
    """``module``'s script's JSON from launched_together (fails the test if that script did not run)."""
    return json.loads((folder / f"{TOGETHER[module]}.json").read_text())
