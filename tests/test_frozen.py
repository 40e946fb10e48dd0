"""The fast frozen ZeRO-3 path (posttrain.placement.frozen) on two CPU processes, fp32."""

import pytest
from conftest import run_json, together_json

TOL = 1e-5


@pytest.fixture(scope="module")
def res(launched_together):
    return together_json(launched_together, "test_frozen")  # tests/dist/frozen_checks.py


def test_two_processes(res):
    assert res["world"] == 2


def test_logits_equal_stock_zero3_and_unsharded(res):
    d = res["diffs"]
    for i in (0, 1):  # the first forward gathers on demand, the second prefetches along its trace
        assert d[f"fast_vs_plain_{i}"] < TOL and d[f"fast_vs_stock_{i}"] < TOL
    assert res["prefetched"]


def test_reward_model_and_release(res):
    assert res["diffs"]["reward_vs_plain"] < TOL
    assert res["released"] and res["hooks_left"] == 0


def test_tied_embeddings(res):
    assert res["tied_is_tied"] and res["tied_head_uses_embedding"]
    # Stored once: one group fewer than units, and the full size counts the shared matrix once.
    assert res["tied_groups"] == res["units"] - 1 and res["tied_full"] == res["tied_plain_numel"]
    assert res["diffs"]["tied_vs_plain"] < TOL


def test_greedy_generate_equals(res):
    assert res["gen_equal"] and res["gen_tied_equal"]
    d = res["diffs"]
    assert max(d["gen_scores_fast_vs_plain"], d["gen_scores_fast_vs_stock"], d["gen_scores_tied_vs_plain"]) < TOL


def test_memory_at_rest_is_one_nth(res):
    assert res["fast_full"] == res["plain_numel"]
    # Each rank's flat slices: a half of the model, plus the padding that aligns each parameter to
    # 128 bytes (32 fp32 elements) and evens out the last slice.
    assert res["fast_full"] / 2 <= res["fast_local"] <= res["fast_full"] / 2 + 32 * res["params"] + res["groups"]
    assert res["tied_full"] / 2 <= res["tied_local"] <= res["tied_full"] / 2 + 32 * res["params"] + res["groups"]
    # No full parameter and no DeepSpeed partition is kept between forwards.
    assert res["rest_before"] and res["rest_after"] and res["rest_after_generate"] and res["rest_after_state_dict"]


def test_at_most_running_and_prefetched_units_live(res):
    # The running unit, plus gathers in flight ahead of it until about one layer's bytes: never
    # the whole model.
    assert 2 <= res["max_live_groups"] < res["groups"]
    assert res["max_live_bytes"] <= 2 * res["largest_unit_bytes"] + res["lookahead_bytes"]


def test_nothing_left_patched_process_wide(res):
    """The policy's generation and steps run the same code with ZeRO-3 models in the process: their
    loading (zero.Init), preparing and forwards leave no function, method or global hook changed."""
    assert res["process_state_changed"] == []


def test_policy_trains_beside_it(res):
    losses = res["policy_losses"]
    assert losses[-1] < losses[0] - 0.1
    assert res["diffs"]["fast_vs_plain_after_training"] < TOL


def test_state_dict_whole(res):
    assert res["state_dict_keys_equal"] and res["diffs"]["state_dict_vs_plain"] < TOL


def test_state_dict_at_rest_refused_with_the_fix(res):
    assert "Session.state_dict(role)" in res["rest_state_dict_error"]


def test_fast_frozen_refused_where_it_cannot_apply(res):
    assert res["bad_error"] and "it applies to frozen ZeRO-3 roles only" in res["bad_error"]


def test_rotary_frequencies_recomputed_after_zero_init(tmp_path):
    res = run_json("rotary_checks.py", tmp_path=tmp_path, nproc=1)
    assert res["before"] > 1e-4  # zero.Init in bf16 rounded them (the bug being fixed)
    assert res["fixed"] == 1 and res["after"] == 0.0 and res["original_after"] == 0.0
    assert res["dtype"] == "torch.float32"


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_copy_plan_rebuilds_every_parameter(world):
    """The copy-engine transport's plan (posttrain.placement.frozen._fetch_plan), checked without GPUs: for
    each rank, parameters inside its slice are read from the slice, every other one from a buffer
    filled by the planned pieces of the other slices; all come out exact, and a rank copies of its
    own slice only the parts of parameters straddling its edges (and padding between them)."""
    import random

    import torch

    from posttrain.placement.frozen import _fetch_plan

    rng = random.Random(world)
    align = 32
    for case in range(30):
        numels = [rng.choice([1, 7, 64, 1000, 4096, 11008]) for _ in range(rng.randint(1, 9))]
        offsets, end = [], 0
        for n in numels:
            offsets.append(end)
            end += -(-n // align) * align
        shard = -(-end // world)
        flat = torch.arange(shard * world, dtype=torch.float64)
        slices = [flat[r * shard: (r + 1) * shard] for r in range(world)]
        for rank in range(world):
            local, base, span, pieces = _fetch_plan(offsets, numels, shard, world, rank, align, whole=False)
            buf = torch.full((span,), -1.0, dtype=torch.float64)
            for r, a, b in pieces:
                assert r * shard <= a < b <= (r + 1) * shard
                buf[a - base: b - base] = slices[r][a - r * shard: b - r * shard]
            for o, n, here in zip(offsets, numels, local):
                got = slices[rank][o - rank * shard: o - rank * shard + n] if here else buf[o - base: o - base + n]
                assert torch.equal(got, flat[o: o + n]), (case, rank, o, n)
            own = sum(b - a for r, a, b in pieces if r == rank)
            straddling = sum(n for o, n, here in zip(offsets, numels, local)
                             if not here and o < (rank + 1) * shard and o + n > rank * shard)
            assert own <= straddling + align * len(pieces)  # plus alignment padding between merged pieces
            assert span <= shard * world and (world > 1 or span == 0)
            whole = _fetch_plan(offsets, numels, shard, world, rank, align, whole=True)
            assert whole[1:3] == (0, shard * world if world > 1 else 0) and whole[0] == local
