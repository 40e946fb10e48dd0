"""TRL 1.16's own example scripts, copied from the installed trl with posttrain's classes imported in place
of TRL's (the one change a user makes), run to the end on the tiny default and a local dataset folder;
their losses equal those of the same script on TRL's classes where TRL's numbers are the reference."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import launch_env

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


def launch(script: Path, *args: str, nproc: int = 1) -> list[str]:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    return [*launch, str(script), *map(str, args)]


def finished(cmd: list[str], proc: subprocess.CompletedProcess) -> str:
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def run(script: Path, *args: str, nproc: int = 1, timeout: int = 600) -> str:
    cmd = launch(script, *args, nproc=nproc)
    return finished(cmd, subprocess.run(cmd, cwd=script.parent, env=launch_env(), capture_output=True, text=True,
                                        timeout=timeout))


def run_side_by_side(name: str, folder: Path, args: tuple, ours: Path, theirs: Path) -> str:
    """The script on posttrain's classes and on TRL's (``--use_cpu``: TRL refuses bf16 on a CPU otherwise), one
    process each, at the same time (two cores); posttrain's output."""
    procs = []
    for mine, out, extra in ((True, ours, ()), (False, theirs, ("--use_cpu", "true"))):
        cmd = [sys.executable, str(trl_script(name, folder, ours=mine)), *map(str, args), "--output_dir", str(out),
               *extra]
        procs.append((cmd, subprocess.Popen(cmd, cwd=folder, env=launch_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    outputs = []
    for cmd, proc in procs:
        output = proc.communicate(timeout=600)[0]
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}")
        outputs.append(output)
    return outputs[0]


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
    return write_split(tmp_path_factory.mktemp("text"), [{"text": t} for t in lines[:14]],
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

    # 14 rows in batches of 8: each epoch ends on a short step of 6 rows, which TRL trains (no row dropped).
    args = ("--model_name_or_path", tiny.model_path(), "--dataset_name", tiny_text, "--num_train_epochs", "2",
            "--learning_rate", "1e-3", "--gradient_checkpointing", "false", "--save_steps", "4", *COMMON,
            "--per_device_train_batch_size", "8")
    ours, theirs = tmp_path / "ours", tmp_path / "trl"
    out = run_side_by_side("sft", tmp_path, args, ours, theirs)
    assert "Training completed" in out
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ours).num_parameters() > 0
    assert len(posttrain_losses(ours)) == 4
    assert posttrain_losses(ours) == pytest.approx(trl_losses(theirs), abs=1e-5)
    assert posttrain_losses(ours, "epoch") == pytest.approx(trl_losses(theirs, "epoch"), abs=1e-9)


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.demo import synthetic

    return write_split(tmp_path_factory.mktemp("pairs"), synthetic.preference_pairs(14, seed=0),
                       synthetic.preference_pairs(8, seed=1))


# 14 pairs in batches of 4, 3 micro-batches a step, 2 epochs: each epoch is a step of 3 micro-batches (the last
# of 2 pairs) and a step of 1, which TRL averages over the micro-batches it has; epoch 2 in TRL's second order.
PAIR_ARGS = ("--num_train_epochs", "2", "--gradient_accumulation_steps", "3", "--learning_rate", "1e-3",
             "--gradient_checkpointing", "false", "--save_steps", "4", "--max_length", "64", *COMMON)


@pytest.mark.parametrize("name", ["dpo", "reward"])
def test_trl_preference_scripts_run_on_posttrain_with_trl_losses(tmp_path: Path, tiny_pairs: Path, name: str) -> None:
    """TRL's dpo.py and reward.py on posttrain, one process, the tiny SFT policy (reward.py loads it, as TRL's,
    with a new one-logit score head) on a local folder of preference pairs: the saved model loads and the
    losses equal those of the same script on TRL's classes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from posttrain.demo import tiny

    args = ("--model_name_or_path", tiny.sft_model_path(), "--dataset_name", tiny_pairs, *PAIR_ARGS)
    ours, theirs = tmp_path / "ours", tmp_path / "trl"
    out = run_side_by_side(name, tmp_path, args, ours, theirs)
    assert "Training completed" in out
    if name == "dpo":
        assert AutoModelForCausalLM.from_pretrained(ours).num_parameters() > 0
    else:
        assert AutoModelForSequenceClassification.from_pretrained(ours).config.num_labels == 1
    assert len(posttrain_losses(ours)) == 4
    assert posttrain_losses(ours) == pytest.approx(trl_losses(theirs), abs=1e-5)
    assert posttrain_losses(ours, "epoch") == pytest.approx(trl_losses(theirs, "epoch"), abs=1e-9)


@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.demo import synthetic

    return write_split(tmp_path_factory.mktemp("prompts"), [{"prompt": p} for p in synthetic.prompts(16, seed=0)],
                       [{"prompt": p} for p in synthetic.prompts(4, seed=1)])


# grpo.py runs under accelerate launch on two processes, with evaluation (test_trl_scripts_on_two_processes).
ONLINE = [("rloo", ("--use_peft", "--lora_r", "4", "--lora_alpha", "8"))]


@pytest.fixture(scope="module")
def one_process_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_prompts: Path):
    """The selected tests' one-process runs of TRL's scripts on posttrain (distillation.py, rloo.py), started two
    at a time: one thread each (launch_env), so two keep CI's two cores busy. Script name -> (command, output
    dir, future of the finished process)."""
    from posttrain.demo import tiny

    selected = {item.originalname for item in request.session.items
                if getattr(item, "module", None) is request.module}
    jobs: dict[str, tuple[list[str], Path]] = {}
    if "test_trl_distillation_script_runs_on_posttrain" in selected:
        tmp = tmp_path_factory.mktemp("distillation")
        prompts = [{"prompt": " ".join(line.split()[:2])} for line in tiny.corpus()]
        data = write_split(tmp / "prompts", prompts[:16], prompts[-4:])
        out = tmp / "ours"
        jobs["distillation"] = launch(
            trl_script("distillation", tmp, ours=True), "--model_name_or_path", tiny.model_path(),
            "--teacher_model_name_or_path", tiny.model_path(seed=1), "--dataset_name", data, "--max_steps", "2",
            "--max_completion_length", "8", "--save_steps", "2", "--output_dir", out, *COMMON), out
    if "test_trl_online_scripts_run_on_posttrain" in selected:
        for name, extra in ONLINE:
            tmp = tmp_path_factory.mktemp(name)
            out = tmp / "ours"
            jobs[name] = launch(
                trl_script(name, tmp, ours=True), "--model_name_or_path", tiny.sft_model_path(), "--dataset_name",
                tiny_prompts, "--reward_funcs", "posttrain.demo.synthetic.sentiment_reward", "--num_generations",
                "4", "--max_completion_length", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--output_dir",
                out, *COMMON, *extra), out
    with ThreadPoolExecutor(2) as pool:
        # Each script's own folder as its working directory, as run() does.
        futures = {name: pool.submit(subprocess.run, cmd, cwd=Path(cmd[1]).parent, env=launch_env(),
                                     capture_output=True, text=True, timeout=600)
                   for name, (cmd, _) in jobs.items()}
        yield {name: (cmd, out, futures[name]) for name, (cmd, out) in jobs.items()}


def one_process_run(runs: dict, name: str) -> tuple[str, Path]:
    """``name``'s run from ``one_process_runs``: (its output, its output dir); the test fails with the output if
    the run failed."""
    cmd, out, future = runs[name]
    return finished(cmd, future.result()), out


def test_trl_distillation_script_runs_on_posttrain(one_process_runs: dict) -> None:
    """TRL's distillation.py on posttrain, one process: the tiny student learns another tiny model on a local
    folder of prompts, on its own completions (TRL's on-policy distillation), to the end; the saved student loads."""
    from transformers import AutoModelForCausalLM

    log, out = one_process_run(one_process_runs, "distillation")
    assert "Training completed" in log
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    assert len(posttrain_losses(out)) == 2


@pytest.mark.parametrize("name,extra", ONLINE)
def test_trl_online_scripts_run_on_posttrain(one_process_runs: dict, name: str, extra: tuple) -> None:
    """TRL's rloo.py on posttrain, one process, with --use_peft: the tiny SFT policy on a local folder of prompts,
    rewarded by the bundled function named as TRL's script imports one (``module.function``), to the end, every
    step logged with its loss and reward, the adapter saved and loadable. The losses are not compared with TRL's
    script: the two engines sample other completions (tests/test_grpo_parity.py, test_rloo_parity.py and
    test_lora_online.py compare the numbers on the same completions)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny

    log, out = one_process_run(one_process_runs, name)
    assert "Training completed" in log and f"Model saved to {out}" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(-2.0 <= r["reward"] <= 2.0 for r in rows if "loss" in r)  # the bundled reward's range
    assert (out / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path())
    assert PeftModel.from_pretrained(base, out).num_parameters() > 0


def test_trl_scripts_on_two_processes(tmp_path: Path, tiny_text: Path, tiny_prompts: Path) -> None:
    """TRL's sft.py under torchrun with --use_peft and --eval_strategy steps, and TRL's grpo.py under accelerate
    launch with --eval_strategy steps, each on two CPU processes, imports swapped: both run to the end, log
    their losses and evaluations, and save a model that loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny

    sft_out = tmp_path / "sft"
    log = run(trl_script("sft", tmp_path, ours=True), "--model_name_or_path", tiny.model_path(), "--dataset_name",
              tiny_text, "--max_steps", "2", "--use_peft", "--lora_r", "4", "--eval_strategy", "steps",
              "--eval_steps", "1", "--output_dir", sft_out, *COMMON, nproc=2)
    assert "Training completed" in log
    rows = [json.loads(line) for line in (sft_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "eval/loss" in r] == [1, 2]
    assert PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny.model_path()), sft_out)

    grpo_out = tmp_path / "grpo"
    config = Path(__file__).resolve().parent.parent / "configs" / "accelerate" / "cpu_2proc.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           str(trl_script("grpo", tmp_path, ours=True)), "--model_name_or_path", str(tiny.sft_model_path()),
           "--dataset_name", str(tiny_prompts), "--reward_funcs", "posttrain.demo.synthetic.sentiment_reward",
           "--num_generations", "4", "--max_completion_length", "8", "--max_steps", "2", "--output_dir",
           str(grpo_out), *map(str, COMMON), "--eval_strategy", "steps", "--eval_steps", "2",
           "--per_device_eval_batch_size", "4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Training completed" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (grpo_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(-2.0 <= r["reward"] <= 2.0 for r in rows if "loss" in r)  # the bundled reward's range
    assert [r["step"] for r in rows if "eval/reward" in r] == [2]  # TRL's eval rewards on the test split
    assert AutoModelForCausalLM.from_pretrained(grpo_out).num_parameters() > 0


def test_trl_kto_script_runs_on_posttrain_with_trl_losses(tmp_path: Path) -> None:
    """TRL's kto.py on posttrain, one process, on a local folder of unpaired feedback (prompt, completion,
    boolean label): the saved model loads and the losses and KL estimates equal those of the script on TRL's
    classes (14 rows in batches of 4, 3 micro-batches a step, 2 epochs: short last batches and steps)."""
    from transformers import AutoModelForCausalLM

    from posttrain.demo import synthetic, tiny
    from posttrain.scripts.kto import unpaired_feedback

    rows = unpaired_feedback(synthetic.preference_pairs(7, seed=0), seed=0)
    data = write_split(tmp_path / "feedback", rows, rows[:4])
    args = ("--model_name_or_path", tiny.sft_model_path(), "--dataset_name", data, *PAIR_ARGS)
    ours, theirs = tmp_path / "ours", tmp_path / "trl"
    out = run_side_by_side("kto", tmp_path, args, ours, theirs)
    assert "Training completed" in out
    assert AutoModelForCausalLM.from_pretrained(ours).num_parameters() > 0
    assert len(posttrain_losses(ours)) == 4
    for key in ("loss", "kl", "rewards/chosen"):
        assert posttrain_losses(ours, key) == pytest.approx(trl_losses(theirs, key), abs=1e-5), key
    assert posttrain_losses(ours, "epoch") == pytest.approx(trl_losses(theirs, "epoch"), abs=1e-9)
