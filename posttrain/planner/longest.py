"""The longest ``max_completion_length`` that fits: a search over the memory planner's plans, the prompt and
everything else fixed, in steps of a given number of tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.planner.memory import GiB, Plan

LENGTH_STEP = 1024  # the search's granularity in tokens (posttrain plan --length-step)
LONGEST = 1 << 22  # lengths searched up to (tokens)


@dataclass
class Longest:
    """The longest multiple of ``step`` whose plan fits (None: not even ``step``), its plan, and the plan one
    ``step`` longer, which does not fit (None: every length up to :data:`LONGEST` fits)."""

    step: int
    length: int | None
    plan: Plan | None
    next_plan: Plan | None

    @property
    def next_length(self) -> int | None:
        return None if self.next_plan is None else (self.length or 0) + self.step

    def line(self) -> str:
        """One sentence: the longest length and the next one up, with their peaks."""
        def peak(p: Plan) -> str:
            return f"{p.peak / GiB:.1f} of {p.gpu_memory / GiB:.1f} GiB"

        if self.length is None:
            return f"no max_completion_length fits: {self.step} tokens already needs {peak(self.next_plan)}"
        if self.next_plan is None:
            return (f"every max_completion_length up to {self.length:,} tokens fits ({peak(self.plan)}): "
                    "the searched range ends there")
        return (f"longest max_completion_length that fits: {self.length:,} tokens ({peak(self.plan)}); "
                f"{self.next_length:,} does not ({peak(self.next_plan)}); in steps of {self.step} tokens")


def longest_completion(plan_at: Callable[[int], Plan], step: int = LENGTH_STEP) -> Longest:
    """The largest multiple of ``step`` tokens for which ``plan_at(length)`` fits (peaks grow with the length):
    doubling until a length does not fit, then bisecting between the last that did and it."""
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"--length-step must be a whole number of tokens >= 1, got {step!r}")
    first = plan_at(step)
    if not first.fits:
        return Longest(step, None, None, first)
    lo, lo_plan, hi, hi_plan = 1, first, None, None
    while hi is None:
        k = 2 * lo
        if k * step > LONGEST:
            return Longest(step, lo * step, lo_plan, None)
        p = plan_at(k * step)
        if p.fits:
            lo, lo_plan = k, p
        else:
            hi, hi_plan = k, p
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = plan_at(mid * step)
        if p.fits:
            lo, lo_plan = mid, p
        else:
            hi, hi_plan = mid, p
    return Longest(step, lo * step, lo_plan, hi_plan)
