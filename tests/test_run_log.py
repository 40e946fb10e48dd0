"""What a run logs and shows: strict JSON at full precision in metrics.jsonl, the progress bar's
and --disable_tqdm's per-row line, the whole run's history and summary after a resume, and Ctrl-C
on a real run (one line saying how to resume, exit status 130)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from conftest import ROOT

from posttrain.run import modelcard
from posttrain.run.jsonrows import dumps_row, loads_row, read_rows
from posttrain.scripts import grpo as grpo_script
from posttrain.scripts import ppo as ppo_script
from posttrain.trainers.config import LoopConfig
from posttrain.trainers.run_log import RunLog


def strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def stub_session():
    accelerator = SimpleNamespace(wait_for_everyone=lambda: None, trackers=[])
    return SimpleNamespace(is_main_process=True, accelerator=accelerator, wait_for_everyone=lambda: None)


def test_rows_are_strict_json_at_full_precision():
    row = {"step": 3, "learning_rate": 1e-6, "loss": 4e-8, "kl": math.nan, "grad_norm": math.inf,
           "reward": -math.inf, "epoch": 1 / 3}
    line = dumps_row(row)
    parsed = strict(line)
    assert parsed["learning_rate"] == 1e-6 and parsed["loss"] == 4e-8 and parsed["epoch"] == 1 / 3
    assert parsed["kl"] is None and parsed["nonfinite"] == {"kl": "nan", "grad_norm": "inf", "reward": "-inf"}
    back = loads_row(line)
    assert math.isnan(back["kl"]) and back["grad_norm"] == math.inf and back["reward"] == -math.inf
    assert {k: v for k, v in back.items() if k != "kl"} == {k: v for k, v in row.items() if k != "kl"}
    assert loads_row('{"step": 1, "loss": NaN}')["step"] == 1  # an older posttrain's file still reads


def log_rows(tmp_path, rows, start=0, **cfg):
    log = RunLog(stub_session(), LoopConfig(output_dir=str(tmp_path), **cfg), 10, "grpo", start=start,
                 shown=("reward", "kl", "loss"))
    for step, row in rows:
        log.log(step, row)
    return log


def test_metrics_file_parses_strictly_and_the_card_reads_it(tmp_path):
    rows = [(1, {"loss": 4e-8, "reward": 0.5, "learning_rate": 1e-6}),
            (2, {"loss": math.nan, "reward": 0.75, "learning_rate": 1e-6}),
            (3, {"loss": math.inf, "reward": math.nan, "learning_rate": 5e-7})]
    log = log_rows(tmp_path, rows)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [strict(line) for line in lines]
    assert [p["learning_rate"] for p in parsed] == [1e-6, 1e-6, 5e-7]  # not rounded to 7 decimals
    assert parsed[0]["loss"] == 4e-8
    assert parsed[2]["nonfinite"] == {"loss": "inf", "reward": "nan"}
    assert log.history[0] == {"step": 1, **rows[0][1]}
    # The card's final metrics are the last finite values; the curves read the file back.
    assert modelcard.final_metrics(modelcard.read_metrics(tmp_path / "metrics.jsonl")) == {
        "loss": (4e-8, 1), "reward": (0.75, 2), "learning_rate": (5e-7, 3)}
    config = strict((tmp_path / "posttrain_config.json").read_text())
    assert config["learning_rate"] == 5e-5


def test_progress_bar_shows_the_reward_and_disable_tqdm_prints_a_line(tmp_path, capsys):
    log = log_rows(tmp_path / "bar", [(1, {"loss": 0.001, "reward": 0.25, "kl": 0.0123})])
    assert log.postfix == {"reward": "0.25", "kl": "0.0123", "loss": "0.001"}
    log.log(2, {"eval/rewards/accuracies": 0.5}, advance=False)  # an eval row keeps the train values shown
    assert log.postfix["reward"] == "0.25"
    assert capsys.readouterr().out == ""
    log_rows(tmp_path / "plain", [(1, {"loss": 0.001, "reward": 0.25, "learning_rate": 1e-6, "epoch": 0.5})],
             disable_tqdm=True)
    assert capsys.readouterr().out == "grpo step 1/10  reward 0.25  loss 0.001  learning_rate 1e-06  epoch 0.5\n"


def test_a_resumed_run_holds_and_summarizes_the_whole_run(tmp_path):
    first = [(s, {"reward": float(s), "objective/scores": float(s), "time/generate": 1.0, "loss": math.nan})
             for s in range(1, 11)]
    log_rows(tmp_path, first)
    # Resumed from checkpoint-6: rows 7-10 of the dead run are dropped, 1-6 kept in history.
    log = log_rows(tmp_path, [(s, {"reward": 10.0 * s, "objective/scores": 10.0 * s, "time/generate": 2.0})
                              for s in range(7, 11)], start=6)
    assert [h["step"] for h in log.history] == list(range(1, 11))
    assert math.isnan(log.history[0]["loss"])
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == list(range(1, 11))
    cfg = SimpleNamespace(mix="zero2-zero3", output_dir=str(tmp_path), resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    summary = grpo_script.summarize(log.history, cfg, seconds=3.0)
    assert summary["steps"] == 10 and summary["reward_first_tenth"] == 1.0 and summary["reward_last_tenth"] == 100.0
    assert summary["seconds_per_phase"] == {"time/generate": 6 * 1.0 + 4 * 2.0}  # phases no step ran left out
    assert ppo_script.summarize(log.history, cfg)["score_first_tenth"] == 1.0


def test_the_interrupt_line_names_the_checkpoint(tmp_path):
    log = log_rows(tmp_path, [(1, {"loss": 1.0}), (2, {"loss": 0.5})], save_steps=2)
    assert log.interrupted() == "interrupted at step 2 of 10; no checkpoint yet"
    (tmp_path / "checkpoint-2" / "state").mkdir(parents=True)
    (tmp_path / "checkpoint-2" / "state" / "trainer_state.json").write_text("{}")
    assert log.interrupted() == ("interrupted at step 2 of 10; resume with --resume_from_checkpoint latest "
                                 "(checkpoint-2)")
    no_saves = log_rows(tmp_path / "none", [], save_strategy="no")
    assert no_saves.interrupted().endswith("no checkpoint yet (--save_strategy steps --save_steps N writes them)")
    log.closed = True  # RunLog.close: an interrupt while the model is saved
    assert log.interrupted().startswith("interrupted after grpo's training ended (step 2 of 10); resume with")


def test_sigterm_gives_the_line_once_and_130(tmp_path, capsys):
    from posttrain.run import interrupt

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    saved_hook = sys.unraisablehook
    try:
        interrupt.install()
        log = log_rows(tmp_path, [(1, {"loss": 1.0})])
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
            raise AssertionError("no KeyboardInterrupt")
        except KeyboardInterrupt as err:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's repeat: ignored
            assert interrupt.exit_status(err) == 130
        # After the signal any failure is it (a collective whose peer left), reported once.
        assert interrupt.exit_status(ValueError("a collective's peer left")) == 130
        interrupt.install()
        assert interrupt.exit_status(ValueError("a real error")) is None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        sys.unraisablehook = saved_hook
        interrupt.track(None)
    err = capsys.readouterr().err
    assert err.count("[posttrain] stopped by SIGTERM at step 1 of 10; no checkpoint yet") == 1
    assert log.done == 1


HALF_BUILT_BAR = """
import os, signal, sys, time
from posttrain.scripts.args import run_script

