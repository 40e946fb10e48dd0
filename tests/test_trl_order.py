"""posttrain.data.order against TRL 1.16's own samplers, accelerate's sharding and transformers' Trainer loop.

Ranks are simulated in one process: accelerate's ``prepare_data_loader`` takes num_processes/process_index,
and a real ``Trainer`` is run per rank with that call patched (its model has no gradients: nothing trains)."""

from __future__ import annotations

from types import SimpleNamespace

import accelerate.accelerator as accelerator_module
import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, RandomSampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from trl import GRPOConfig
from trl.trainer.distillation_trainer import DistillationTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer

from posttrain.data.order import TrainLoader, epoch_order, rank_batches, repeat_order, trainer_steps

EPOCHS = 3


class Rows(torch.utils.data.Dataset):
    """Row i is {"idx": i}, so a batch says which rows it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"idx": i}


def shard(loader: DataLoader, world: int, rank: int, data_seed: int | None = None) -> DataLoader:
    """``loader`` as the Trainer's Accelerator prepares it (its dataloader config's defaults) on ``rank``."""
    return prepare_data_loader(loader, num_processes=world, process_index=rank, split_batches=False,
                               even_batches=True, use_seedable_sampler=True, data_seed=data_seed,
                               rng_types=["generator"])


def epochs_of(loader: DataLoader, epochs: int = EPOCHS) -> list[list[list[int]]]:
    """Each epoch's batches of row indices, with ``set_epoch`` as the Trainer's ``_run_epoch`` calls it."""
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out.append([[r["idx"] for r in batch] for batch in loader])
    return out


def ours(loader: TrainLoader, rank: int, epochs: int = EPOCHS) -> list[list[list[int]]]:
    return [[b.rows for b in loader.epoch_batches(e, rank)] for e in range(epochs)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n,batch", [(1, 1), (5, 4), (14, 2), (14, 4), (16, 4), (17, 3), (40, 5)])
def test_trainer_rows_match_accelerate(n: int, batch: int, world: int) -> None:
    seed = 7
    loader = TrainLoader.rows(n, batch, world, seed)
    for rank in range(world):
        dl = DataLoader(Rows(n), batch_size=batch, sampler=RandomSampler(Rows(n)), drop_last=False, collate_fn=list)
        assert ours(loader, rank) == epochs_of(shard(dl, world, rank, data_seed=seed))
        assert len(loader) == len(shard(dl, world, rank, data_seed=seed))
    # Every row once per epoch, counting the rows that are not even_batches' fill; the fill repeats the epoch's start.
    for e in range(EPOCHS):
        per_rank = [loader.epoch_batches(e, r) for r in range(world)]
        fresh = [i for k in range(len(loader)) for r in range(world)
                 for i, f in zip(per_rank[r][k].rows, per_rank[r][k].filled) if not f]
        assert fresh == epoch_order(n, seed, e)
        fill = [i for k in range(len(loader)) for r in range(world)
                for i, f in zip(per_rank[r][k].rows, per_rank[r][k].filled) if f]
        start = epoch_order(n, seed, e)[: world * batch]
        assert fill == [start[j % len(start)] for j in range(len(fill))]
        assert world > 1 or not fill


def grpo_self(n: int, batch: int, world: int, seed: int, num_generations: int, steps_per_generation: int,
              num_iterations: int, shuffle: bool = True) -> SimpleNamespace:
    """What GRPOTrainer/RLOOTrainer's ``_get_train_sampler`` reads, with GRPOConfig's generation_batch_size."""
    args = SimpleNamespace(generation_batch_size=batch * world * steps_per_generation,
                           steps_per_generation=steps_per_generation, seed=seed)
    return SimpleNamespace(train_dataset=Rows(n), num_generations=num_generations, num_iterations=num_iterations,
                           shuffle_dataset=shuffle, args=args)


GRPO_CASES = [  # n, per-device batch, num_generations, steps_per_generation, num_iterations, shuffle
    (10, 2, 2, 1, 1, True),
    (13, 4, 4, 2, 2, True),
    (9, 3, 3, 2, 1, True),
    (7, 2, 2, 3, 1, False),
]


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, RLOOTrainer])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", GRPO_CASES)
def test_repeat_sampler_matches_trl(trainer_class: type, world: int, case: tuple) -> None:
    n, batch, gens, spg, iters, shuffle = case
    seed = 3
    if (batch * world * spg) % gens or n < batch * world * spg // gens:
        pytest.skip("GRPOConfig refuses this generation batch")
    loader = TrainLoader.grpo(n, batch, world, seed, gens, spg, iters, shuffle)
    for rank in range(world):
        sampler = trainer_class._get_train_sampler(grpo_self(n, batch, world, seed, gens, spg, iters, shuffle))
        dl = DataLoader(Rows(n), batch_size=batch * spg, sampler=sampler, drop_last=False, collate_fn=list)
        got = epochs_of(shard(dl, world, rank))
        assert ours(loader, rank) == got
        assert not any(f for e in range(EPOCHS) for b in loader.epoch_batches(e, rank) for f in b.filled)
        # The generation batch of every micro-step: what TRL's _prepare_inputs generates from.
        flat = [b for epoch in got for b in epoch]
        assert [loader.generation_rows(g // loader.repeat_count, rank) for g in range(len(flat))] == flat
    chunk, per_epoch = loader.prompts_per_batch, n // loader.prompts_per_batch
    for e in range(EPOCHS):
        order = repeat_order(n, seed, e, shuffle)
        for c in range(per_epoch):
            assert loader.generation_prompts(e * per_epoch + c) == order[c * chunk : (c + 1) * chunk]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n,batch,ga", [(11, 2, 2), (20, 3, 1), (9, 1, 3)])
def test_distillation_sampler_matches_trl(n: int, batch: int, ga: int, world: int) -> None:
    seed = 11
    if n < batch * world * ga:
        pytest.skip("fewer rows than one generation batch")
    loader = TrainLoader.distillation(n, batch, world, seed, ga)
    for rank in range(world):
        fake = SimpleNamespace(train_dataset=Rows(n), shuffle_dataset=True, accelerator=SimpleNamespace(num_processes=world),
                               args=SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                                                    seed=seed))
        dl = DataLoader(Rows(n), batch_size=batch * ga, sampler=DistillationTrainer._get_train_sampler(fake),
                        drop_last=False, collate_fn=list)
        assert ours(loader, rank) == epochs_of(shard(dl, world, rank))


def test_repeat_order_keeps_drawing() -> None:
    """RepeatSampler's epochs are successive draws of one generator, not reseeded ones (issue 42)."""
    g = torch.Generator().manual_seed(5)
    draws = [torch.randperm(12, generator=g).tolist() for _ in range(4)]
    assert [repeat_order(12, 5, e) for e in (3, 0, 2, 1)] == [draws[3], draws[0], draws[2], draws[1]]
    assert repeat_order(12, 5, 1) != epoch_order(12, 5, 1)
    assert repeat_order(12, 5, 0) == epoch_order(12, 5, 0)


