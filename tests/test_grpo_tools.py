"""Multi-turn tool use against TRL 1.16's own GRPOTrainer (fp32, CPU, in this process), with ``tools=`` and
with ``environment_factory=``: the same scripted turns on both sides (TRL's generation replaced by a table
of completions; posttrain's rollout by the same table behind the engine's turn callback), then equal tool
calls, completions handed to the reward functions, tool masks, advantages, metrics and loss within 1e-5."""

import asyncio
import copy

import pytest
import torch

from posttrain.demo import tiny
from posttrain.demo.tool_chat import with_tools
from posttrain.errors import ConfigError
from posttrain.rollout.turns import Turns

G, N = 4, 160
TOL = 1e-5


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a * b


def big() -> str:
    """A result too long for the completion budget."""
    return "word " * 200


def call(name, args, *more):
    """The tiny template's tool calls: ``<call>[name(key=value, ...), ...]</call>``."""
    pairs = [(name, args), *zip(more[::2], more[1::2])]
    return "<call>[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                                 for n, a in pairs) + "]</call>"


END = "<|endoftext|>"
# Per prompt, one script (turn texts) per generation: tool calls sync and async, two in one turn, an unknown
# tool, a tool that raises, a malformed call, more calls than max_tool_calling_iterations, a result past the
# budget, a turn cut by the budget.
TOOL_SCRIPTS = {
    "what is two plus three?": [
        ["sum" + call("add", {"a": 2, "b": 3}) + END, "five" + END],
        ["no tool here, " * 60],  # no EOS: cut at the budget
        [call("nope", {}) + END, "hm" + END],
        [call("add", {"a": 1}) + END, "x" + END],
    ],
    "multiply two by four": [
        [call("add", {"a": 1, "b": 1}, "mul", {"a": 2, "b": 4}) + END, "ok" + END],
        ["<call>[add(a=</call>" + END],
        [call("add", {"a": 1, "b": 2}) + END, call("add", {"a": 3, "b": 3}) + END, call("add", {"a": 0, "b": 0}) + END,
         "never" + END],
        [call("big", {}) + END],
    ],
}


class Scripts:
    """Turns by conversation: a prompt's first request starts its next script; a later request (the prompt,
    the turns so far and tool output) continues the script whose first turn it holds."""

    def __init__(self, tok, scripts, tools):
        self.tok, self.episodes, self.tools = tok, [], tools
        self.pending = {}
        for prompt, group in scripts.items():
            ids = tuple(self.prompt_ids(prompt))
            self.pending[ids] = [[tok(t, add_special_tokens=False)["input_ids"] for t in s] for s in group]

    def prompt_ids(self, prompt):
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tools=self.tools,
                                            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    def turn(self, ids):
        ids = list(ids)
        for ep in self.episodes:
            if ids[: len(ep["first"])] == ep["first"]:
                ep["k"] += 1
                turns = ep["turns"]
                return turns[ep["k"]] if ep["k"] < len(turns) else self.tok("done" + END)["input_ids"]
        turns = self.pending[tuple(ids)].pop(0)
        self.episodes.append({"first": ids + turns[0], "turns": turns, "k": 0})
        return list(turns[0])


def scripted_turns(scripts, pad):
    """posttrain's Rollout.generate_turns with the turns from ``scripts`` (the engine's turn-end protocol)."""

    def generate_turns(prompt_ids, prompt_mask, on_turn_end, sampling=None):
        turns = Turns(on_turn_end, N)
        tokens = torch.full((prompt_ids.shape[0], N), pad, dtype=torch.long)
        for i in range(prompt_ids.shape[0]):
            prompt, comp = prompt_ids[i][prompt_mask[i].bool()].tolist(), []
            while True:
                comp += scripts.turn(prompt + comp)[: N - len(comp)]
                new = turns.ask(i, comp)
                if new is None:
                    break
                comp += new
                if len(comp) >= N:
                    turns.lengths[i] = len(comp)
                    break
            tokens[i, : len(comp)] = torch.tensor(comp)
        return turns.output(tokens, torch.zeros(tokens.shape), pad)

    return generate_turns


class Seen:
    """A reward function recording what it is handed: one point per tool result, minus a tenth per word."""

    def __init__(self):
        self.calls = []
        self.__name__ = "seen"

    def __call__(self, prompts, completions, environments=None, **kwargs):
        self.calls.append((copy.deepcopy(prompts), copy.deepcopy(completions),
                           None if environments is None else [e._state() for e in environments]))
        return [sum(m["role"] == "tool" for m in c) - 0.1 * len(" ".join(str(m["content"]) for m in c).split())
                for c in completions]


