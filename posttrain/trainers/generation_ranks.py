"""Separate generation ranks in GRPO's and RLOO's streaming trainer (``generation_processes``): the last ranks of the
launch only generate, the others only train (the layout's blocks: placement.generation_ranks, weight_sync,
group_channel).

Generation batch ``c`` (TRL's prompt order; each training rank's share as in the colocated layout) trains at
optimizer step ``c + 1``. Its groups travel as channel indices ``c*K + j*T + r`` (T training ranks, K groups per step
over all of them, ``j`` a group's place in training rank ``r``'s share), so the channel hands each training rank the
groups it would train colocated, in order. A generation rank starts batch ``c`` under the first weight version the
training ranks send that is at most ``max_staleness`` updates older than step ``c + 1``'s (:class:`Pipeline`); it
loads versions only when it starts a batch, in order, every one sent; and it starts a batch at a point its own
decoding fixes (its queue empty and a slot free), so which weights sample which token never depends on timing.
Sequences decoding when a version loads go on under it (partial rollouts). Before a checkpoint the generation ranks
drain; the training ranks then take every group produced before it and save the untrained ones with the checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.data.order import mix_seed
from posttrain.data.prompts import left_pad
from posttrain.errors import ConfigError
from posttrain.placement.group_channel import GroupReceiver, GroupSender, RolloutGroup
from posttrain.placement.weight_sync import ENDED, WeightReceiver, WeightSender
from posttrain.rollout.sampling import RolloutOutput, finish
from posttrain.rollout.scheduler import Batch
from posttrain.trainers.streaming import STATE_FILE, Group, group_batch, groups_per_rank


@dataclass(frozen=True)
class Pipeline:
    """Which weight versions the training ranks send and under which each generation batch starts, from the config
    alone (both sides compute it). ``saves(step)``: whether a checkpoint follows optimizer step ``step``."""

    max_staleness: int
    weight_sync_steps: int
    total_steps: int
    saves: Callable[[int], bool]

    def sends(self, step: int) -> bool:
        """Whether the weights after optimizer step ``step`` (0: before the first) go to the generation ranks."""
        return step == 0 or step % self.weight_sync_steps == 0 or self.saves(step) or step == self.total_steps

    def required(self, cycle: int) -> int:
        """The version generation batch ``cycle`` starts under: the first one sent that is at most max_staleness
        updates older than the weights of step ``cycle + 1``, which trains it (weight_sync_steps <= max_staleness
        + 1 keeps it at most ``cycle``: trained before the batch is needed)."""
        version = max(0, cycle - self.max_staleness)
        while not self.sends(version):
            version += 1
        return version

    def first_cycle(self, step: int) -> int:
        """The first generation batch that starts under the weights of step ``step`` or newer: at a checkpoint after
        ``step``, the batches before it are produced, the others not started."""
        cycle = 0
        while cycle < self.total_steps and self.required(cycle) < step:
            cycle += 1
        return cycle

    def drains_before(self, cycle: int) -> bool:
        """Whether every earlier batch completes before ``cycle`` starts: it is the first under a checkpoint's
        weights, so that the checkpoint holds no started batch."""
        version = self.required(cycle)
        return cycle > 0 and version > self.required(cycle - 1) and self.saves(version)


def pipeline(trainer: Any) -> Pipeline:
    cfg = trainer.cfg
    return Pipeline(cfg.max_staleness, cfg.weight_sync_steps, trainer.total_steps, trainer.saves_after)


@dataclass
class _Started:
    """One submitted batch: generation batch ``cycle``'s groups ``places`` of training rank ``rank``'s share."""

    cycle: int
    rank: int
    places: list[int]
    batch: Batch
    sent: list[bool]


class GenerationRank:
    """A generation rank's whole run (``train()`` there): stream generation batches through the engine over this rank's
    copy of the policy, hand each completed group to the channel, load the versions the training ranks send."""

    def __init__(self, trainer: Any, copy: torch.nn.Module, max_prompt_len: int) -> None:
        from posttrain.models.lora import add_adapters
        from posttrain.rollout import Rollout

        cfg, s = trainer.cfg, trainer.session
        self.trainer, self.cfg, self.groups = trainer, cfg, s.groups
        layout = s.groups.layout
        self.trainers, self.generators = layout.training_processes, layout.generation_processes
        self.me = s.groups.rank - self.trainers  # this rank's place among the generation ranks
        self.k = groups_per_rank(cfg)
        self.per_step = self.k * self.trainers
        if trainer.peft_config is not None:  # the same adapters as the trained policy; the first sync sets them
            copy = add_adapters(copy, trainer.peft_config, s, "policy")
        copy.eval().requires_grad_(False)
        self.copy = copy
        most = -(-self.per_step // self.generators) * cfg.num_generations  # rows of a generation batch here
        self.rollout = Rollout.from_config(cfg, None, "policy", trainer.sampling, max_batch=most,
                                           max_prompt_len=max_prompt_len, model=copy)
        self.stream = self.rollout.open_stream(cfg.num_generations)
        self.plan = pipeline(trainer)
        self.receiver = WeightReceiver(s.groups, copy)
        self.stats = {"generation/versions": 0.0, "generation/loads_while_decoding": 0.0, "generation/groups": 0.0,
                      "generation/weight_wait_s": 0.0}

    def _load_next(self) -> int:
        """Wait for the next version the training ranks send and decode under it from now on (:data:`ENDED` at
        the end)."""
        start = time.perf_counter()
        version = self.receiver.receive()
        self.stats["generation/weight_wait_s"] += time.perf_counter() - start
        if version != ENDED:
            self.stats["generation/loads_while_decoding"] += float(self.stream.live > 0)  # partial rollouts
            self.stream.weights_changed(version)
            self.stats["generation/versions"] += 1
        return version

    def run(self) -> Any:
        from transformers.trainer_utils import TrainOutput

        total = self.plan.total_steps
        if self._load_next() == ENDED:
            return TrainOutput(0, 0.0, dict(self.stats))
        first = torch.zeros(1, dtype=torch.int64, device=self.groups.device)
        dist.broadcast(first, src=0, group=self.groups.sync)  # the first batch not yet produced (resume)
        cycle = int(first.item())
        sender = GroupSender(self.groups, start=cycle * self.per_step)
        started: list[_Started] = []
        while cycle < total or started:
            while cycle < total and self._may_start(cycle, started):
                while self.stream.version < self.plan.required(cycle):
                    if self._load_next() == ENDED:  # the training ranks stopped early
                        return TrainOutput(cycle, 0.0, dict(self.stats))
                started += self._submit(cycle)
                cycle += 1
            self.stream.advance()
            self._collect(started, sender)
        while self._load_next() != ENDED:  # the versions sent after the last batch started (the final weights)
            pass
        sender.wait()  # (after: training rank 0 may be sending a version before it takes the last groups)
        return TrainOutput(total, 0.0, dict(self.stats))

    def _may_start(self, cycle: int, started: list[_Started]) -> bool:
        """Whether batch ``cycle`` starts now: nothing waits for a slot and one is free; every batch that the weights
        it needs trained on is complete here (else waiting for them could deadlock); drained before a checkpoint's
        weights."""
        if self.stream.waiting or self.stream.live >= self.rollout.kv_slots:
            return False
        oldest = min((st.cycle for st in started), default=cycle)  # the oldest batch not complete here
        if oldest < self.plan.required(cycle):
            return False
        return not (started and self.plan.drains_before(cycle))

    def _submit(self, cycle: int) -> list[_Started]:
        """Batch ``cycle``'s groups this rank produces, one submission per training rank's share, each with its own
        sampling key (the run's seed, the batch, the training rank)."""
        trainer, g = self.trainer, self.cfg.num_generations
        out = []
        for rank in range(self.trainers):
            places = [j for j in range(self.k) if self._index(cycle, j, rank) % self.generators == self.me]
            if not places:
                continue
            rows = trainer._generation_rows(cycle, rank)
            ids, mask = left_pad([trainer.prompt_ids[rows[j * g + q]] for j in places for q in range(g)],
                                 trainer.tokenizer.pad_token_id, torch.device("cpu"))
            key = mix_seed(self.cfg.seed, "generation", cycle, rank) & 0x7FFFFFFF
            batch = self.stream.submit(ids, mask, tag=(cycle, rank), key=key)
            out.append(_Started(cycle, rank, places, batch, [False] * len(places)))
        return out

    def _index(self, cycle: int, place: int, rank: int) -> int:
        return cycle * self.per_step + place * self.trainers + rank

    def _collect(self, started: list[_Started], sender: GroupSender) -> None:
        """Hand every group whose completions all finished to the channel (it sends them in index order)."""
        g, sampling = self.cfg.num_generations, self.rollout.sampling
        for st in started:
            b = st.batch
            for n, place in enumerate(st.places):
                rows = slice(n * g, (n + 1) * g)
                if st.sent[n] or not all(b.finished[rows]):
                    continue
                st.sent[n] = True
                completion, mask, logps = finish(b.tokens[rows], b.logprobs[rows], sampling)
                sender.put(RolloutGroup(self._index(st.cycle, place, st.rank), min(b.admitted_at[rows]),
                                        b.prompt_ids[rows], completion, mask, logps,
                                        extras={"prompt_mask": b.prompt_mask[rows]}))
                self.stats["generation/groups"] += 1
        started[:] = [st for st in started if not all(st.sent)]


class GenerationFeed:
    """The training ranks' end: the groups each step trains, from the channel; the weights after each step that the
    :class:`Pipeline` sends; at a checkpoint, the produced and untrained groups (``state/streaming_rank<N>.pt``)."""

    def __init__(self, trainer: Any) -> None:
        s, cfg = trainer.session, trainer.cfg
        self.groups = s.groups
        self.trainers = s.num_processes
        self.k = groups_per_rank(cfg)
        self.per_step = self.k * self.trainers
        self.plan = pipeline(trainer)
        self.rows_of, self.pad, self.sampling = trainer._generation_rows, trainer.tokenizer.pad_token_id, trainer.sampling
        self.sender = WeightSender(s.groups, s.unwrap("policy"), weight_sync_steps=cfg.weight_sync_steps)
        self.receiver: GroupReceiver | None = None
        self.ready: list[Group] = []  # received, not yet trained, in index order
        self.cut = 0  # the first generation batch not produced when this run started (a resumed run's checkpoint)
        self.version = 0  # optimizer steps done

    def begin(self, step: int) -> None:
        """Before the first step this run trains (``step`` done): every weight to the generation ranks, and where
        their production starts."""
        self.sender.send(step, include_frozen=True)
        if self.sender.sends:
            first = torch.tensor([self.cut], dtype=torch.int64, device=self.groups.device)
            dist.broadcast(first, src=0, group=self.groups.sync)
        self.receiver = GroupReceiver(self.groups, start=self.cut * self.per_step)
        self.version = step

    def _receive(self) -> Group:
        grp = self.receiver.receive()
        cycle, rest = divmod(grp.index, self.per_step)
        # Owned copies: the channel's tensors are views of one byte buffer (a checkpoint saves them apart).
        return Group(cycle, rest // self.trainers, grp.version, grp.prompt_ids.clone(), grp.extras["prompt_mask"].clone(),
                     grp.completion_ids.clone(), grp.sampling_logps.clone())

    def batch(self, cycle: int, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor,
                                                               RolloutOutput, dict[str, float]]:
        """Generation batch ``cycle``'s groups of this rank (waiting for them): as StreamingGeneration.batch."""
        if self.receiver is None:
            self.begin(cycle)  # one generation batch per optimizer step: ``cycle`` steps done
        while sum(grp.cycle == cycle for grp in self.ready) < self.k:
            self.ready.append(self._receive())
        groups = [grp for grp in self.ready if grp.cycle == cycle]
        self.ready = [grp for grp in self.ready if grp.cycle != cycle]
        *out, metrics = group_batch(groups, self.rows_of, self.pad, self.sampling, self.version, device)
        metrics["streaming/ready_groups"] = float(len(self.ready))
        return (*out, metrics)

    def stepped(self, step: int) -> None:
        """After optimizer step ``step``: the new weights to the generation ranks where the pipeline sends them."""
        self.version = step
        if self.plan.sends(step):
            self.sender.send(step)

    def save(self, directory: Path, rank: int, step: int) -> None:
        """At the checkpoint after ``step``: take every group produced before it (the generation ranks drained),
        save those not yet trained."""
        cut = min(self.plan.first_cycle(step), self.plan.total_steps)
        while self.receiver.next < cut * self.per_step:
            self.ready.append(self._receive())
        torch.save({"cut": cut, "version": step, "ready": [grp.state() for grp in self.ready]},
                   directory / STATE_FILE.format(rank))

    def restore(self, directory: Path, rank: int) -> None:
        path = directory / STATE_FILE.format(rank)
        state = torch.load(path, weights_only=True) if path.is_file() else {}
        if "cut" not in state:
            raise ConfigError(f"{directory} has no generation-rank state for rank {rank}: it was saved without "
                              "generation_processes or by other processes; resume it with the settings it was saved "
                              "with")
        self.cut, self.ready = int(state["cut"]), [Group(**grp) for grp in state["ready"]]

    def finish(self) -> None:
        """No sync follows: the generation ranks end their loop."""
        self.sender.end()


class SeparateGeneration:
    """GRPOTrainer's methods under ``generation_processes``: a generation rank runs :class:`GenerationRank`'s loop in
    place of the training loop (the loop's ``generation_loop``) and writes nothing (the training ranks log, save and
    evaluate); the training ranks end the weight syncs when training ends (``training_ended``)."""

    generation_rank: GenerationRank | None = None
    feed: GenerationFeed | None = None

    def generation_loop(self) -> Any:
        return self.generation_rank.run()

    def training_ended(self) -> None:
        if self.feed is not None:
            self.feed.finish()

    def _finish_init(self, callbacks: list[Any] | None) -> None:
        if self.generation_rank is None:
            super()._finish_init(callbacks)
            return
        from transformers.trainer_callback import TrainerState

        self.state = TrainerState(max_steps=self.total_steps)  # an empty log: the training ranks keep it

    def evaluate(self) -> dict[str, float]:
        if self.generation_rank is not None:  # evaluation generates on the training ranks
            return {}
        return super().evaluate()
