"""Streaming generation for GRPO and RLOO (``async_generation``): the engine's slots stay full across optimizer
steps and a step trains groups as they complete, each at most ``max_staleness`` updates after the weights it started
under, with the sampling correction (``trainers/off_policy.py``). ``stale_groups`` says how the bound is kept:
"wait" trains the oldest finished groups first and decodes on before a step until no started group would miss it;
"drop" (TRL AsyncGRPO's way) trains the first groups to finish and drops a group that misses it (counted).

Each process streams its own whole groups, in TRL's prompt order; every decision (what is submitted, admitted,
trained or dropped) follows decode steps, never the clock, so a run is deterministic. Before a step that is
checkpointed or evaluated the stream drains (nothing is submitted until every started group completes), so a
checkpoint holds only finished groups and a resumed run continues exactly as the uninterrupted one."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.data.prompts import left_pad
from posttrain.errors import ConfigError
from posttrain.placement.generation_ranks import check_layout
from posttrain.placement.ranks import world_size
from posttrain.rollout.sampling import RolloutOutput, SamplingParams, finish
from posttrain.rollout.scheduler import Batch

STATE_FILE = "streaming_rank{}.pt"
STALE_GROUPS = ("wait", "drop")
logger = logging.getLogger(__name__)


@dataclass
class StreamingFields:
    """The settings of streaming generation (TRL's AsyncGRPOConfig names, where it has them)."""

    # Keep generating across optimizer steps and train groups as they complete (off: TRL's synchronous step).
    async_generation: bool = False
    # Weight updates a group may lag behind the weights it trains under (TRL AsyncGRPO).
    max_staleness: int = 4
    # How the bound is kept. "wait": the oldest groups train first and a step waits for those that would miss it,
    # so none is lost; "drop": the first groups to finish train and a late one is dropped untrained, which
    # drops long completions more often than short ones (TRL AsyncGRPO's behaviour).
    stale_groups: str = "wait"
    # Sequences started and not yet trained, over all processes; -1: (max_staleness + 1) steps' worth.
    max_inflight_tasks: int = -1
    # Optimizer steps between weight syncs to generation (colocated generation reads the weights as they train).
    weight_sync_steps: int = 1
    # The last N ranks of the launch only generate, the others only train (trainers/generation_ranks.py).
    generation_processes: int = 0


def training_processes(cfg: Any) -> int:
    """The launch's processes that train: all, less ``generation_processes`` (a layout that cannot work is refused)."""
    gen = cfg.generation_processes
    if gen and not isinstance(gen, bool) and cfg.async_generation is not True:
        raise ConfigError(f"generation_processes {gen} needs async_generation true (the generation ranks stream "
                          "their rollouts across optimizer steps): set async_generation true, or generation_processes 0")
    layout = check_layout(gen, world_size(), cfg.generation_backend)
    return layout.training_processes if layout else world_size()


def check_streaming_config(cfg: Any, world: int) -> None:
    """Refuse a streaming setting that cannot run, by its flag, before anything loads."""
    if not isinstance(cfg.async_generation, bool):
        raise ConfigError(f"async_generation must be true or false, got {cfg.async_generation!r}")
    if not isinstance(cfg.max_staleness, int) or cfg.max_staleness < 0:
        raise ConfigError(f"max_staleness must be a whole number >= 0 (weight updates), got {cfg.max_staleness!r}")
    if cfg.stale_groups not in STALE_GROUPS:
        raise ConfigError(f"stale_groups must be one of {', '.join(STALE_GROUPS)}, got {cfg.stale_groups!r}")
    separate = bool(cfg.generation_processes)
    if not separate and cfg.weight_sync_steps != 1:
        raise ConfigError("weight_sync_steps other than 1 needs separate generation ranks; colocated generation reads "
                          "the weights as they train: set weight_sync_steps 1")
    if not cfg.async_generation:
        return
    if separate:
        if isinstance(cfg.weight_sync_steps, bool) or not isinstance(cfg.weight_sync_steps, int) or (
                cfg.weight_sync_steps < 1):
            raise ConfigError(f"weight_sync_steps must be a whole number >= 1, got {cfg.weight_sync_steps!r}")
        if cfg.weight_sync_steps > cfg.max_staleness + 1:
            raise ConfigError(f"weight_sync_steps {cfg.weight_sync_steps} lets groups lag more than max_staleness "
                              f"({cfg.max_staleness}) updates behind (a generation batch waits for a synced version): "
                              f"set weight_sync_steps at most {cfg.max_staleness + 1}, or raise max_staleness")
        if cfg.max_inflight_tasks != -1:
            raise ConfigError("with generation_processes, max_staleness alone bounds the generation batches in flight "
                              "(max_staleness + 1): set max_inflight_tasks -1")
        if cfg.stale_groups != "wait":
            raise ConfigError("generation ranks start each generation batch under weights within max_staleness, so "
                              "no group is ever late or dropped: set stale_groups wait")
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    reasons = [
        (cfg.generation_backend != "posttrain", "generation_backend posttrain (streaming decodes in the engine)"),
        (cfg.num_iterations != 1, "num_iterations 1 (a streamed group trains once)"),
        (cfg.steps_per_generation != cfg.gradient_accumulation_steps,
         "steps_per_generation equal to gradient_accumulation_steps (one generation batch per optimizer step)"),
        (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps % cfg.num_generations != 0,
         f"per_device_train_batch_size x gradient_accumulation_steps a multiple of num_generations "
         f"({cfg.num_generations}): each process streams whole groups"),
        (cfg.dynamic_sampling, "dynamic_sampling false"),
        (cfg.generation_shared_prompt_kv, "generation_shared_prompt_kv false"),
        (cfg.vllm_enable_sleep_mode, "vllm_enable_sleep_mode false (streamed sequences keep their cache across steps)"),
        (cfg.enable_jit_checkpoint, "enable_jit_checkpoint false (the stream drains for a checkpoint only at save_steps)"),
        (cfg.max_inflight_tasks != -1 and cfg.max_inflight_tasks < per_step,
         f"max_inflight_tasks -1 or at least one step's completions ({per_step})"),
    ]
    for bad, needs in reasons:
        if bad:
            raise ConfigError(f"async_generation needs {needs}: set it, or async_generation false")
    trainable = (cfg.max_staleness + 1) * per_step  # what the steps within the bound train
    if not separate and cfg.stale_groups == "wait" and cfg.max_inflight_tasks > trainable:
        raise ConfigError(f"max_inflight_tasks {cfg.max_inflight_tasks} starts more sequences than the "
                          f"max_staleness + 1 steps that may train them take ({trainable}), so with stale_groups "
                          f"wait some group would still miss the bound: set it at most {trainable}, or "
                          "stale_groups drop")


def groups_per_rank(cfg: Any) -> int:
    """Groups each training process trains per optimizer step (check_streaming_config makes it whole)."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // cfg.num_generations


def inflight_batches(cfg: Any, world: int) -> int:
    """Generation batches (one optimizer step's each) that may be started and not yet trained."""
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    if cfg.max_inflight_tasks == -1:
        return cfg.max_staleness + 1
    return max(1, cfg.max_inflight_tasks // per_step)


@dataclass
class Group:
    """``num_generations`` completions of one prompt, finished and not yet trained."""

    cycle: int  # the generation batch it was submitted in (TRL's prompt order)
    index: int  # its place in that batch
    version: int  # the weight version its first sequence started under
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor

    def state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("cycle", "index", "version", "prompt_ids", "prompt_mask", "tokens",
                                              "logprobs")}


class StreamingGeneration:
    """A trainer's stream: which generation batches are submitted, which groups train at each step, which
    are dropped. ``rows_of(cycle)``: this process's dataset rows of generation batch ``cycle``;
    ``prompt_ids``: each dataset row's tokenized prompt."""

    def __init__(self, rollout: Any, cfg: Any, world: int, rows_of: Any, prompt_ids: list[list[int]],
                 pad_token_id: int) -> None:
        self.stream = rollout.open_stream(cfg.num_generations)
        self.cfg, self.rows_of, self.prompt_ids, self.pad = cfg, rows_of, prompt_ids, pad_token_id
        self.group_size = cfg.num_generations
        self.groups_per_step = groups_per_rank(cfg)
        self.limit = inflight_batches(cfg, world) * self.groups_per_step  # groups started and not yet trained
        self.next_cycle = 0  # the next generation batch to submit
        self.pending: list[tuple[int, Batch, list[bool]]] = []  # submitted batches: (cycle, batch, group consumed)
        self.ready: list[Group] = []  # finished groups, in the order they finished
        self.dropped = 0  # groups dropped as stale since the last step's metrics
        self.dropped_total = 0
        self.held = 0  # scheduling rounds a step waited for late groups (stale_groups wait), since the last metrics

    @property
    def version(self) -> int:
        return self.stream.version

    def _unconsumed(self) -> int:
        return sum(done.count(False) for _, _, done in self.pending) + len(self.ready)

    def _submit(self) -> None:
        cycle = self.next_cycle
        rows = self.rows_of(cycle)
        ids, mask = left_pad([self.prompt_ids[i] for i in rows], self.pad, torch.device("cpu"))
        batch = self.stream.submit(ids, mask, tag=cycle)
        self.pending.append((cycle, batch, [False] * (len(rows) // self.group_size)))
        self.next_cycle += 1

    def _collect(self) -> None:
        """Move groups whose completions all finished into ``ready`` (in batch order within one round)."""
        g = self.group_size
        for cycle, batch, consumed in self.pending:
            for j, done in enumerate(consumed):
                rows = range(j * g, (j + 1) * g)
                if not done and all(batch.finished[r] for r in rows):
                    consumed[j] = True
                    self.ready.append(Group(cycle, j, min(batch.admitted_at[r] for r in rows),
                                            batch.prompt_ids[j * g : (j + 1) * g], batch.prompt_mask[j * g : (j + 1) * g],
                                            batch.tokens[j * g : (j + 1) * g], batch.logprobs[j * g : (j + 1) * g]))
        self.pending = [p for p in self.pending if not all(p[2])]

    def next_groups(self, drain: bool) -> list[Group]:
        """The groups this step trains, ``groups_per_step`` of them in prompt order: the oldest finished ones
        (``stale_groups`` "wait") or the first to finish ("drop"). ``drain``: submit nothing more until every started
        group has finished (a checkpoint or evaluation follows the step)."""
        need, waits = self.groups_per_step, self.cfg.stale_groups == "wait"
        while True:
            self._collect()
            if len(self.ready) >= need and (not drain or self.drained):
                if not (waits and self._holds_back(need)):
                    break
                self.held += 1  # a round decoded only so that no group misses the bound
            # Within the in-flight bound (draining: none), and always when nothing else could finish a group.
            while ((not drain and self._unconsumed() + need <= self.limit)
                   or (self.stream.idle and len(self.ready) < need)):
                self._submit()
            self.stream.advance()
        if waits:  # the oldest first (stable: then in the order they finished)
            self.ready.sort(key=lambda grp: grp.version)
        taken, self.ready = self.ready[:need], self.ready[need:]
        return sorted(taken, key=lambda grp: (grp.cycle, grp.index))

    def _started(self) -> Iterator[tuple[Batch, list[bool], int, int]]:
        """Each started, unfinished group: its batch, that batch's consumed flags, its index there and the weight
        version its first sequence started under."""
        g = self.group_size
        for _, batch, consumed in self.pending:
            for j, done in enumerate(consumed):
                started = [batch.admitted_at[r] for r in range(j * g, (j + 1) * g) if batch.admitted_at[r] >= 0]
                if not done and started:
                    yield batch, consumed, j, min(started)

    def _holds_back(self, need: int) -> bool:
        """Whether this step must decode on before it trains (``stale_groups`` "wait"): with the ``need`` oldest
        finished groups trained now and as many at each later step, some group started under earlier weights would
        train more than ``max_staleness`` updates late, unless groups still decoding finish first. Groups started
        under the current weights never decide it: the in-flight bound leaves them room (max_staleness + 1 steps)."""
        now, bound = self.version, self.cfg.max_staleness
        unfinished = [v for *_, v in self._started() if v < now]
        if not unfinished:
            return False
        left = sorted(grp.version for grp in self.ready)[need:] + unfinished
        # j steps after this one the groups started under version now - bound + j or earlier must all be trained.
        return any(sum(v <= now - bound + j for v in left) > j * need for j in range(bound))

    def batch(self, groups: list[Group], device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor,
                                                                         RolloutOutput, dict[str, float]]:
        """The dataset rows, left-padded prompts, completions and streaming metrics of ``groups``."""
        *out, metrics = group_batch(groups, self.rows_of, self.pad, self.stream.rollout.sampling, self.version, device)
        metrics.update({"streaming/dropped_groups": float(self.dropped), "streaming/held_rounds": float(self.held),
                        "streaming/in_flight": float(self.stream.live + self.stream.waiting),
                        "streaming/ready_groups": float(len(self.ready))})
        self.dropped = self.held = 0
        return (*out, metrics)

    def weights_changed(self) -> None:
        """After an optimizer step: the engine reads the new weights; groups now too stale are dropped."""
        self.stream.weights_changed()
        bound, g = self.cfg.max_staleness, self.group_size
        stale = [grp for grp in self.ready if self.version - grp.version > bound]
        self.ready = [grp for grp in self.ready if self.version - grp.version <= bound]
        dropped = len(stale)
        for batch, consumed, j, version in list(self._started()):
            if self.version - version > bound:
                self.stream.drop(batch, list(range(j * g, (j + 1) * g)))
                consumed[j] = True
                dropped += 1
        self.pending = [p for p in self.pending if not all(p[2])]
        if dropped and not self.dropped_total:  # once: the counter shows the rest
            advice = ("raise max_staleness, or give the engine more slots (generation_kv_slots)"
                      if self.cfg.stale_groups == "drop" else "stale_groups wait keeps the bound for the groups "
                      "started under these settings; this run was resumed or configured past it")
            logger.warning("streaming: %d group(s) started more than max_staleness (%d) weight updates ago were "
                           "dropped untrained (counted in streaming/dropped_groups): %s", dropped, bound, advice)
        self.dropped += dropped
        self.dropped_total += dropped

    @property
    def drained(self) -> bool:
        """Nothing started and unfinished: a checkpoint can hold the stream."""
        return self.stream.idle and not self.pending

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (the stream is drained: only finished groups)."""
        if not self.drained:
            raise RuntimeError("a streaming checkpoint needs the stream drained")
        return {"next_cycle": self.next_cycle, "version": self.version, "dropped_total": self.dropped_total,
                "ready": [grp.state() for grp in self.ready]}

    def save(self, directory: Path, rank: int) -> None:
        torch.save(self.state(), directory / STATE_FILE.format(rank))

    def restore(self, directory: Path, rank: int) -> None:
        path = directory / STATE_FILE.format(rank)
        if not path.is_file():
            raise ConfigError(f"{directory} has no streaming state for rank {rank}: it was saved without "
                              "async_generation or by fewer processes; resume it with the settings it was saved with")
        state = torch.load(path, weights_only=True)
        self.next_cycle, self.dropped_total = int(state["next_cycle"]), int(state["dropped_total"])
        self.stream.version = int(state["version"])
        self.ready = [Group(**grp) for grp in state["ready"]]


def group_batch(groups: list[Group], rows_of: Any, pad: int, sampling: SamplingParams, version: int,
                device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor, RolloutOutput, dict[str, float]]:
    """The dataset rows (``rows_of(cycle)``: a generation batch's rows of this process), left-padded prompts and
    completions of finished ``groups``, and their staleness against weight ``version`` (TRL AsyncGRPO's names)."""
    g = len(groups[0].tokens)
    rows = [rows_of(grp.cycle)[grp.index * g + k] for grp in groups for k in range(g)]
    width = max(int(grp.prompt_mask.sum(1).max()) for grp in groups)  # as wide as the longest prompt
    prompt_ids = torch.cat([_to_width(grp.prompt_ids, width, pad) for grp in groups]).to(device)
    prompt_mask = torch.cat([_to_width(grp.prompt_mask, width, 0) for grp in groups]).to(device)
    tokens = torch.cat([grp.tokens for grp in groups])
    logprobs = torch.cat([grp.logprobs for grp in groups])
    completion, mask, logprobs = finish(tokens, logprobs, sampling)
    staleness = torch.tensor([float(version - grp.version) for grp in groups])
    metrics = {"sample/staleness_mean": staleness.mean().item(), "sample/staleness_max": staleness.max().item()}
    out = RolloutOutput(sequences=torch.cat([prompt_ids, completion.to(device)], 1), completion_ids=completion,
                        completion_mask=mask, logprobs=logprobs)
    return rows, prompt_ids, prompt_mask, out, metrics


def _to_width(t: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    """Left-padded rows ``t`` cut or padded on the left to ``width`` columns (only padding is cut)."""
    if t.shape[1] >= width:
        return t[:, t.shape[1] - width:]
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=pad)