class Counter:
    """An environment: a counter the model moves with its tools; the reward is where it ends."""

    def reset(self, start: int = 0, **kwargs) -> str:
        self.value = start
        return f" (start at {start})"

    def step(self, by: int) -> str:
        """Move the counter.

        Args:
            by: How far to move it.
        """
        if by > 5:
            raise ValueError("too far")
        self.value += by
        return f"now {self.value}"

    def get_reward(self) -> float:
        return float(self.value)

    def _state(self):
        return self.value


ENV_SCRIPTS = {
    "count (start at 1)": [
        [call("step", {"by": 2}) + END, call("step", {"by": 3}) + END, "there" + END],
        ["nothing" + END],
        [call("step", {"by": 9}) + END, "oops" + END],
        [call("add", {"a": 1, "b": 2}) + END, "three" + END],
    ],
    "count (start at 5)": [
        [call("step", {"by": 1}, "step", {"by": 1}) + END, "seven" + END],
        [call("step", {"by": 1}) + END],
        ["no" + END],
        [call("step", {"x": 1}) + END, "bad" + END],
    ],
}


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    """The tiny SFT policy with room for long conversations (rotary positions: only the limit changes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    model.config.max_position_embeddings = 512
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    with_tools(tiny.load_tokenizer()).save_pretrained(path)
    return str(path)


def run_both(tmp_path, policy_path, scripts, rows, rendered, **kw):
    """TRL's and posttrain's trainers on the same scripted turns: each one's outputs, metrics and loss."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    fields = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N, save_strategy="no",
                  report_to=[], max_tool_calling_iterations=2, temperature=1.0)
    tok = with_tools(tiny.load_tokenizer())
    reward = kw.pop("reward", Seen)
    theirs_reward, ours_reward = reward(), reward()
    args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **fields)
    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    trl = TRLTrainer(model=model, reward_funcs=[theirs_reward], args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=tok, **kw)
    trl.model.train()
    trl.current_gradient_accumulation_steps = 1
    script = Scripts(tok, scripts, rendered)
    trl._generate_single_turn = lambda prompt_ids, *a, **k: ([script.turn(p)[:N] for p in prompt_ids], None)
    out = trl._generate_and_score_completions([dict(r) for r in rows])
    trl_loss = trl._compute_loss(trl.model, out)
    trl_metrics = {k: v[-1] for k, v in trl._metrics["train"].items()}
    AcceleratorState._reset_state(reset_partial_state=True)

    # TRL runs without vLLM here, so without its sampler correction: compare with posttrain's off.
    cfg = GRPOConfig(output_dir=str(tmp_path / "ours"), vllm_importance_sampling_correction=False, **fields)
    ours = GRPOTrainer(policy_path, reward_funcs=[ours_reward], args=cfg, train_dataset=rows,
                       processing_class=with_tools(tiny.load_tokenizer()), **kw)
    ours.rollout.generate_turns = scripted_turns(Scripts(tok, scripts, rendered), tok.pad_token_id)
    batch, metrics = ours._sample_and_score(rows, ours.prompt_ids, G, train=True)
    loss, _ = ours.compute_loss(batch)
    # posttrain's default sampler correction reads the turns' log-probs, the tool output left out of its sums.
    ours.cfg.vllm_importance_sampling_correction = True
    ours.rollout.generate_turns = scripted_turns(Scripts(tok, scripts, rendered), tok.pad_token_id)
    seen = list(ours_reward.calls)
    fixed, _ = ours._sample_and_score(rows, ours.prompt_ids, G, train=True)
    ours_reward.calls[:] = seen
    _, stats = ours.compute_loss(fixed)  # the ratio formed from the loss forward's own log-probs
    with torch.no_grad():
        current, _ = ours.policy_logps(fixed)
    model_tokens = fixed["completion_mask"] * fixed["tool_mask"]
    diff = ((current - fixed["sampling_per_token_logps"]) * model_tokens).sum(1, keepdim=True)
    expected = torch.exp(diff).masked_fill(torch.exp(diff) > ours.cfg.vllm_importance_sampling_clip_max, 0.0)
    assert torch.allclose(stats["sampling"][1], expected.flatten(), atol=TOL)
    result = dict(trl=(out, trl_metrics, trl_loss, theirs_reward), ours=(batch, metrics, loss, ours_reward))
    ours.end()
    return result