class Recorder(Trainer):
    """A Trainer whose training step only records its micro-batch's rows."""

    def training_step(self, model: torch.nn.Module, inputs: object, num_items_in_batch: object = None) -> torch.Tensor:
        rows = inputs["idx"].tolist() if isinstance(inputs, dict) else [r["idx"] for r in inputs]
        self.seen.append(rows)
        return torch.zeros(())


class GRPORecorder(Recorder):
    """Recorder with GRPOTrainer's training dataloader and sampler."""

    get_train_dataloader = GRPOTrainer.get_train_dataloader
    _get_train_sampler = GRPOTrainer._get_train_sampler


class StepLog(TrainerCallback):
    """Each optimizer step: (global_step, state.epoch, its micro-batches)."""

    def __init__(self, trainer: Recorder) -> None:
        self.trainer, self.steps = trainer, []

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        self.steps.append((state.global_step, state.epoch, list(self.trainer.seen)))
        self.trainer.seen.clear()


def run_trainer(trainer: Recorder, world: int, rank: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Train ``trainer`` as process ``rank`` of ``world``: accelerate shards its loader for that rank."""
    with monkeypatch.context() as m:
        # The Accelerator passes its own (one-process) world: override it.
        m.setattr(accelerator_module, "prepare_data_loader",
                  lambda *a, **k: prepare_data_loader(*a, **{**k, "num_processes": world, "process_index": rank}))
        trainer.seen = []
        log = StepLog(trainer)
        trainer.add_callback(log)
        trainer.train()
    return log.steps


def expected(loader: TrainLoader, rank: int, ga: int, epochs: float, max_steps: int, start: int = 0) -> list[tuple]:
    schedule = loader.schedule(ga, epochs, max_steps)
    return [(s.step, s.epoch, [b.rows for b in s.batches]) for s in loader.steps(schedule, rank, start)]


ROWS_RUNS = [  # n, per-device batch, world, gradient_accumulation_steps, num_train_epochs, max_steps, data_seed
    (14, 8, 1, 1, 3, -1, None),  # issue 42: TRL takes 6 steps, the short second batch each epoch
    (14, 4, 2, 1, 3, -1, None),
    (14, 2, 3, 2, 2, -1, None),  # 3 micro-batches a rank per epoch: a short last window of 1
    (17, 2, 2, 3, 1.5, -1, 5),  # fractional epochs, data_seed
    (10, 3, 1, 2, 3, 7, None),  # max_steps past the epochs asked
]


@pytest.mark.parametrize("run", ROWS_RUNS)
def test_trainer_loop_rows(run: tuple, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    n, batch, world, ga, epochs, max_steps, data_seed = run
    seed = 42
    loader = TrainLoader.rows(n, batch, world, data_seed if data_seed is not None else seed)
    for rank in range(world):
        args = TrainingArguments(str(tmp_path), per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                                 num_train_epochs=epochs, max_steps=max_steps, seed=seed, data_seed=data_seed,
                                 use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, remove_unused_columns=False)
        trainer = Recorder(model=torch.nn.Linear(1, 1), args=args, train_dataset=Rows(n),
                           data_collator=lambda rows: {"idx": torch.tensor([r["idx"] for r in rows])})
        got = run_trainer(trainer, world, rank, monkeypatch)
        want = expected(loader, rank, ga, epochs, max_steps)
        assert got == want
        assert trainer.state.max_steps == len(want) == loader.schedule(ga, epochs, max_steps).max_steps
        # Resuming after any step continues the same sequence.
        for start in range(len(want)):
            assert expected(loader, rank, ga, epochs, max_steps, start) == want[start:]
    if max_steps < 0:
        assert trainer_steps(n, batch, world, ga, epochs) == len(want)


def test_issue_42_counts() -> None:
    """14 rows, a global batch of 8, 3 epochs: TRL steps 6 times, the legacy rank_batches covers 3 steps a run."""
    assert trainer_steps(14, 8, 1, 1, 3) == 6
    assert trainer_steps(14, 4, 2, 1, 3) == 6
    legacy = rank_batches(14, 8, 0, 0, 1)
    assert [len(next(legacy)) for _ in range(3)] == [8, 8, 8]


GRPO_RUNS = [  # n, per-device batch, world, num_generations, steps_per_generation, num_iterations, ga, epochs
    (6, 2, 1, 2, 2, 1, 2, 3),
    (7, 2, 2, 4, 1, 2, 2, 2),  # a leftover prompt each epoch, two iterations per generation
    (9, 2, 3, 3, 2, 1, 3, 2),  # ga not a divisor of an epoch's micro-batches: a short last step
]


@pytest.mark.parametrize("run", GRPO_RUNS)
def test_trainer_loop_grpo(run: tuple, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    n, batch, world, gens, spg, iters, ga, epochs = run
    seed = 9
    loader = TrainLoader.grpo(n, batch, world, seed, gens, spg, iters)
    for rank in range(world):
        # GRPOConfig's generation_batch_size on `world` processes; it derives steps_per_generation for one.
        args = GRPOConfig(str(tmp_path), per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                          num_generations=gens, generation_batch_size=batch * world * spg, num_iterations=iters,
                          num_train_epochs=epochs, seed=seed, use_cpu=True, bf16=False, gradient_checkpointing=False,
                          report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
        args.steps_per_generation = spg
        trainer = GRPORecorder(model=torch.nn.Linear(1, 1), args=args, train_dataset=Rows(n),
                               data_collator=lambda rows: rows)
        trainer.num_generations, trainer.num_iterations, trainer.shuffle_dataset = gens, iters, True
        got = run_trainer(trainer, world, rank, monkeypatch)
        assert got == expected(loader, rank, ga, epochs, -1)
        for step in loader.steps(loader.schedule(ga, epochs), rank):
            assert [b.rows for b in step.batches] == [loader.generation_rows(g // loader.repeat_count, rank)
                                                      for g in step.micro]


def test_grpo_trainer_draws_prompts_as_trls_sampler(tmp_path: object) -> None:
    """posttrain's GRPOTrainer takes each generation batch's prompts in RepeatSampler's order, the second
    epoch included (one generator seeded once, as TRL; not reseeded per epoch)."""
    from posttrain import GRPOConfig
    from posttrain import GRPOTrainer as PosttrainGRPO
    from posttrain.demo import synthetic, tiny

    rows = [{"prompt": p} for p in synthetic.prompts(6, seed=0)]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, disable_tqdm=True)
    trainer = PosttrainGRPO(str(tiny.sft_model_path()), reward_funcs=synthetic.sentiment_reward, args=args,
                            train_dataset=rows)
    loader = TrainLoader.grpo(6, 4, 1, args.seed, 2, args.steps_per_generation)
    assert [trainer._generation_rows(c) for c in range(6)] == [loader.generation_rows(c, 0) for c in range(6)]
    trainer.end()
