"""Streaming rollouts: generation batches decode in one engine's slots across weight updates. A sequence still
decoding when the weights change goes on under the new ones (its KV so far stays; each token's log-prob is
that of the weights that sampled it), and slots that free take the next batch's sequences, so the engine
never waits for a batch's longest row."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.scheduler import Batch, Scheduler


class Source(Protocol):
    """What a stream reads of the :class:`~posttrain.rollout.api.Rollout` that opens it."""

    sampling: SamplingParams
    max_prompt_len: int
    rollouts: int  # rollouts of its own so far (each re-begins the engine)

    def engine_for(self, sampling: SamplingParams) -> DecodeEngine: ...

    def _engine_model(self) -> Any: ...

    def _seed_key(self) -> int: ...

    def update_stats(self) -> None: ...


class Stream:
    """Batches submitted in order and decoded by :meth:`advance`; the submitter takes finished rows from each
    :class:`Batch` (``finished``) and says when the weights change (:meth:`weights_changed`). ``group_size``:
    batches hold whole groups of that many rows, admitted to slots a whole group at a time."""

    def __init__(self, rollout: Source, group_size: int = 1) -> None:
        self.rollout, self.group_size = rollout, group_size
        self.scheduler: Scheduler | None = None
        self._rollouts = -1  # the rollout count at which the engine was last begun for the stream
        self.version = 0  # weight updates since the stream opened (or was restored)

    @property
    def idle(self) -> bool:
        """Nothing decoding and nothing waiting."""
        return self.scheduler is None or self.scheduler.idle

    @property
    def live(self) -> int:
        """Sequences in slots."""
        return 0 if self.scheduler is None else self.scheduler.live

    @property
    def waiting(self) -> int:
        """Sequences submitted and not yet in a slot."""
        return 0 if self.scheduler is None else len(self.scheduler.waiting)

    def _scheduler(self) -> Scheduler:
        rollout = self.rollout
        if self.scheduler is None or (self.idle and self._rollouts != rollout.rollouts):
            # A rollout of its own (evaluation) re-began the engine since: begin it again, empty.
            engine = rollout.engine_for(rollout.sampling)
            engine.begin(0, rollout.sampling.max_new_tokens, rollout.max_prompt_len)
            self.scheduler = Scheduler(engine, rollout.sampling.max_new_tokens, group_size=self.group_size)
            self.scheduler.version = self.version
            self._rollouts = rollout.rollouts
        return self.scheduler

    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tag: Any = None,
               key: int | None = None) -> Batch:
        """Queue a batch of left-padded prompts (at most ``max_prompt_len`` columns); its sampling ``key`` (None:
        drawn as a rollout's, from the run's seed and the rank)."""
        if prompt_ids.shape[1] > self.rollout.max_prompt_len:
            raise ValueError(f"prompts of {prompt_ids.shape[1]} tokens exceed the stream's max_prompt_len "
                             f"{self.rollout.max_prompt_len}")
        scheduler = self._scheduler()
        return scheduler.submit(prompt_ids, prompt_mask, self.rollout._seed_key() if key is None else key, tag)

    def advance(self) -> bool:
        """One scheduling round (retire, admit, up to ``sync_every`` decode steps); False when idle."""
        if self.scheduler is None:
            return False
        return self.scheduler.round()

    def drop(self, batch: Batch, rows: list[int]) -> None:
        """Drop ``batch``'s ``rows`` that have not finished (waiting or decoding)."""
        if self.scheduler is not None:
            self.scheduler.drop(batch, rows)

    def weights_changed(self, version: int | None = None) -> None:
        """The role's weights were updated: the engine re-reads them (a ZeRO-3 role's shadow is refreshed, on
        every rank); rows admitted from now on record ``version`` (None: the next one). The rollout's stats
        (``rollout/*`` metrics) are brought up to date here, once a step, not every decode round."""
        self.version = self.version + 1 if version is None else version
        if self.scheduler is not None:
            self.scheduler.version = self.version
            self.rollout.update_stats()
            self.rollout._engine_model()  # a ZeRO-3 role's shadow gathers the new weights (collective)
            self.scheduler.engine.refresh()