def compare(result, tools=True):
    out, trl_metrics, trl_loss, theirs = result["trl"]
    batch, metrics, loss, ours = result["ours"]
    assert ours.calls == theirs.calls  # prompts, every message of every conversation, the environments' state
    n = out["completion_ids"].shape[1]
    mask = batch["completion_mask"][:, :n].bool()
    assert torch.equal(batch["completion_mask"][:, :n], out["completion_mask"]) and not batch["completion_mask"][:, n:].any()
    assert torch.equal(batch["completion_ids"][:, :n][mask], out["completion_ids"][mask])
    assert torch.equal(batch["tool_mask"][:, :n][mask], out["tool_mask"][mask])
    assert (batch["tool_mask"] == 0).any()
    assert torch.allclose(batch["advantages"], out["advantages"], atol=TOL)
    assert batch["num_items_in_batch"].item() == out["num_items_in_batch"].item()
    keys = ("tools/call_frequency", "tools/failure_frequency") if tools else ()
    for key in (*keys, "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "reward",
                "reward_std"):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=TOL), key
    assert abs(loss.item() - trl_loss.item()) < TOL
    return metrics


def test_tools_equal_trl(tmp_path, policy_path):
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in TOOL_SCRIPTS for _ in range(G)]
    tools = [add, mul, big]
    metrics = compare(run_both(tmp_path, policy_path, TOOL_SCRIPTS, rows, tools, tools=tools))
    # Calls run: add, nope, add(a=1), add+mul, add twice (the third is past max_tool_calling_iterations),
    # big (its result dropped: past the budget); failures: the unknown tool and the missing argument.
    assert metrics["completions/clipped_ratio"] > 0  # the turn cut by the budget
    assert metrics["tools/call_frequency"] == pytest.approx(8 / 8)
    assert metrics["tools/failure_frequency"] == pytest.approx(2 / 8)


def test_environment_factory_equals_trl(tmp_path, policy_path):
    rows = [{"prompt": [{"role": "user", "content": "count"}], "start": s} for s in (1, 5) for _ in range(G)]
    scripts = {p: s for p, s in ENV_SCRIPTS.items()}
    result = run_both(tmp_path, policy_path, scripts, rows, [add, Counter().step], tools=[add],
                      environment_factory=Counter)
    metrics = compare(result)
    assert "rewards/Counter/mean" in metrics and metrics["tools/failure_frequency"] > 0
    assert result["ours"][3].calls[0][2][0] == 6  # the environments, reset and stepped, reach the rewards