class Bar:  # tqdm's shape: __del__ reads what __init__ sets last
    def __init__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        self.pos = 0

    def __del__(self):
        abs(self.pos)

class Early:  # collected before any signal: its error is still printed
    def __del__(self):
        raise RuntimeError("a destructor error before the interrupt")

def main(argv):
    import atexit
    atexit.register(lambda: 1 / 0)  # not a destructor: still printed after the interrupt
    Early()
    Bar()

sys.exit(run_script(main, []))
"""


def test_ctrl_c_inside_an_objects_init_prints_no_destructor_traceback():
    proc = subprocess.run([sys.executable, "-c", HALF_BUILT_BAR], cwd=ROOT, env=launch_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    before, after = proc.stderr.split("[posttrain] interrupted before training started")
    assert "a destructor error before the interrupt" in before
    assert "pos" not in after and "ZeroDivisionError" in after and after.count("Traceback") == 1, proc.stderr


# -- Ctrl-C on real runs ----------------------------------------------------------------------------
DPO_ARGS = ["--max_steps", "400", "--synthetic_train_size", "64", "--synthetic_eval_size", "16", "--eval_strategy",
            "no", "--logging_steps", "1", "--save_steps", "2", "--disable_tqdm", "true"]


def interrupt_after_a_checkpoint(cmd, out, env):
    """Start ``cmd`` in its own process group, send that group SIGINT (what a terminal's Ctrl-C
    does) once a checkpoint exists, and return (exit status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def launch_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def test_ctrl_c_one_process(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "dpo.py"), "--output_dir", str(out), *DPO_ARGS]
    status, stdout, stderr = interrupt_after_a_checkpoint(cmd, out, launch_env())
    assert status == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1, stderr[-3000:]
    step = int(lines[0].split("interrupted at step ")[1].split(" ")[0])
    latest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    assert lines[0] == (f"[posttrain] interrupted at step {step} of 400; resume with --resume_from_checkpoint "
                        f"latest (checkpoint-{latest})")
    assert step >= latest >= 2 and [r["step"] for r in read_rows(out / "metrics.jsonl")][-1] == step


def test_ctrl_c_under_torchrun(tmp_path):
    """Two ranks, each given the terminal's SIGINT and then torchrun's: one line from rank 0 and no
    worker traceback; torchrun's own SignalException traceback is the launcher's."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "dpo.py"), "--output_dir", str(out), *DPO_ARGS]
    status, stdout, stderr = interrupt_after_a_checkpoint(cmd, out, launch_env())
    assert status != 0
    assert len([line for line in stderr.splitlines() if "interrupted at step" in line]) == 1, stderr[-3000:]
    assert "resume with --resume_from_checkpoint latest (checkpoint-" in stderr
    assert stderr.count("Traceback") == 1 and "SignalException" in stderr.split("Traceback")[1], stderr[-3000:]
