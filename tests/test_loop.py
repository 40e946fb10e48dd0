"""The one training loop (posttrain/trainers/loop.py) on a stub trainer: the logging cadence and its
windows, evaluation and checkpoint cadence, resume in one place; and the trainers without an
evaluation refusing eval_strategy by name."""

import json
import os
import signal
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



class Preempted(Counting):
    """Counting, sent SIGTERM during step ``at``; checkpoints only on the steps ``can`` allows."""

    def __init__(self, cfg: LoopConfig, total: int, at: int | None, can=lambda step: True) -> None:
        super().__init__(cfg, total)
        self.at, self.can, self.handlers = at, can, []

    def training_step(self, step):
        self.handlers.append(signal.getsignal(signal.SIGTERM))
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(step)

    def can_checkpoint(self, step):
        return self.can(step)


@pytest.fixture
def interrupt_state(monkeypatch):
    from posttrain.run import interrupt

    monkeypatch.setattr(interrupt, "_state", dict(interrupt._state))
    return interrupt


@pytest.mark.parametrize("can, saved", [(lambda step: True, 3), (lambda step: step % 2 == 0, 4)])
def test_jit_checkpoint_saves_where_sigterm_came_and_resumes_from_it(tmp_path, capsys, interrupt_state, can, saved):
    """enable_jit_checkpoint (transformers' field, TRL's configs have it): a SIGTERM during step 3 gives a checkpoint
    where the first step that can take one ends (GRPO: where a generation batch ends), then the run stops as an
    interrupted one, its line naming that checkpoint; a resume continues from it. The handler is the loop's only
    while it trains."""
    before = signal.getsignal(signal.SIGTERM)
    cfg = LoopConfig(output_dir=str(tmp_path), logging_steps=1, disable_tqdm=True, enable_jit_checkpoint=True)
    trainer = Preempted(cfg, 10, at=3, can=can)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) is before and trainer.handlers[0] is not before
    assert trainer.steps_run == list(range(1, saved + 1))
    assert [p.name for p in output_dir.checkpoints(tmp_path)] == [f"checkpoint-{saved}"]
    assert interrupt_state.exit_status(KeyboardInterrupt()) == interrupt_state.EXIT_STATUS
    assert (f"[posttrain] stopped by SIGTERM at step {saved} of 10; resume with --resume_from_checkpoint latest "
            f"(checkpoint-{saved})") in capsys.readouterr().err
    resumed = LoopConfig(output_dir=str(tmp_path), logging_steps=1, disable_tqdm=True, enable_jit_checkpoint=True,
                         resume_from_checkpoint="latest")
    again = Preempted(resumed, 10, at=None)
    again.train()
    assert again.steps_run == list(range(saved + 1, 11)) and again.restored == (saved * 10, f"checkpoint-{saved}")
    assert [h["step"] for h in again.state.log_history if "loss" in h] == list(range(1, 11))