def test_bad_tools_refused(tmp_path, policy_path):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    def undocumented(x):
        return x

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: a number.
            """
            return x

    rows = [{"prompt": [{"role": "user", "content": "hi"}]}] * 4
    cfg = GRPOConfig(output_dir=str(tmp_path / "bad"), per_device_train_batch_size=4, num_generations=4,
                     report_to=[], save_strategy="no")
    cases = [
        (dict(tools=[undocumented], processing_class=with_tools(tiny.load_tokenizer())), "cannot be described"),
        (dict(environment_factory=NoReset, processing_class=with_tools(tiny.load_tokenizer())), "no reset method"),
        (dict(tools=[add], processing_class=tiny.load_tokenizer()), "does not render tool calls"),
        (dict(tools=[add], rollout_func=lambda p, t: {}, processing_class=with_tools(tiny.load_tokenizer())),
         "not both"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=match):
            GRPOTrainer(policy_path, reward_funcs=[Seen()], args=cfg, train_dataset=rows, **kwargs)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations"):
        GRPOConfig(output_dir=str(tmp_path / "bad2"), max_tool_calling_iterations=-1)


def test_rloo_takes_tools_and_masks_their_output(tmp_path, policy_path):
    """TRL 1.16's RLOOTrainer has no tools; posttrain's runs GRPO's tool loop: the tool output is out of the
    loss (its policy log-probs change nothing) and the tool metrics are logged."""
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    tok = with_tools(tiny.load_tokenizer())
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in TOOL_SCRIPTS for _ in range(G)]
    cfg = RLOOConfig(output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=2 * G, num_generations=G,
                     max_completion_length=N, save_strategy="no", report_to=[], max_tool_calling_iterations=2)
    ours = RLOOTrainer(policy_path, reward_funcs=[Seen()], args=cfg, train_dataset=rows,
                       processing_class=with_tools(tiny.load_tokenizer()), tools=[add, mul, big])
    ours.rollout.generate_turns = scripted_turns(Scripts(tok, TOOL_SCRIPTS, [add, mul, big]), tok.pad_token_id)
    batch, metrics = ours._sample_and_score(rows, ours.prompt_ids, G, train=True)
    assert metrics["tools/call_frequency"] == pytest.approx(1.0) and (batch["tool_mask"] == 0).any()
    loss, _ = ours.compute_loss(batch)
    moved = dict(batch, old_per_token_logps=batch["old_per_token_logps"] + 5.0 * (1 - batch["tool_mask"]))
    assert ours.compute_loss(moved)[0].item() == pytest.approx(loss.item(), abs=TOL)
    ours.end()


def test_cli_tool_arguments(tmp_path):
    """`posttrain grpo --tools module:fn --environment_factory module:Class`: parsed beside TRL's script
    arguments (the tool task's demo settings when no model is named), imported, or one sentence."""
    from trl import ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    from posttrain.demo import tool_task
    from posttrain.scripts.args import demo_config, parse_config
    from posttrain.scripts.grpo import OnlinePromptArguments, ToolArguments, _wants_tools, tool_objects
    from posttrain.trainers.grpo import GRPOConfig

    argv = ["--tools", "posttrain.demo.tool_task:add", "--environment_factory", "test_grpo_tools:Counter",
            "--output_dir", str(tmp_path / "out")]
    assert _wants_tools(argv) and not _wants_tools(["--max_steps", "1"])
    *_, cfg, _, tools = parse_config((GRPOScriptArguments, OnlinePromptArguments, GRPOConfig, ModelConfig,
                                      ToolArguments), demo_config("grpo_tools"), argv)
    assert cfg.max_tool_calling_iterations == 1 and cfg.max_completion_length == 80
    assert tool_objects(tools) == ([tool_task.add], Counter)
    with pytest.raises(ConfigError, match="--tools 'posttrain.demo.tool_task:nope'"):
        tool_objects(ToolArguments(tools=["posttrain.demo.tool_task:nope"]))
    with pytest.raises(ConfigError, match="--environment_factory 'nowhere:Env'"):
        tool_objects(ToolArguments(environment_factory="nowhere:Env"))


def test_shipped_warm_start_is_what_its_recipe_trains(tmp_path):
    """The tool task's shipped policy: the warm start's recipe replays its recorded first losses, and the
    shipped weights have that run's final loss (as tests/test_tiny.py checks the tiny default's)."""
    import json

    from transformers import AutoModelForCausalLM

    from posttrain.demo import recipes, tool_task

    shipped = tool_task.policy_path()
    assert shipped == tiny.ASSETS / f"tools-sft-s0-n{tool_task.WARM_STEPS}"
    recorded = json.loads((shipped / "train_losses.json").read_text())
    trainer = tool_task.warm_start_trainer(tmp_path)
    assert len(recorded["losses"]) == trainer.total_steps
    assert recipes.replay(trainer, 3) == pytest.approx(recorded["losses"][:3], rel=1e-5)
    final = recipes.final_loss(AutoModelForCausalLM.from_pretrained(shipped), trainer)
    assert final == pytest.approx(recorded["final_first_batch"], rel=1e-5)
    assert recorded["final_first_batch"] < 0.1 * recorded["losses"][0]
    trainer.end()


class Tagged:
    """A reward reading a rollout_func's extra field: the tag plus a tenth of the completion's length."""

    def __init__(self):
        self.calls, self.__name__ = [], "tagged"

    def __call__(self, prompts, completions, completion_ids, tag, **kwargs):
        self.calls.append((list(prompts), list(completions), list(tag)))
        return [t + 0.1 * len(ids) for t, ids in zip(tag, completion_ids)]


def test_rollout_func_equals_trl(tmp_path, policy_path):
    """rollout_func: TRL's keys (env_mask as the tool mask, extra fields to the rewards), the same numbers."""
    tok = tiny.load_tokenizer()
    eos = tok.eos_token_id

    def rollout(prompts, trainer):
        ids = [tok(p)["input_ids"] for p in prompts]
        completions = [[30 + i, 40, 50 + i, 60][: 2 + i % 3] + [eos] * (i % 2) for i in range(len(prompts))]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions],
                "env_mask": [[1, 0] + [1] * (len(c) - 2) for c in completions],
                "tag": [float(i % 3) for i in range(len(prompts))]}

    rows = [{"prompt": p} for p in ("the cat is", "my old friend felt") for _ in range(G)]
    result = run_both(tmp_path, policy_path, {}, rows, [], rollout_func=rollout, reward=Tagged)
    compare(result, tools=False)
