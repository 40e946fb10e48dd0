"""posttrain as a user installs it: the wheel, in a fresh venv, run from outside the repository.

The wheel is built from a copy of the sources (the build writes ``build/`` and egg-info beside
them, which must not land in the shared checkout). The fresh venv sees the test venv's
dependencies through a ``.pth`` line: a directory named there is added to ``sys.path`` but its own
``.pth`` files are not processed, so posttrain's editable install is invisible and only the wheel
can be imported.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from posttrain.run import cache

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "posttrain" / "presets" / "deepspeed").glob("*.json"))
ACCELERATE_CONFIGS = sorted(p.name for p in (ROOT / "posttrain" / "presets" / "accelerate").glob("*.yaml"))


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "posttrain", src / "posttrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POSTTRAIN_CACHE", "TORCH_EXTENSIONS_DIR")}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp / "wheel", src], cwd=tmp, env=env)
    (wheel,) = (tmp / "wheel").glob("posttrain-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp, env=env).strip())
    (site / "test_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         cwd=tmp, env=env)

    cwd = tmp / "elsewhere"  # outside the repository: nothing can be found relative to it
    cwd.mkdir()
    return {"tmp": tmp, "wheel": wheel, "venv": venv, "python": python, "site": site, "cwd": cwd,
            "env": {**env, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}


@pytest.fixture(scope="module")
def session_run(installed) -> dict:
    """Two processes, the installed package, presets by name. The tiny default and DeepSpeed's op
    come from this checkout's cache (building them again would cost minutes); where the installed
    package puts its cache by default is checked separately below."""
    script = installed["cwd"] / "session.py"
    shutil.copy(ROOT / "tests" / "dist" / "installed_session.py", script)
    out = installed["cwd"] / "session.json"
    env = {**installed["env"], "POSTTRAIN_CACHE": str(cache.cache_dir()),
           "TORCH_EXTENSIONS_DIR": str(cache.torch_extensions_dir())}
    _run([installed["python"], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, out],
         cwd=installed["cwd"], env=env, timeout=600)
    return json.loads(out.read_text())


def test_wheel_ships_presets_and_data(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert sorted(n for n in names if n.startswith("posttrain/presets/deepspeed/")) == [
        f"posttrain/presets/deepspeed/{p}.json" for p in PRESETS
    ]
    assert sorted(n for n in names if n.startswith("posttrain/presets/accelerate/")) == [
        f"posttrain/presets/accelerate/{p}" for p in ACCELERATE_CONFIGS
    ]
    # Every bundled data file, subfolders included (the tiny default's prebuilt assets).
    data = {f"posttrain/{p.relative_to(ROOT / 'posttrain').as_posix()}" for p in (ROOT / "posttrain" / "demo" / "data").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert {"posttrain/demo/data/tiny_corpus.txt", "posttrain/demo/data/words.txt"} <= data
    assert data <= names, sorted(data - names)
    assert "posttrain/run/modelcard_methods.yaml" in names  # each method's name, tags and paper for the model card


def test_installed_package_resolves_presets_and_caches_outside_site_packages(installed):
    user_cache = installed["tmp"] / "xdg"
    probe = (
        "import json, os, posttrain\n"
        "from posttrain.placement import dsconfig\n"
        "from posttrain.demo import tiny\n"
        "try:\n"
        "    dsconfig.config_path('no_such_preset')\n"
        "    error = None\n"
        "except posttrain.ConfigError as err:\n"
        "    error = str(err)\n"
        "print(json.dumps({'file': posttrain.__file__, 'error': error, 'cache': str(tiny.cache_dir()),\n"
        "                  'ext': os.environ['TORCH_EXTENSIONS_DIR'],\n"
        "                  'zero2': dsconfig.read_config('zero2_train')['zero_optimization']['stage']}))\n"
    )
    env = {**installed["env"], "XDG_CACHE_HOME": str(user_cache)}
    found = json.loads(_run([installed["python"], "-c", probe], cwd=installed["cwd"], env=env).splitlines()[-1])
    assert Path(found["file"]).is_relative_to(installed["site"])
    assert found["zero2"] == 2
    assert found["error"].endswith("one of: " + ", ".join(PRESETS))
    # Installed (no pyproject.toml beside the package): the user cache, never site-packages.
    assert Path(found["cache"]) == user_cache / "posttrain"
    assert Path(found["ext"]).is_relative_to(user_cache / "posttrain" / "torch_extensions")

    # POSTTRAIN_CACHE moves both; a TORCH_EXTENSIONS_DIR the user set is kept.
    env = {**env, "POSTTRAIN_CACHE": str(installed["tmp"] / "mine"), "TORCH_EXTENSIONS_DIR": "/opt/ext"}
    found = json.loads(_run([installed["python"], "-c", probe], cwd=installed["cwd"], env=env).splitlines()[-1])
    assert (found["cache"], found["ext"]) == (str(installed["tmp"] / "mine"), "/opt/ext")


def test_plan_console_script(installed):
    out = _run([installed["venv"] / "bin" / "posttrain", "plan", "--workload", "dpo", "--shape", "1b"],
               cwd=installed["cwd"], env=installed["env"])
    assert "dpo · mix zero2-zero3 · 2 GPUs" in out
    assert "recommended:" in out


def test_two_process_session_from_the_wheel(installed, session_run):
    assert session_run["world"] == 2
    assert Path(session_run["posttrain_file"]).is_relative_to(installed["site"])
    assert session_run["configs"] == {"policy": "zero2_train", "reference": "zero3_inference"}
    assert session_run["stages"] == {"policy": 2, "reference": 3}
    assert session_run["finite"]
    assert session_run["loss_after"] < session_run["loss_before"]  # the step moved the policy
    # The partitioned reference holds the same weights the policy started from.
    assert session_run["reference_loss"] == pytest.approx(session_run["loss_before"], abs=1e-4)


@pytest.fixture(scope="module")
def launched(installed) -> dict:
    """The README's launch of the installed command on two processes:
    ``accelerate launch --config_file $(posttrain accelerate-config cpu_2proc) $(which posttrain) dpo``."""
    posttrain = installed["venv"] / "bin" / "posttrain"
    config = _run([posttrain, "accelerate-config", "cpu_2proc"], cwd=installed["cwd"], env=installed["env"]).strip()
    out = installed["cwd"] / "dpo-run"
    env = {**installed["env"], "POSTTRAIN_CACHE": str(cache.cache_dir()),
           "TORCH_EXTENSIONS_DIR": str(cache.torch_extensions_dir())}
    _run([installed["python"], "-m", "accelerate.commands.launch", "--config_file", config, posttrain, "dpo",
          "--output_dir", out, "--max_steps", "1", "--synthetic_train_size", "64", "--eval_strategy", "no",
          "--logging_steps", "1", "--disable_tqdm", "true"],
         cwd=installed["cwd"], env=env, timeout=600)
    return {"config": Path(config), "out": out}


def test_installed_command_on_two_processes_and_its_model_at_the_top(installed, launched):
    from transformers import AutoModelForCausalLM

    assert launched["config"].is_relative_to(installed["site"])
    out = launched["out"]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["epoch"] == pytest.approx(16 * 2 / 64)  # 16 pairs a step on each of 2 ranks
    AutoModelForCausalLM.from_pretrained(out)  # TRL's layout: the output dir is the trained model
    assert json.loads((out / "posttrain_config.json").read_text())["max_steps"] == 1
    assert f'pipeline("text-generation", model="{out}"' in (out / "README.md").read_text()


def test_nothing_written_into_site_packages(installed, session_run):
    package = installed["site"] / "posttrain"
    assert not list(installed["site"].glob(".cache")) and not list(package.rglob(".cache"))
    written = {p.name for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    shipped = {Path(n).name for n in zipfile.ZipFile(installed["wheel"]).namelist() if n.startswith("posttrain/")}
    assert written <= shipped