def test_without_jit_checkpoint_the_loop_leaves_sigterm_alone(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    trainer = Preempted(LoopConfig(output_dir=str(tmp_path), disable_tqdm=True), 2, at=None)
    trainer.train()
    assert trainer.handlers == [before, before]


def test_jit_checkpoint_is_refused_with_streaming():
    from posttrain.trainers.grpo import GRPOConfig

    with pytest.raises(ConfigError, match="async_generation needs enable_jit_checkpoint false"):
        GRPOConfig(async_generation=True, enable_jit_checkpoint=True, num_generations=2,
                   per_device_train_batch_size=2)


def test_save_only_model_checkpoints_hold_no_state_and_are_not_resumed(tmp_path, interrupt_state):
    """save_only_model (transformers' field): checkpoints hold the models and the step, not the engines'
    optimizer and RNG state, so a resume from one is refused in one sentence before anything loads, naming a
    whole checkpoint when there is one (a just-in-time checkpoint is always whole: it exists to resume). The
    trainers run this check when they build their Session, before any model loads."""
    cfg = LoopConfig(output_dir=str(tmp_path), save_steps=2, logging_steps=1, disable_tqdm=True, save_only_model=True,
                     enable_jit_checkpoint=True)
    trainer = Preempted(cfg, 10, at=5)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [p.name for p in output_dir.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    assert [output_dir.is_model_only(tmp_path / f"checkpoint-{n}") for n in (2, 4, 5)] == [True, True, False]
    assert sorted(p.name for p in (tmp_path / "checkpoint-4" / "state").iterdir()) == ["saved_by.json",
                                                                                       "trainer_state.json"]
    assert trainer.session.loaded == []
    resumed = dict(output_dir=str(tmp_path), save_steps=2, disable_tqdm=True, save_only_model=True)
    with pytest.raises(ConfigError, match="checkpoint-4 was saved with save_only_model, so it holds no optimizer, "
                                          "schedule or RNG state to resume: resume from .*checkpoint-5, the newest "
                                          "checkpoint with it, or start a new run from its model"):
        output_dir.plan_output_dir(LoopConfig(resume_from_checkpoint=str(tmp_path / "checkpoint-4"), **resumed))
    again = Preempted(LoopConfig(resume_from_checkpoint="latest", **resumed), 10, at=None)
    again.train()  # latest: checkpoint-5, whole
    assert again.steps_run == list(range(6, 11))
    (tmp_path / "checkpoint-5").rename(tmp_path / "gone")
    (tmp_path / "checkpoint-10").rename(tmp_path / "gone10")
    with pytest.raises(ConfigError, match="checkpoint-8 was saved with save_only_model.*: start a new run"):
        output_dir.plan_output_dir(LoopConfig(resume_from_checkpoint="latest", **resumed))


def test_eval_on_start_and_torch_empty_cache_steps(tmp_path, monkeypatch):
    """eval_on_start: an evaluation logged at the run's first step, before training; torch_empty_cache_steps N:
    accelerate's clear_device_cache before the steps transformers' Trainer clears in (global step 0, N, 2N...)."""
    from posttrain.trainers import loop

    cleared = []
    monkeypatch.setattr(loop, "clear_device_cache", lambda: cleared.append(True))
    cfg = LoopConfig(output_dir=str(tmp_path), logging_steps=1, disable_tqdm=True, eval_on_start=True,
                     torch_empty_cache_steps=2, save_strategy="no")
    trainer = Counting(cfg, 5)
    trainer.train()
    assert trainer.state.log_history[0] == {"step": 0, "eval/loss": 0.0}
    assert len(cleared) == 3
    with pytest.raises(ConfigError, match="torch_empty_cache_steps must be a whole number >= 1 or unset, got 0"):
        LoopConfig(output_dir=str(tmp_path), torch_empty_cache_steps=0)


@pytest.mark.parametrize("field", [{"eval_strategy": "steps"}, {"eval_on_start": True}])
def test_evaluation_without_an_eval_dataset_is_refused_before_loading(tmp_path, field):
    """transformers' Trainer (and so TRL's) refuses eval_strategy other than no, or eval_on_start, without an
    eval_dataset; posttrain says so before any model loads."""
    from posttrain import SFTConfig, SFTTrainer

    cfg = SFTConfig(output_dir=str(tmp_path), **field)
    with pytest.raises(ConfigError, match="but no eval_dataset was given: pass eval_dataset=, or set --eval_strategy"):
        SFTTrainer("no/such-model", args=cfg, train_dataset=[{"text": "a b"}])
    with pytest.raises(ConfigError, match="PPO does not evaluate .* eval_on_start is set: drop --eval_on_start"):
        from posttrain.trainers.ppo import PPOConfig

        PPOConfig(output_dir=str(tmp_path), eval_on_start=True)


def test_save_strategy_epoch_saves_where_each_epoch_ends(tmp_path):
    """save_strategy epoch (transformers' value, TRL recipes' habit): a checkpoint after each epoch's optimizer
    steps, TRL's count of them (7 rows in steps of 2 rows: 4 steps an epoch, the last one short), where
    eval_strategy epoch evaluates too; refused, by name, by the trainers that step over whole global batches."""
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.demo import tiny
    from posttrain.trainers.ppo import PPOConfig

    cfg = SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, num_train_epochs=2,
                    save_strategy="epoch", eval_strategy="epoch", logging_steps=1, disable_tqdm=True, report_to=[],
                    max_length=32, gradient_checkpointing=False)
    rows = [{"text": t} for t in tiny.corpus()[:7]]
    trainer = SFTTrainer(str(tiny.model_path()), args=cfg, train_dataset=rows, eval_dataset=rows[:2])
    trainer.train()
    assert [p.name for p in output_dir.checkpoints(tmp_path / "sft")] == ["checkpoint-4", "checkpoint-8"]
    assert [r["step"] for r in trainer.state.log_history if "eval/loss" in r] == [4, 8]  # eval_strategy epoch alike
    with pytest.raises(ConfigError, match="PPO steps over whole global batches, not epochs, but save_strategy is "
                                          "'epoch': set --save_strategy steps with --save_steps N"):
        PPOConfig(output_dir=str(tmp_path / "ppo"), save_strategy="epoch")


def test_grpo_save_strategy_epoch_must_end_on_a_generation_batch(tmp_path):
    from posttrain.demo import synthetic, tiny
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                     steps_per_generation=2, save_strategy="epoch", max_completion_length=4)
    with pytest.raises(ConfigError, match="an epoch's 3 steps \\(save_strategy epoch\\) must end on a generation "
                                          "boundary.*with --save_strategy steps"):
        GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=[synthetic.sentiment_reward], args=cfg,
                    train_dataset=bundled_prompts(3))


