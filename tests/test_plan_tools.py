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
