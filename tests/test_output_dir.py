"""The output dir: held by one run at a time (a lock a second run reports in one sentence, that a
run killed with kill -9 does not leave stuck), checked with no side effect and cleared only when the run
claims it, files posttrain did not write kept, ``~`` expanded; and launching the installed command."""

import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from test_checkpoints import fake_checkpoint, write_rows

from posttrain import cli
from posttrain.errors import ConfigError
from posttrain.placement import launch
from posttrain.run import modelcard
from posttrain.run.output_dir import LOCK_FILE, claim_output_dir, plan_output_dir, prepare_output_dir

HOLD = ("import sys, time\n"
        "from posttrain.run.output_dir import lock_output_dir\n"
        "lock_output_dir(sys.argv[1])\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


@dataclass
class TrainConfig:
    """The fields the output dir reads of a trainer's config (output_dir.OutputDirSettings), without TRL's import."""

    output_dir: str
    overwrite_output_dir: bool = False
    resume_from_checkpoint: str | None = None
    save_total_limit: int | None = None


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def holder(tmp_path):
    """Another run holding tmp_path/run: a process that takes the lock and sleeps."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_second_run_is_refused_and_nothing_is_cleared(holder):
    out, proc = holder
    write_rows(out / "metrics.jsonl", [1, 2])
    fake_checkpoint(out, 2)
    fake_checkpoint(out, 4, complete=False)
    # Refused before anything is cleared, even with overwrite_output_dir and a half-written checkpoint.
    with pytest.raises(ConfigError) as err:
        prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=True))
    message = str(err.value)
    assert message.startswith(f"output_dir {out.resolve()} is in use by another run (pid {proc.pid} on "
                              f"{socket.gethostname()}, since ")
    assert message.endswith("UTC): wait for it to end or stop it, or choose another --output_dir")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "checkpoint-2", "checkpoint-4.tmp", "metrics.jsonl"]


def test_the_installed_command_exits_2_with_one_sentence(holder):
    out, proc = holder
    run = subprocess.run([sys.executable, "-m", "posttrain.cli", "dpo", "--output_dir", str(out),
                          "--overwrite_output_dir", "true", "--synthetic_train_size", "32", "--synthetic_eval_size", "32"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in run.stderr
    assert errors[0].startswith(f"error: output_dir {out.resolve()} is in use by another run (pid {proc.pid} on ")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written or cleared


def test_a_run_killed_with_kill_9_leaves_no_stale_lock(holder):
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert f"pid {proc.pid}" in (out / LOCK_FILE).read_text()  # the file stays; the kernel dropped the lock
    prepare_output_dir(TrainConfig(output_dir=str(out)))
    assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    prepare_output_dir(TrainConfig(output_dir=str(out)))  # the same process again (a second trainer): fine
    # The dir removed and made again while this process still runs: the new one is locked too.
    shutil.rmtree(out)
    prepare_output_dir(TrainConfig(output_dir=str(out)))
    other = subprocess.run([sys.executable, "-c", HOLD, str(out)], env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert other.returncode != 0 and f"in use by another run (pid {os.getpid()} on " in other.stderr


def test_only_rank_0_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    prepare_output_dir(TrainConfig(output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_overwrite_clears_only_after_every_check(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    write_rows(out / "metrics.jsonl", [1, 2])
    fake_checkpoint(out, 2)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError, match="save_total_limit must be >= 1"):
        prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=True, save_total_limit=0))
    with pytest.raises(ConfigError, match="is not a posttrain checkpoint"):
        prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=True,
                                       resume_from_checkpoint=str(tmp_path / "no-such-checkpoint")))
    assert sorted(p.name for p in out.iterdir()) == before  # not even the lock file: refused before the claim


def test_a_saved_model_counts_as_a_run_and_overwrite_keeps_it(tmp_path, capsys):
    """The model at the top of an output dir (TRL's layout) is refused like metrics; overwrite
    leaves it (this run may load it) and clears the rest."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    write_rows(out / "metrics.jsonl", [1])
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, config.json, model.safetensors\)"):
        prepare_output_dir(TrainConfig(output_dir=str(out)))
    prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=True))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "config.json", "model.safetensors"]
    assert "clearing metrics.jsonl in" in capsys.readouterr().err


