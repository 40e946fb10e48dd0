"""The rollout engine's scheduling surface without a model: each sequence decodes for a scripted number of tokens,
so posttrain's own Scheduler, Stream and StreamingGeneration make their real decisions (admission, retirement,
what a step trains, what waits or is dropped) on any length distribution, on a CPU, in milliseconds.

Used by tests/test_streaming_policy.py (exact scenarios) and benchmarks/rollout/streaming_policy.py (a long-tailed
case timed with decode-step costs measured on a GPU: a prediction, not a measurement)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.stream import Stream

PAD, TOKEN = 0, 1


class ScriptedEngine:
    """``length_of(prompt, row)``: the completion length of batch row ``row`` of ``prompt`` (its unpadded ids).
    ``step_ms(rows)``: what a decode step of ``rows`` rows costs; ``prefill_ms``: per prompt token. The time the
    engine would have taken accumulates in ``ms``."""

    def __init__(self, slots: int, sampling: SamplingParams, length_of: Callable[[list[int], int], int],
                 sync_every: int = 1, step_ms: Callable[[int], float] = lambda rows: 0.0,
                 prefill_ms: float = 0.0) -> None:
        self.slots, self.sampling, self.length_of = [None] * slots, sampling, length_of
        self.sync_every, self.admit_min, self.step_ms, self.prefill_ms = sync_every, 1, step_ms, prefill_ms
        self.device, self.prompts, self.stop_ids = torch.device("cpu"), None, [TOKEN]
        self.left: dict[int, int] = {}  # slot -> tokens still to sample
        self.made: dict[int, int] = {}  # slot -> tokens sampled
        self.width, self.ms, self.refreshes = 0, 0.0, 0

    def begin(self, key: int, max_new_tokens: int, width: int) -> None:
        self.left.clear()
        self.made.clear()
        self.width = width

    def refresh(self) -> None:
        self.refreshes += 1

    def admit(self, slots: list[int], seq_ids: list[int], ids: torch.Tensor, mask: torch.Tensor,
              groups: list[int] | None = None, key: int | None = None) -> None:
        for s, row, prompt, m in zip(slots, seq_ids, ids, mask):
            n = max(1, min(self.length_of(prompt[m.bool()].tolist(), row), self.sampling.max_new_tokens))
            self.made[s], self.left[s] = 1, n - 1  # the prefill samples the first token
            self.ms += self.prefill_ms * int(m.sum())

    def done_flags(self, rows: int) -> list[bool]:
        return [self.left.get(s, 1) == 0 for s in range(rows)]

    def run(self, rows: int, length: int, steps: int) -> None:
        for s in self.left:
            took = min(steps, self.left[s])
            self.left[s] -= took
            self.made[s] += took
        self.ms += steps * self.step_ms(rows)

    def harvest(self, slots: list[int], seq_ids: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        for s, row in zip(slots, seq_ids):
            tokens[row, : self.made[s]] = TOKEN
            del self.left[s], self.made[s]

    def free(self, slots: list[int]) -> None:
        for s in slots:
            del self.left[s], self.made[s]

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        for s, d in zip(src, dst):
            self.left[d], self.made[d] = self.left.pop(s), self.made.pop(s)

    def columns(self, new_tokens: int, width: int | None = None) -> int:
        return (self.width if width is None else width) + new_tokens

    def rows_bucket(self, rows: int) -> int:
        return min(len(self.slots), -(-rows // 8) * 8)

    def length_bucket_for(self, columns: int) -> int:
        return columns

    def compact_prompts(self) -> None:
        pass


class ScriptedRollout:
    """What a :class:`~posttrain.rollout.stream.Stream` reads of a Rollout, over a :class:`ScriptedEngine`."""

    def __init__(self, engine: ScriptedEngine, max_prompt_len: int) -> None:
        self.engine, self.sampling, self.max_prompt_len, self.rollouts = engine, engine.sampling, max_prompt_len, 0

    def engine_for(self, sampling: SamplingParams) -> ScriptedEngine:
        return self.engine

    def _engine_model(self) -> Any:
        return None

    def _seed_key(self) -> int:
        return 0

    def update_stats(self) -> None:
        pass

    def open_stream(self, group_size: int = 1) -> Stream:
        return Stream(self, group_size)


def streaming_config(num_generations: int, groups_per_step: int, max_staleness: int, stale_groups: str,
                     max_inflight_tasks: int = -1) -> SimpleNamespace:
    """The fields StreamingGeneration reads, for one process training ``groups_per_step`` groups a step."""
    return SimpleNamespace(num_generations=num_generations, per_device_train_batch_size=num_generations,
                           gradient_accumulation_steps=groups_per_step, max_staleness=max_staleness,
                           stale_groups=stale_groups, max_inflight_tasks=max_inflight_tasks)


def completion_lengths(tokens: torch.Tensor) -> torch.Tensor:
    """The lengths of a :class:`ScriptedEngine`'s harvested completions."""
    return (tokens == TOKEN).sum(1)
