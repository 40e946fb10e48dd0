"""The one training loop (posttrain/trainers/loop.py) on a stub trainer: the logging cadence and its
windows, evaluation and checkpoint cadence, resume in one place; and the trainers without an
evaluation refusing eval_strategy by name."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.run import output_dir
from posttrain.run.jsonrows import read_rows
from posttrain.trainers import run_log
from posttrain.trainers.config import LoopConfig
from posttrain.trainers.loop import Trainer


class StubSession:
    """What the loop asks of a Session, on one process: checkpoints write the trainer state only."""

    is_main_process, num_processes, process_index, device = True, 1, 0, torch.device("cpu")

    def __init__(self) -> None:
        self.accelerator = SimpleNamespace(wait_for_everyone=lambda: None, trackers=[], is_local_main_process=True)
        self.loaded: list[Path] = []

    def wait_for_everyone(self) -> None:
        pass

    def unwrap(self, role):
        return torch.nn.Linear(1, 1)  # no config: nothing for the resume checks or the card to read

    def save_pretrained(self, role, path, tokenizer=None):
        Path(path).mkdir(parents=True, exist_ok=True)

    def save_state(self, directory, extra=None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "trainer_state.json").write_text(json.dumps(extra))

    def load_state(self, directory):
        self.loaded.append(Path(directory))
        return json.loads((Path(directory) / "trainer_state.json").read_text())


class Counting(Trainer):
    """Step n uses loss n and learning rate 1/n; evaluation reports the step it ran at."""

    name = "stub"
    evaluates = True

    def __init__(self, cfg: LoopConfig, total: int) -> None:
        self.cfg, self.total_steps, self.session = cfg, total, StubSession()
        self.steps_run: list[int] = []
        self.restored = None

    def training_step(self, step):
        self.steps_run.append(step)
        return {"loss": float(step), "learning_rate": 1.0 / step}

    def has_eval_data(self):
        return True

    def evaluate(self):
        return {"eval/loss": float(self.step)}

    def checkpoint_state(self):
        return {"seen": self.step * 10}

    def restore(self, state, checkpoint):
        self.restored = (state["seen"], checkpoint.name)


@pytest.fixture(autouse=True)
def no_model_card(monkeypatch):
    monkeypatch.setattr(run_log, "write_model_card", lambda *a, **k: None)


def test_logging_windows_evaluation_and_checkpoints(tmp_path):
    cfg = LoopConfig(output_dir=str(tmp_path), logging_steps=2, eval_strategy="steps", eval_steps=2, save_steps=2,
                      disable_tqdm=True)
    trainer = Counting(cfg, 5)
    out = trainer.train()
    history = trainer.state.log_history
    assert out.global_step == 5 and out.training_loss == 3.0  # TrainOutput: the mean of every step's loss
    train = [h for h in history if "loss" in h]
    # Each row averages its window's losses and keeps the latest learning rate; the last step logs too.
    assert [(h["step"], h["loss"], h["learning_rate"]) for h in train] == [(2, 1.5, 0.5), (4, 3.5, 0.25), (5, 5.0, 0.2)]
    assert [(h["step"], h["eval/loss"]) for h in history if "eval/loss" in h] == [(2, 2.0), (4, 4.0), (5, 5.0)]
    assert read_rows(tmp_path / "metrics.jsonl") == history
    assert [p.name for p in output_dir.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    state = json.loads((tmp_path / "checkpoint-4" / "state" / "trainer_state.json").read_text())
    assert state == {"step": 4, "total_steps": 5, "seen": 40}


def test_resume_happens_once_in_train_and_continues_the_steps(tmp_path):
    Counting(LoopConfig(output_dir=str(tmp_path), save_steps=2, logging_steps=1, disable_tqdm=True), 3).train()
    (tmp_path / "checkpoint-3").rename(tmp_path / "gone")  # resume from checkpoint-2
    cfg = LoopConfig(output_dir=str(tmp_path), save_steps=2, logging_steps=1, resume_from_checkpoint="latest",
                     disable_tqdm=True)
    output_dir.prepare_output_dir(cfg)
    trainer = Counting(cfg, 4)
    assert trainer.start == 2 and trainer.session.loaded == []  # known before train(), loaded by it
    trainer.train()
    history = trainer.state.log_history
    assert trainer.session.loaded == [tmp_path / "checkpoint-2" / "state"] and trainer.restored == (20, "checkpoint-2")
    assert trainer.steps_run == [3, 4]
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]  # the kept rows of the first run, then the resumed ones


@pytest.mark.parametrize("make", ["ppo", "multi"])  # GRPO and RLOO evaluate (tests/test_grpo_parity.py)
def test_trainers_without_evaluation_refuse_eval_strategy(make):
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.multi import MultiConfig
    from posttrain.trainers.ppo import PPOConfig
    from posttrain.trainers.rloo import RLOOConfig

    config = {"ppo": PPOConfig, "grpo": GRPOConfig, "rloo": RLOOConfig, "multi": MultiConfig}[make]
    kw = {"num_generations": 2, "per_device_train_batch_size": 2} if make in ("grpo", "rloo") else {}
    with pytest.raises(ConfigError, match="does not evaluate .* eval_strategy is 'steps': set --eval_strategy no"):
        config(eval_strategy="steps", **kw)
    config(eval_strategy="no", **kw)  # the default


def test_no_trainer_carries_its_own_loop():
    from posttrain.planner import memory
    from posttrain.trainers.distill import DistillationTrainer
    from posttrain.trainers.dpo import DPOTrainer
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.multi import MultiTrainer
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.rloo import RLOOTrainer

    for cls in (DPOTrainer, PPOTrainer, GRPOTrainer, RLOOTrainer, DistillationTrainer, MultiTrainer):
        assert cls.train is Trainer.train, cls  # PPO's logging_steps is the loop's
        assert cls.save_model is Trainer.save_model or cls is MultiTrainer, cls  # disjoint models: a folder each
    # The planner's workloads are the roles the trainers declare.
    assert memory.WORKLOADS["ppo"] == PPOTrainer.roles and memory.WORKLOADS["rloo"] == GRPOTrainer.roles