def test_an_unwritable_output_dir_is_one_sentence(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"output_dir '.*/file/run' cannot be created: .*/file is a file; choose "
                                          r"another --output_dir"):
        prepare_output_dir(TrainConfig(output_dir=str(blocker / "run")))


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_the_check_changes_nothing_and_the_claim_clears(tmp_path, capsys):
    """Load first, delete last: the check before models load touches nothing; the claim at train() clears."""
    out = tmp_path / "run"
    out.mkdir()
    write_rows(out / "metrics.jsonl", [1, 2])
    fake_checkpoint(out, 2)
    partial = fake_checkpoint(out, 4, complete=False)
    before = _listing(out)
    cfg = TrainConfig(output_dir=str(out), overwrite_output_dir=True)
    plan = plan_output_dir(cfg)
    assert plan.clear == ("metrics.jsonl", "checkpoint-2") and plan.partial == (partial,)
    assert plan.resume is None and plan.kept == ()
    assert _listing(out) == before and not capsys.readouterr().err  # no lock, no removal, no word yet
    # A setting only a loaded model can check fails here, between the two: the old run is whole.
    claim_output_dir(cfg)
    assert _listing(out) == [LOCK_FILE]
    assert "clearing metrics.jsonl, checkpoint-2 in" in capsys.readouterr().err


def test_an_empty_output_dir_is_refused_and_tilde_is_expanded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError) as err:
        plan_output_dir(TrainConfig(output_dir=""))
    assert str(err.value) == ("output_dir is empty: give the folder for the run with --output_dir (it is created if "
                              "missing)")
    with pytest.raises(ConfigError, match=r"^output_dir '~no-such-user-42/run' starts with ~no-such-user-42, and this "
                                          r"machine has no user 'no-such-user-42': give the folder's full path"):
        plan_output_dir(TrainConfig(output_dir="~no-such-user-42/run"))
    cfg = TrainConfig(output_dir="~/runs/sft")  # as a YAML gives it: no shell expanded it
    claim_output_dir(cfg)
    assert cfg.output_dir == str(tmp_path / "home" / "runs" / "sft")  # what the run writes to and records
    assert (tmp_path / "home" / "runs" / "sft" / LOCK_FILE).is_file() and _listing(tmp_path) == ["home"]
    assert f"output_dir '~/runs/sft' is {tmp_path / 'home' / 'runs' / 'sft'}" in capsys.readouterr().err


def test_a_project_folder_is_refused_and_overwrite_keeps_its_files(tmp_path, monkeypatch, capsys):
    """--output_dir . in a clone: refused; with overwrite_output_dir its README.md, .git and the rest stay."""
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "README.md").write_text("# My project\n")
    (project / "pyproject.toml").write_text("[project]\n")
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError) as err:
        prepare_output_dir(TrainConfig(output_dir="."))
    assert str(err.value) == (
        f"output_dir {project} holds files posttrain did not write (.git, README.md, pyproject.toml): choose a new "
        "or empty --output_dir, or pass --overwrite_output_dir true to write the run beside them (posttrain deletes "
        "and replaces none of them, and writes no model card over a README.md not its own)")
    assert _listing(project) == [".git", "README.md", "pyproject.toml"]
    cfg = TrainConfig(output_dir=".", overwrite_output_dir=True)
    prepare_output_dir(cfg)
    said = capsys.readouterr().err
    assert f"output_dir '.' is {project}" in said
    assert f"keeping .git, README.md, pyproject.toml in {project} (posttrain did not write them)" in said
    assert _listing(project) == sorted([LOCK_FILE, ".git", "README.md", "pyproject.toml"])
    # The model card is not written over the project's README (said once), nor its curves.
    assert modelcard.write_model_card(".", cfg, "sft") is None
    assert modelcard.write_model_card(".", cfg, "sft") is None
    assert (project / "README.md").read_text() == "# My project\n"
    said = capsys.readouterr().err
    assert said.count("README.md is not posttrain's model card: it is kept as it is") == 1
    assert not (project / modelcard.CURVES_FILE).exists()


