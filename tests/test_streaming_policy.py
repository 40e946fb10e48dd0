"""How streaming keeps ``max_staleness`` (``stale_groups``), decided by posttrain's own Scheduler, Stream and
StreamingGeneration over an engine whose sequences decode for scripted lengths (benchmarks/harness/
scripted_engine.py): "wait" trains every group within the bound and drops none, whatever the lengths; "drop"
(TRL AsyncGRPO's way) drops a group whose long member outlives the bound."""

import random

import pytest

from benchmarks.harness.scripted_engine import ScriptedEngine, ScriptedRollout, streaming_config
from posttrain.rollout.sampling import SamplingParams
from posttrain.trainers.streaming import StreamingGeneration


def stream(lengths, slots, groups_per_step, bound, policy, g=2, max_new=64):
    """A StreamingGeneration of one process whose group ``i`` (prompt ``i``) member ``k`` decodes
    ``lengths(i, k)`` tokens."""
    engine = ScriptedEngine(slots, SamplingParams(max_new_tokens=max_new, pad_token_id=0),
                            lambda prompt, row: lengths(prompt[0] - 100, row % g))
    cfg = streaming_config(g, groups_per_step, bound, policy)

    def rows_of(cycle):
        return [i for i in range(cycle * groups_per_step, (cycle + 1) * groups_per_step) for _ in range(g)]

    return StreamingGeneration(ScriptedRollout(engine, 4), cfg, 1, rows_of, [[100 + i] for i in range(1000)], 0)


def run(st, steps):
    """Each step's trained groups as (prompt, staleness) pairs, the weights changing after each step."""
    out = []
    for _ in range(steps):
        out.append([(grp.cycle * st.groups_per_step + grp.index, st.version - grp.version)
                    for grp in st.next_groups(drain=False)])
        st.weights_changed()
    return out


def long_first_member(i, k):
    return 30 if (i, k) == (0, 0) else 2


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_a_long_member_outliving_the_bound_waits_or_is_dropped(policy):
    """max_staleness 1, 2 groups a step through 4 slots, group 0's first member 30 tokens and every other
    completion 2: "drop" trains groups as they finish and drops group 0 two updates after it started; "wait"
    holds step 1 until group 0 finishes and trains it there, one update late, and drops nothing."""
    st = stream(long_first_member, slots=4, groups_per_step=2, bound=1, policy=policy)
    steps = run(st, 4)
    trained = [p for step in steps for p, _ in step]
    if policy == "drop":
        assert 0 not in trained and st.dropped_total == 1
        assert steps[0] == [(1, 0), (2, 0)]
    else:
        assert st.dropped_total == 0
        assert steps[0] == [(1, 0), (2, 0)] and (0, 1) in steps[1]
        assert sorted(trained) == list(range(len(trained)))  # every started prompt, once
    assert all(s <= 1 for step in steps for _, s in step)


@pytest.mark.parametrize("bound,slots,groups_per_step", [(1, 8, 4), (2, 8, 2), (3, 16, 4), (1, 6, 3)])
def test_wait_keeps_the_bound_without_dropping_on_long_tailed_lengths(bound, slots, groups_per_step):
    """Geometric lengths with a cut at 64 (mean about 8): with "wait" every trained group is at most max_staleness
    updates stale, none is dropped and each prompt trains once (those passed over are in flight); the same
    case with "drop" does drop (the scenario is not one where nothing could go stale)."""
    rng = random.Random(bound * 100 + slots)
    table = {}

    def lengths(i, k):
        if (i, k) not in table:
            n = 1
            while rng.random() > 0.12 and n < 64:
                n += 1
            table[i, k] = n
        return table[i, k]

    waited = stream(lengths, slots, groups_per_step, bound, "wait")
    steps = run(waited, 40)
    trained = [p for step in steps for p, _ in step]
    assert waited.dropped_total == 0
    assert max(s for step in steps for _, s in step) <= bound
    # Each prompt trains once; the ones passed over are still in flight (nothing is lost).
    assert len(set(trained)) == len(trained) and len(set(range(max(trained))) - set(trained)) <= waited.limit
    dropped = stream(lengths, slots, groups_per_step, bound, "drop")
    run(dropped, 40)
    assert dropped.dropped_total > 0


def test_staleness_zero_trains_each_batch_whole_under_either_policy():
    """max_staleness 0: one generation batch at a time, trained whole, in prompt order, by both policies."""
    for policy in ("wait", "drop"):
        st = stream(long_first_member, slots=4, groups_per_step=2, bound=0, policy=policy)
        assert run(st, 3) == [[(0, 0), (1, 0)], [(2, 0), (3, 0)], [(4, 0), (5, 0)]] and st.dropped_total == 0
