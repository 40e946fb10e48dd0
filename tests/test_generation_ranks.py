"""Separate generation ranks (posttrain.placement.generation_ranks, weight_sync, group_channel, and GRPO over them:
trainers/generation_ranks.py): one 3-process launch over gloo (ranks 0 and 1 train, rank 2 generates) runs
tests/dist/generation_ranks_checks.py, then tests/dist/generation_ranks_grpo.py; the rest is in-process (layout and
config refusals, the pipeline's schedule, bucket plans, the channel's routing and packing)."""

import pytest
import torch
from conftest import run_json

from posttrain.errors import ConfigError
from posttrain.placement.generation_ranks import RankLayout, check_layout
from posttrain.placement.group_channel import RolloutGroup, consumer, pack, producer, unpack
from posttrain.placement.weight_sync import Entry, bucket_nbytes, plan_buckets
from posttrain.trainers.generation_ranks import Pipeline

BUCKET = 32 << 10  # tests/dist/generation_ranks_checks.py's
TRAINED = ("z2", "z3", "lora")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("genranks")
    every = run_json("generation_ranks_checks.py", str(tmp), tmp_path=tmp, nproc=3, timeout=400)
    assert [r["generates"] for r in every] == [False, False, True]
    return {r["rank"]: r for r in every}


def test_engines_span_the_training_ranks(ranks):
    for rank in (0, 1):
        r = ranks[rank]
        for name in TRAINED:
            assert r[name]["dp_world"] == 2 and r[name]["deepspeed_world"] == 2 and r[name]["stepped"]
        assert r["z3"]["sharded"] and r["z3"]["shard_fraction"] == pytest.approx(0.5, abs=0.01)
        assert not r["z2"]["sharded"]
        # The frozen ZeRO-3 reference: partitioned over the training ranks, its logits those of the whole model.
        assert r["ref"] == {"group_size": 2, "diff": 0.0, "fast": True}


@pytest.mark.parametrize("name", TRAINED)
def test_sync_equals_the_trained_policy(ranks, name):
    """After the first sync and after an SGD step, the generation copy equals the trained weights exactly; the step
    moved them; the copy's parameters kept their storage (copied in place); each sync carried its version."""
    gen = ranks[2][name]
    # z2's training ranks ended the syncs after version 1: the receiver got the end marker, moving nothing.
    assert gen["versions"] == ([0, 1, -1] if name == "z2" else [0, 1]) and gen["ended"] == (name == "z2")
    assert gen["diff_v0"] == 0.0 and gen["diff_v1"] == 0.0
    assert gen["moved"] > 1e-3
    assert gen["in_place"] and gen["plain"] and gen["dtype"] == "torch.float32"
    assert gen["messages"] == [ranks[0][name]["messages"][1]]  # what training rank 0 broadcast, bucket by bucket


@pytest.mark.parametrize("name", ("z2", "z3"))
def test_buckets_are_bounded(ranks, name):
    sent = ranks[0][name]
    for sync in sent["messages"]:
        assert sum(n for _, n in sync) == sent["params"] == sent["trained"]  # full fine-tuning: every parameter
        for nbytes, params in sync:
            assert nbytes <= BUCKET or params == 1  # a parameter larger than the bucket goes alone
        assert max(b for b, _ in sync) == sent["largest_param"] > BUCKET
        assert any(params > 1 for _, params in sync)
    # Training rank 1 sends nothing; under ZeRO-3 both training ranks gather one bucket at a time, no more.
    assert ranks[1][name]["messages"] == [[], []]
    if name == "z3":
        per_bucket = [b for sync in sent["messages"] for b, _ in sync]
        for rank in (0, 1):
            held = ranks[rank]["z3"]["gathered_per_bucket"]
            assert len(held) == len(per_bucket) and all(h <= b for h, b in zip(held, per_bucket))


def test_lora_sends_the_adapters_only(ranks):
    sent, gen = ranks[0]["lora"], ranks[2]["lora"]
    assert sent["trained"] == 8 < sent["params"]  # lora_A and lora_B of q_proj and v_proj in 2 layers
    assert [sum(n for _, n in sync) for sync in sent["messages"]] == [8, 8]
    assert gen["base_equal"] and gen["diff_v0"] == 0.0  # the adapters, unlike the trained ones before, now equal