def test_data_seed_orders_the_rows_as_transformers_sampler(tmp_path):
    """data_seed: the row trainers' order is the one transformers' sampler draws with it (tests/test_trl_order.py
    holds that order against a real Trainer with data_seed); GRPO's prompts keep seed, as TRL's RepeatSampler."""
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.demo import tiny

    rows = [{"text": t} for t in tiny.corpus()[:6]]
    for data_seed, want in ((5, 5), (None, 42)):
        cfg = SFTConfig(output_dir=str(tmp_path / str(data_seed)), seed=42, data_seed=data_seed, max_steps=1,
                        report_to=[], disable_tqdm=True)
        assert SFTTrainer(str(tiny.model_path()), args=cfg, train_dataset=rows).loader.seed == want


@pytest.mark.parametrize("env, each_node, level", [({"RANK": "0", "LOCAL_RANK": "0"}, True, "info"),
                                                   ({"RANK": "3", "LOCAL_RANK": "1"}, True, "error"),
                                                   ({"RANK": "2", "LOCAL_RANK": "0"}, True, "info"),
                                                   ({"RANK": "2", "LOCAL_RANK": "0"}, False, "error")])
def test_log_level_replica_and_log_on_each_node(monkeypatch, tmp_path, env, each_node, level):
    """transformers' rule: the main process of each node (log_on_each_node, its default) or of the run logs at
    log_level, the others at log_level_replica."""
    from transformers.utils import logging as hf_logging

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = hf_logging.get_verbosity()
    try:
        LoopConfig(output_dir=str(tmp_path), log_level="info", log_level_replica="error", log_on_each_node=each_node)
        assert hf_logging.get_verbosity() == hf_logging.get_log_levels_dict()[level]
    finally:
        hf_logging.set_verbosity(before)


def test_log_completions_table_in_trackers_with_unique_prompts(tmp_path):
    """log_completions: samples.jsonl keeps every logged completion, and each tracker that takes tables
    (accelerate's log_table: W&B, ClearML) gets a "completions" table at the step, as TRL logs one to W&B;
    log_unique_prompts keeps each prompt's first row in the table."""
    from transformers import TrainerCallback

    from posttrain.demo import synthetic, tiny
    from posttrain.run.jsonrows import read_rows
    from posttrain.scripts.data import bundled_prompts
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    class Tables:
        def __init__(self) -> None:
            self.logged = []

        def log_table(self, name, columns=None, data=None, dataframe=None, step=None):
            self.logged.append((name, step, [dict(zip(columns, row)) for row in data]))

    tables = Tables()

    class Attach(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trainer.session.accelerator.trackers.append(tables)  # after init_trackers, as a tracker of report_to

    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=2,
                     max_completion_length=4, logging_steps=1, log_completions=True, log_unique_prompts=True,
                     save_strategy="no", disable_tqdm=True, report_to=[], gradient_checkpointing=False)
    trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=[synthetic.sentiment_reward], args=cfg,
                          train_dataset=bundled_prompts(8), callbacks=[Attach()])
    trainer.train()
    samples = read_rows(tmp_path / "samples.jsonl")
    assert [name for name, _, _ in tables.logged] == ["completions", "completions"]
    for step, (_, at, rows) in enumerate(tables.logged, 1):
        mine = [r for r in samples if r["step"] == step]
        assert at == step and len(mine) == 4 and len({r["prompt"] for r in mine}) == 2
        assert rows == [r for i, r in enumerate(mine) if r["prompt"] not in {m["prompt"] for m in mine[:i]}]
