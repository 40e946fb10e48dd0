"""TRL 1.16's own example scripts, copied from the installed trl with posttrain's classes imported in place
of TRL's (the one change a user makes), run to the end on the tiny default and a local dataset folder;
their losses equal those of the same script on TRL's classes where TRL's numbers are the reference."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, launch_env

import posttrain

EXPORTED = set(posttrain._TRAINERS)


def swap_imports(source: str) -> str:
    """Move every name posttrain exports out of ``from trl import ...`` into ``from posttrain import ...``."""

    def swap(match: re.Match) -> str:
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",") if n.strip()]
        ours = [n for n in names if n in EXPORTED]
        theirs = [n for n in names if n not in EXPORTED]
        lines = []
        if theirs:
            lines.append(f"{indent}from trl import {', '.join(theirs)}")
        if ours:
            lines.append(f"{indent}from posttrain import {', '.join(ours)}")
        return "\n".join(lines)

    swapped = re.sub(r"^([ \t]*)from trl import ([^(\n]+)$", swap, source, flags=re.M)
    assert swapped != source, "no trl import of a trainer found"
    return swapped


def trl_script(name: str, folder: Path, ours: bool) -> Path:
    import trl

    source = (Path(trl.__file__).parent / "scripts" / f"{name}.py").read_text()
    path = folder / f"{name}_{'posttrain' if ours else 'trl'}.py"
    path.write_text(swap_imports(source) if ours else source)
    return path


def write_split(folder: Path, train: list[dict], test: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def run(script: Path, *args: str, nproc: int = 1, timeout: int = 600) -> str:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    cmd = [*launch, str(script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=script.parent, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def posttrain_losses(output_dir: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


def trl_losses(output_dir: Path, key: str = "loss") -> list[float]:
    last = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return [r[key] for r in json.loads((last / "trainer_state.json").read_text())["log_history"] if key in r]


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.demo import tiny

    lines = tiny.corpus()
    return write_split(tmp_path_factory.mktemp("text"), [{"text": t} for t in lines[:24]],
                       [{"text": t} for t in lines[-8:]])


COMMON = ("--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none", "--bf16", "false",
          "--seed", "42", "--disable_tqdm", "true")


def test_swap_imports_moves_only_posttrain_names() -> None:
    source = "from trl import SFTTrainer, get_peft_config, SFTConfig\n    from trl import TrlParser\n"
    assert swap_imports(source + "from trl import GRPOTrainer\n") == (
        "from trl import get_peft_config\nfrom posttrain import SFTTrainer, SFTConfig\n"
        "    from trl import TrlParser\nfrom posttrain import GRPOTrainer\n")


def test_trl_sft_script_runs_on_posttrain_with_trl_losses(tmp_path: Path, tiny_text: Path) -> None:
    """TRL's sft.py on posttrain, one process, with LoRA off: saved model loads, losses equal TRL's."""
    from posttrain.demo import tiny

    args = ("--model_name_or_path", tiny.model_path(), "--dataset_name", tiny_text, "--max_steps", "3",
            "--learning_rate", "1e-3", "--gradient_checkpointing", "false", "--save_steps", "3", *COMMON)
    ours, theirs = tmp_path / "ours", tmp_path / "trl"
    out = run(trl_script("sft", tmp_path, ours=True), *args, "--output_dir", ours)
    assert "Training completed" in out
    run(trl_script("sft", tmp_path, ours=False), *args, "--output_dir", theirs, "--use_cpu", "true")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ours).num_parameters() > 0
    assert posttrain_losses(ours) == pytest.approx(trl_losses(theirs), abs=1e-5)