def test_groups_reach_their_training_rank(ranks):
    # Completed out of order on the generation rank, held until the ones before them left.
    assert ranks[2]["channel"] == {"left": [[], [0], [], [1], [], [2, 3], [], [4, 5, 6, 7]], "held_after": 0}
    for rank in (0, 1):
        got = ranks[rank]["channel"]
        assert got["indices"] == [rank, rank + 2, rank + 4, rank + 6]
        assert all(got["equal"]) and got["versions"] == [i // 3 for i in got["indices"]]


def test_reductions_cover_the_training_ranks_only(ranks):
    for rank in (0, 1):
        r = ranks[rank]["reductions"]
        assert r["num_processes"] == 2 and r["sum"] == 3.0 and r["mean"] == 1.5
        assert r["gather"] == [1.0, 2.0] and r["objects"] == [0, 1]
        assert r["padded"] == ([1.0, 0.0] if rank == 0 else [1.0, 1.0])
        # DeepSpeed's checkpoint barriers ran over the training ranks; the state came back.
        assert ranks[rank]["checkpoint"] == {"extra": {"step": 1}, "restored": True}


def test_generation_rank_refuses_training_work(ranks):
    refused = ranks[2]["refused"]
    assert refused["prepare"].startswith("ConfigError: role 'z2': this rank only generates")
    assert refused["frozen"].startswith("ConfigError: role 'ref' is frozen")
    assert refused["reduce"].startswith("RuntimeError: a reduction over the training ranks")


# -- GRPO over the layout (tests/dist/generation_ranks_grpo.py) ------------------------------------------------
GRPO_COMPARED = ["loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "completions/mean_length", "num_tokens",
                 "sample/staleness_mean", "sample/staleness_max", "learning_rate", "epoch"]


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # each rank times its own


def grpo_rows(ranks: dict, run: str) -> list[dict]:
    rows = untimed(ranks[0]["grpo"][run]["rows"])
    assert untimed(ranks[1]["grpo"][run]["rows"]) == rows and ranks[2]["grpo"][run]["rows"] == []  # none logged there
    return rows


def close(a: dict, b: dict, tol: float) -> None:
    assert a["step"] == b["step"] and a.keys() == b.keys()
    for k in GRPO_COMPARED + [k for k in a if k.startswith("eval/")]:
        if k in a:
            assert b[k] == pytest.approx(a[k], abs=tol, rel=tol), (a["step"], k, a[k], b[k])


def test_grpo_is_placement_invariant(ranks):
    """One generating rank, two training ranks: the same rows (samples, rewards, losses, staleness, evaluation on the
    training ranks) with the policy ZeRO-2 or ZeRO-3."""
    base, other = grpo_rows(ranks, "zero2-zero3"), grpo_rows(ranks, "zero3")
    assert [r["step"] for r in base] == [1, 2, 3, 4, 4] and "eval/reward" in base[-1]
    for a, b in zip(base, other):
        close(a, b, 1e-4)


def test_grpo_resumes_exactly(ranks):
    """Resumed from checkpoint-2 (the generation rank drained before it; the training ranks saved the produced,
    untrained groups): steps 3-4 and the evaluation are the uninterrupted run's, exactly."""
    base, resumed = grpo_rows(ranks, "zero2-zero3"), grpo_rows(ranks, "resumed")
    assert ranks[0]["grpo"]["saved"] == ["streaming_rank0.pt", "streaming_rank1.pt"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 4]
    assert resumed[2:] == base[2:]


def test_grpo_staleness_is_bounded_and_rollouts_partial(ranks):
    """max_staleness 1: the first batch starts under the initial weights, every later one one update behind the step
    that trains it; none is dropped. With 6 slots for 16 sequences a batch, versions load while sequences decode."""
    for run in ("zero2-zero3", "zero3"):
        rows = [r for r in grpo_rows(ranks, run) if "loss" in r]
        assert [r["sample/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
        gen = ranks[2]["grpo"][run]["metrics"]
        assert gen["generation/groups"] == 16 and gen["generation/versions"] == 5  # versions 0-4
        assert gen["generation/loads_while_decoding"] > 0


def test_grpo_generation_copy_ends_as_the_trained_policy(ranks):
    """After training, the generation rank's copy holds the final trained weights exactly (the last sync); with LoRA
    its adapters and base too."""
    assert all(ranks[0]["grpo"][run]["copy_equal"] for run in ("zero2-zero3", "zero3", "resumed", "lora", "rloo"))
    for run in ("lora", "rloo"):  # LoRA GRPO, and RLOO (GRPO's loop and generation, its own objective)
        rows = [r for r in grpo_rows(ranks, run) if "loss" in r]
        assert len(rows) == 4 and [r["sample/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0], run


# -- in-process ------------------------------------------------------------------------------------------------
def test_layout_refusals():
    assert check_layout(0, 4) is None
    layout = check_layout(1, 3, "posttrain")
    assert layout.training_ranks == [0, 1] and layout.generation_ranks == [2] and layout.generates(2)
    with pytest.raises(ConfigError, match="leaves no training rank in a launch of 2"):
        check_layout(2, 2)
    with pytest.raises(ConfigError, match="needs generation_backend posttrain"):
        check_layout(1, 3, "hf")
    with pytest.raises(ConfigError, match="whole number >= 0"):
        check_layout(-1, 3)


def test_session_refuses_before_loading():
    from posttrain import Role, Session

    with pytest.raises(ConfigError, match="leaves no training rank in a launch of 1"):
        Session([Role("policy", "zero2_train", trains=True)], generation_processes=1)


def test_session_refuses_zero3_on_one_training_rank(monkeypatch):
    """Two processes, one generating: a role's own ZeRO-3 config cannot shard over one rank (refused before the
    process group or any model); a mix's frozen ZeRO-3 is simplified as on one process."""
    from posttrain import Role, Session

    monkeypatch.setenv("WORLD_SIZE", "2")
    roles = [Role("policy", "zero2_train", trains=True), Role("reward", "zero3_inference")]
    with pytest.raises(ConfigError, match="'reward' have a ZeRO-3 config but only one rank trains"):
        Session(roles, generation_processes=1)


def test_deepspeed_world_redirects_groupless_calls():
    """The training ranks as DeepSpeed's world: a call without a group (by keyword, by position, by default, or on
    torch's default group) gets the training group, through a decorator that hides the signature as DeepSpeed's
    stage_on_cpu does; a call naming a group keeps it."""
    import torch.distributed as dist

    from posttrain.placement.generation_ranks import _TrainingWorld

    def hiding(func):
        def wrapper(self, *args, **kwargs):  # no functools.wraps
            return func(self, *args, **kwargs)
        return wrapper

    class Backend:
        @hiding
        def broadcast(self, tensor, src, group=None, async_op=False):
            return group

        @hiding
        def all_reduce(self, tensor, op=0, group=None, async_op=False):
            return group

        @hiding
        def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
            return group

        @hiding
        def reduce_scatter_tensor(self, output_tensor, input_tensor, op=0, group=None, async_op=False):
            return group

        def barrier(self, group=dist.GroupMember.WORLD, async_op=False, device_ids=None):
            return group

        def destroy_process_group(self, group=None):
            return group

        name = "fake"

    train, other = object(), object()
    world = _TrainingWorld(Backend(), train)
    assert world.broadcast(None, 0) is train and world.broadcast(tensor=None, src=0, group=None) is train
    assert world.broadcast(None, 0, other) is other and world.broadcast(None, 0, group=other) is other
    assert world.all_reduce(None, 0, None) is train and world.all_reduce(None, 0, other) is other
    assert world.barrier() is train and world.barrier(group=dist.GroupMember.WORLD) is train
    assert world.destroy_process_group() is None  # tearing down keeps its meaning
    assert world.get_world_group() is train and world.name == "fake"


def test_bucket_plan():
    f32, bf16 = torch.float32, torch.bfloat16
    entries = [Entry("a", (3,), f32, True), Entry("b", (100,), f32, True), Entry("c", (5,), bf16, True),
               Entry("d", (1000,), f32, True), Entry("e", (2,), f32, True)]
    plan = plan_buckets(entries, 512)
    assert [[e.name for e, _ in b] for b in plan] == [["a", "b", "c"], ["d"], ["e"]]
    assert [off for _, off in plan[0]] == [0, 16, 416]  # 16-byte aligned starts
    assert bucket_nbytes(plan[0]) == 426 and bucket_nbytes(plan[1]) == 4000


def test_channel_routing_and_packing():
    layout = RankLayout(world_size=5, generation_processes=2)  # training ranks 0-2, generation ranks 3-4
    assert [consumer(layout, i) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [producer(layout, i) for i in range(6)] == [3, 4, 3, 4, 3, 4]
    g = RolloutGroup(7, 2, torch.arange(6).view(2, 3), torch.arange(10).view(2, 5), torch.ones(2, 5, dtype=torch.bool),
                     torch.randn(2, 5), extras={"token_versions": torch.full((2, 5), 2, dtype=torch.int32)})
    back = unpack(*pack(g, torch.device("cpu")))
    assert (back.index, back.version) == (7, 2)
    for key, value in g.tensors().items():
        assert back.tensors()[key].dtype == value.dtype and torch.equal(back.tensors()[key], value)


def test_pipeline_schedule():
    """Which versions move and which each generation batch starts under: max_staleness 1, weight_sync_steps 2, 7 steps,
    a checkpoint after step 3 (and the last)."""
    plan = Pipeline(max_staleness=1, weight_sync_steps=2, total_steps=7, saves=lambda step: step in (3, 7))
    assert [s for s in range(8) if plan.sends(s)] == [0, 2, 3, 4, 6, 7]
    required = [plan.required(c) for c in range(7)]
    assert required == [0, 0, 2, 2, 3, 4, 6]
    assert all(c - 1 <= v <= c for c, v in enumerate(required[1:], 1))  # at most one update stale, trained in time
    assert [c for c in range(7) if plan.drains_before(c)] == [4]  # the first batch under checkpoint-3's weights
    assert plan.first_cycle(0) == 0 and plan.first_cycle(3) == 4 and plan.first_cycle(7) == 7


@pytest.mark.parametrize("world,extra,needs", [
    (3, dict(async_generation=False), "generation_processes 1 needs async_generation true"),
    (3, dict(generation_backend="hf"), "needs generation_backend posttrain"),
    (1, {}, "leaves no training rank in a launch of 1"),
    (3, dict(weight_sync_steps=3, max_staleness=1), "set weight_sync_steps at most 2"),
    (3, dict(max_inflight_tasks=64), "set max_inflight_tasks -1"),
    (3, dict(stale_groups="drop"), "no group is ever late or dropped: set stale_groups wait"),
])
def test_grpo_refuses_layouts_that_cannot_run(tmp_path, monkeypatch, world, extra, needs):
    from posttrain.trainers.grpo import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", str(world))
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=2,
                  async_generation=True, generation_processes=1)
    with pytest.raises(ConfigError, match=needs):
        GRPOConfig(**{**fields, **extra})


def test_plan_counts_generation_ranks(capsys):
    """posttrain plan --generation-processes 1 of 4: the mixes are planned on the 3 training ranks; a generation rank
    holds the policy's bf16 copy (2 bytes a parameter) and the engine over its share (3 x 8 sequences)."""
    from posttrain.cli import main
    from posttrain.planner.shapes import model_size

    argv = ["plan", "--workload", "grpo", "--shape", "1b", "--world-size", "4", "--mix", "zero2-zero3",
            "--master-weights", "bf16", "--micro-batch", "8", "--async-generation", "--max-staleness", "1"]
    assert main([*argv, "--generation-processes", "1"]) == 0
    out = capsys.readouterr().out
    copy = 2 * model_size("1b").params / 2**30
    assert "1 of 4 GPUs generate, 3 train" in out and f"bf16 copy {copy:.2f} GiB" in out
    assert "for 24 sequences" in out and "outputs of 48 started sequences" in out
    assert "mix zero2-zero3 · 3 GPUs" in out
    assert main([*argv, "--generation-processes", "4"]) == 2
    assert "1 to --world-size minus 1 (3); got 4" in capsys.readouterr().err
