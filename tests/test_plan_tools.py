"""`posttrain plan` with multi-turn tool use: the KV holds the prompt and every turn (tool output inside the
completion budget); generate re-prefills the conversation each turn, the engine only the tool output."""

import pytest

from posttrain.errors import ConfigError
from posttrain.planner import memory

CASE = dict(world_size=1, micro_batch=128, seq_len=768, response_len=512)


def test_multi_turn_kv_and_generate():
    plain = memory.plan("grpo", "1b", "zero2-zero3", **CASE)
    turns = memory.plan("grpo", "1b", "zero2-zero3", tool_tokens=192, **CASE)
    policy = next(r for r in turns.roles if r.name == "policy")
    assert policy.kv_cache == memory.kv_cache_bytes(policy.size, 128, 768)  # prompt + all turns, per sequence
    assert turns.phases["generate"] == plain.phases["generate"]  # the engine appends tool output in the slot
    hf = [memory.plan("grpo", "1b", "zero2-zero3", generation_backend="hf", tool_tokens=t, **CASE)
          for t in (0, 192)]
    assert hf[1].phases["generate"] > hf[0].phases["generate"]  # generate re-prefills the whole conversation


@pytest.mark.parametrize("kwargs,match", [
    (dict(workload="dpo", tool_tokens=8), "GRPO and RLOO"),
    (dict(workload="grpo", tool_tokens=512), "below --response-len"),
    (dict(workload="grpo", tool_tokens=8, shared_prompt_group=8), "shared-prompt-kv"),
])
def test_multi_turn_refusals(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        memory.plan(kwargs.pop("workload"), "1b", "zero2-zero3", **CASE, **kwargs)


def test_streaming_counts_its_held_outputs_and_keeps_the_slots_kv(capsys):
    """--async-generation: the KV is the slots' as without it; the outputs of (max_staleness + 1) generation
    batches of started sequences are counted with the rollout; a workload that cannot stream is refused."""
    from posttrain.cli import _plan_checked as plan_main

    plain = memory.plan("grpo", "1b", "zero2-zero3", **CASE)
    streamed = memory.plan("grpo", "1b", "zero2-zero3", streamed_rows=256, **CASE)
    p, s = (next(r for r in x.roles if r.name == "policy") for x in (plain, streamed))
    assert s.kv_cache == p.kv_cache and s.rollout - p.rollout == memory.streamed_bytes(256, 256, 512)
    plan_main(["--workload", "grpo", "--world-size", "1", "--micro-batch", "128", "--seq-len", "768",
               "--response-len", "512", "--mix", "zero2-zero3", "--master-weights", "fp32", "--async-generation",
               "--max-staleness", "1"])
    assert "up to 256 per process started and not yet trained (2 generation batches)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--async-generation plans grpo or rloo"):
        plan_main(["--workload", "ppo", "--async-generation"])