def test_posttrain_card_is_its_own_and_replaced(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(output_dir=str(out))
    card = modelcard.write_model_card(out, cfg, "sft")
    assert modelcard.is_posttrain_card(card)
    assert modelcard.write_model_card(out, cfg, "dpo") == card and "DPO" in card.read_text()  # replaced: it is ours
    plan = plan_output_dir(TrainConfig(output_dir=str(out)))
    assert plan.kept == ()  # a run dir with its card is posttrain's own
    card.write_text("---\ntags: [trl]\n---\n# TRL's card\n")
    assert not modelcard.is_posttrain_card(card)


def test_files_the_run_would_replace_in_a_folder_that_is_no_run_are_refused(tmp_path):
    """A config.json (or metrics.jsonl) with no run of posttrain's beside it is someone else's: even
    overwrite_output_dir does not replace it; beside weights or posttrain's settings it is a run's."""
    out = tmp_path / "app"
    out.mkdir()
    (out / "config.json").write_text('{"port": 8080}')
    write_rows(out / "metrics.jsonl", [1])
    for overwrite in (False, True):
        with pytest.raises(ConfigError) as err:
            prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=overwrite))
        assert str(err.value) == (f"output_dir {out} holds config.json, metrics.jsonl that posttrain did not write "
                                  "(no run of its own is there), and the run would replace them: choose another "
                                  "--output_dir")
    assert _listing(out) == ["config.json", "metrics.jsonl"]
    (out / "posttrain_config.json").write_text("{}")  # a run of posttrain's after all: overwrite clears its metrics
    prepare_output_dir(TrainConfig(output_dir=str(out), overwrite_output_dir=True))
    assert _listing(out) == [LOCK_FILE, "config.json", "posttrain_config.json"]


# -- launching: accelerate's plain launcher starts one process ----------------------------------
SIMPLE_LAUNCHER = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29500"}


def test_check_launch_refuses_one_process_where_several_were_asked():
    with pytest.raises(ConfigError) as err:
        launch.check_launch(SIMPLE_LAUNCHER, ["/venv/bin/posttrain", "grpo", "--max_steps", "2"])
    assert str(err.value) == (
        "accelerate launch started 1 process where several were asked (with no accelerate config, --use_deepspeed "
        "or several GPUs it starts only one): launch with `accelerate launch --config_file $(posttrain "
        "accelerate-config cpu_2proc) --num_processes N $(which posttrain) grpo` or `torchrun --nproc_per_node N "
        "$(which posttrain) grpo` (for one process, leave MASTER_ADDR unset)")
    with pytest.raises(ConfigError, match=r"N examples/dpo.py` or `torchrun --nproc_per_node N examples/dpo.py` \("):
        launch.check_launch(SIMPLE_LAUNCHER, ["examples/dpo.py"])
    # A real multi-process launch sets WORLD_SIZE; one process asked for sets no MASTER_ADDR; no accelerate, no check.
    launch.check_launch({**SIMPLE_LAUNCHER, "WORLD_SIZE": "2"}, ["posttrain", "grpo"])
    launch.check_launch({"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_USE_CPU": "False"}, ["posttrain", "grpo"])
    launch.check_launch({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, ["posttrain", "grpo"])


def test_plain_accelerate_launch_of_two_processes_is_refused(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "posttrain.cli", "dpo",
           "--output_dir", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "error: accelerate launch started 1 process where several were asked" in run.stderr
    assert not out.exists()


def test_accelerate_config_command(capsys):
    assert cli.main(["accelerate-config", "cpu_2proc"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == ROOT / "posttrain" / "presets" / "accelerate" / "cpu_2proc.yaml"
    config = yaml.safe_load(path.read_text())
    # DeepSpeed's launcher (torchrun underneath) and no DeepSpeed keys that would override the roles' plugins.
    assert (config["distributed_type"], config["deepspeed_config"], config["num_processes"]) == ("DEEPSPEED", {}, 2)
    assert (ROOT / "configs" / "accelerate" / "cpu_2proc.yaml").resolve() == path  # the clone's path is the same file
    assert cli.main(["accelerate-config"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["cpu_2proc", "multi_gpu", "multi_node"]
    assert cli.main(["accelerate-config", "cpu"]) == 2
    assert "no accelerate config named 'cpu': choose one of cpu_2proc, multi_gpu, multi_node" in capsys.readouterr().err

