"""Reward functions and reward models in TRL 1.16's full convention, against TRL's own
GRPOTrainer on identical completions (in this process, CPU, fp32): spellings (TRL's built-in
names, module.function, module:function, the current directory importable, no hub look-up for
either), the keyword arguments TRL passes (trainer_state, log_extra, log_metric, columns), async
functions, what reward functions and reward models receive under mask_truncated_completions,
reward models re-encoding text, and the warnings about rewards that score nothing."""

import asyncio
import logging
import math
import re
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from test_grpo_parity import TEMPERATURE, G, N, fixed_rollout

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rewards import functions as reward_funcs
from posttrain.rewards import models as rewards
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.run_log import Phases

SEEN: dict[str, list[dict]] = {"sync": [], "async": []}


def ids_reward(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
    """Reads the ids (so the rows that mask_truncated_completions masks matter) and uses TRL's loggers."""
    SEEN["sync"].append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                         "trainer_state": type(trainer_state).__name__, "columns": columns})
    log_metric("ids/total", float(sum(len(c) for c in completion_ids)))
    log_extra("n_ids", [len(c) for c in completion_ids])
    return [float(sum(ids) % 11) - 5.0 for ids in completion_ids]


async def async_len_reward(completions, completion_ids, answer, **_):
    SEEN["async"].append({"answer": answer})
    await asyncio.sleep(0)
    return [float(len(c)) if a == "long" else -float(len(c)) for c, a in zip(completion_ids, answer)]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's GRPOTrainer with a sync and an async reward function and the tiny reward model (whose
    tokenizer is the policy's); its generation replaced by the fixed completions (some truncated)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    tok = tiny.load_tokenizer()
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl_rf")), use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     temperature=TEMPERATURE, save_strategy="no", reward_weights=[1.0, 0.5, 2.0])
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    trainer = TRLTrainer(model=model, reward_funcs=[ids_reward, async_len_reward, str(tiny.reward_model_path())],
                         args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
    trainer.model.train()
    rows, prompt_ids, completion_ids = fixed_rollout(tok)
    for i, r in enumerate(rows):
        r["answer"] = "long" if i % 3 else "short"
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completion_ids], None)
    captured = {}
    calc = trainer._calculate_rewards

    def spy(*a, **k):
        captured["per_func"] = calc(*a, **k)
        return captured["per_func"]

    trainer._calculate_rewards = spy
    return trainer, rows, prompt_ids, completion_ids, captured


def ours_stub(cfg, rows, prompt_ids, completion_ids, tok):
    """posttrain's GRPOTrainer around generate_and_score on one process without a session: the
    rollout returns the fixed completions; the reward model is a plain module (its engine)."""
    from transformers import AutoModelForSequenceClassification, TrainerState

    from posttrain.rewards.scoring import Rewards

    t = GRPOTrainer.__new__(GRPOTrainer)
    path = str(tiny.reward_model_path())
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
    t.cfg, t.tokenizer, t.eos_ids, t.rows, t.step, t.num_tokens = cfg, tok, [tok.eos_token_id], rows, 0, 0.0
    t.session = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1, is_main_process=True,
                                engines={"reward": rm}, activate=lambda role: nullcontext(),
                                load=lambda role, source, **_: rm, prepare=lambda role, model: model)
    t.prompt_ids = prompt_ids
    t._generation_rows = lambda cycle: list(range(len(rows)))
    width = max(len(c) for c in completion_ids)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    t.rollout = SimpleNamespace(generate=lambda p, m: SimpleNamespace(completion_ids=ids, completion_mask=mask))
    t.phases = Phases()
    t.rewards = Rewards([ids_reward, async_len_reward, path], [1.0, 0.5, 2.0], batch_size=cfg.per_device_train_batch_size)
    t.rewards.plan(rm.config, tok)
    t.rewards.load(t.session)
    assert t.rewards.names == ["ids_reward", "async_len_reward", "reward-trained-s0-n200"]
    t.prompts_per_generation = len(rows) // cfg.num_generations
    t.trainer_state = TrainerState()
    captured = {}
    score = t.rewards.score

    def spy(*a, **k):
        captured["per_func"] = score(*a, **k)
        return captured["per_func"]

    t.rewards.score = spy
    return t, captured


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_rewards_and_metrics_equal_trl(trl_trainer, mask_truncated):
    """The same rewards from every source (reward functions get every generated id, also of the
    truncated rows that the loss masks out; the reward model reads the decoded text re-encoded,
    never the masked attention), and the same generation metrics, as TRL's trainer."""
    trainer, rows, prompt_ids, completion_ids, theirs = trl_trainer
    tok = trainer.processing_class
    trainer.mask_truncated_completions = mask_truncated
    trainer._metrics["train"].clear()
    trainer.state.num_input_tokens_seen = 0
    SEEN["sync"].clear(), SEEN["async"].clear()
    out = trainer._generate_and_score_completions([dict(r) for r in rows])
    their_seen = dict(SEEN["sync"][-1]), dict(SEEN["async"][-1])
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    cfg = GRPOConfig(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N,
                     temperature=TEMPERATURE, reward_weights=[1.0, 0.5, 2.0], mask_truncated_completions=mask_truncated)
    t, ours = ours_stub(cfg, [dict(r) for r in rows], [prompt_ids[i] for i in range(len(rows))], completion_ids, tok)
    SEEN["sync"].clear(), SEEN["async"].clear()
    micro, metrics = t.generate_and_score(0)
    our_seen = SEEN["sync"][-1], SEEN["async"][-1]

    assert torch.allclose(ours["per_func"], theirs["per_func"], atol=1e-5, equal_nan=True), \
        (ours["per_func"], theirs["per_func"])
    # Truncated rows keep their ids for the rewards (TRL); only the loss mask drops them.
    assert our_seen[0]["completion_ids"] == their_seen[0]["completion_ids"] == completion_ids
    assert our_seen[0]["completions"] == their_seen[0]["completions"]
    assert our_seen[0]["prompts"] == their_seen[0]["prompts"]
    assert our_seen[0]["trainer_state"] == their_seen[0]["trainer_state"] == "TrainerState"
    assert our_seen[0]["columns"] == their_seen[0]["columns"] == {"answer": [r["answer"] for r in rows]}
    assert our_seen[1] == their_seen[1]
    masked = torch.cat([m["completion_mask"] for m in micro]).sum(1).sort().values
    assert torch.equal(masked, out["completion_mask"].sum(1).sort().values)
    keys = [k for k in their_metrics if k.startswith(("rewards/", "completions/", "ids/"))] + [
        "reward", "reward_std", "frac_reward_zero_std", "num_tokens"]
    assert "ids/total" in keys and "rewards/reward-trained-s0-n200/mean" in keys
    for k in keys:
        assert metrics[k] == pytest.approx(their_metrics[k], abs=1e-5), k
    assert t.samples[3] == {"n_ids": [len(c) for c in completion_ids]}  # log_extra's column


def test_trl_spellings_resolve_without_the_hub(tmp_path, monkeypatch):
    """TRL's built-in names, module.function and module:function from the current directory, and
    a typo'd local reward-model path: none of them looks anything up on the hub."""
    import trl.rewards
    from transformers import PretrainedConfig

    def no_hub(*a, **k):
        raise AssertionError(f"hub look-up for {a}")

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", no_hub)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [-len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    for spec in ("my_rewards.brevity", "my_rewards:brevity"):
        (got,) = rewards.resolve_reward_specs([spec])
        assert not got.is_model and got.func(completions=["ab", "c"]) == [-2, -1]
    (fmt,) = rewards.resolve_reward_specs(["think_format_reward"])
    assert fmt.func is trl.rewards.think_format_reward
    (over,) = rewards.resolve_reward_specs(["get_soft_overlong_punishment"])  # TRL's script: 1280 / 256
    want = trl.rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    ids = [[0] * 1000, [0] * 1200]
    assert over.func(completion_ids=ids) == want(completion_ids=ids)
    if not reward_funcs._trl_reward("accuracy_reward").__globals__.get("verify"):
        with pytest.raises(ConfigError, match="needs the math_verify package: pip install math-verify"):
            rewards.resolve_reward_specs(["accuracy_reward"])
    (tmp_path / "runs").mkdir()
    for typo in ("./rm-typo", "runs/rm-typo", "/nonexistent/rm"):
        with pytest.raises(ConfigError, match="no such folder"):
            rewards.resolve_reward_specs([typo])
    assert reward_funcs.spec_kind("org/reward-model") == "model"  # a hub id: looked up when resolved
    assert reward_funcs.spec_kind(str(tiny.reward_model_path())) == "model"


def test_reward_model_never_scores_the_policy_ids_in_grpo():
    """GRPO/RLOO always re-encode (TRL's GRPOTrainer); PPO keeps TRL 1.12's PPOTrainer: a reward
    model with the policy's tokenizer scores the policy's token ids."""
    tok = tiny.load_tokenizer()
    path = str(tiny.reward_model_path())
    assert rewards.reward_model_input(path, tok).shares_policy_ids  # PPO's default
    grpo = rewards.reward_model_input(path, tok, reencode=True)
    assert not grpo.shares_policy_ids and grpo.tokenizer.get_vocab() == tok.get_vocab()


def test_warnings_once_per_run_per_function(caplog):
    names = ["a", "b"]
    w = reward_funcs.RewardWarnings(names)
    nan, inf = math.nan, math.inf
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.functions"):
        for _ in range(3):
            w.check(torch.tensor([[nan, 1.0], [nan, inf], [nan, nan], [nan, 2.0]]))
            w.check(torch.tensor([[nan, nan], [nan, nan]]))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 5, said  # three batches of each: every warning once
    assert said[0] == ("reward 'a' returned None (or NaN) for every completion of a generation batch (4 completions): "
                       "it adds nothing to their rewards")
    assert said[1].startswith("reward 'b' returned an infinite reward")
    assert said[2].startswith("1 of 4 completions got None from every reward")
    assert said[3].startswith("reward 'b' returned None (or NaN) for every completion")
    assert said[4].startswith("every reward returned None (or NaN) for every completion")
    # Rank 1 says nothing.
    caplog.clear()
    quiet = reward_funcs.RewardWarnings(names, main_process=False)
    quiet.check(torch.tensor([[nan, nan]]))
    assert not caplog.records


def test_async_functions_run_together_on_one_loop():
    """TRL runs async reward functions concurrently (asyncio.gather) on one event loop per trainer."""
    loops, order = [], []

    async def slow(completions, **_):
        loops.append(asyncio.get_running_loop())
        order.append("slow start")
        await asyncio.sleep(0.05)
        order.append("slow end")
        return [1.0] * len(completions)

    async def fast(completions, **_):
        loops.append(asyncio.get_running_loop())
        order.append("fast")
        return [2.0] * len(completions)

    for _ in range(2):
        out = reward_funcs.call_reward_funcs([slow, fast], ["p", "q"], ["a", "b"], [[1], [2]])
        assert out.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert order[:3] == ["slow start", "fast", "slow end"]  # fast ran while slow awaited
    assert len({id(loop) for loop in loops}) == 1


def test_rloo_rewards_equal_trl(trl_trainer, tmp_path):
    """TRL's RLOOTrainer computes rewards as its GRPOTrainer does (its own _calculate_rewards);
    posttrain's RLOO shares GRPO's scoring: the same rewards from the same completions."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig as TRLConfig
    from trl import RLOOTrainer as TRLTrainer

    _, rows, prompt_ids, completion_ids, _ = trl_trainer
    tok = tiny.load_tokenizer()
    args = TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=2 * G,
                     num_generations=G, max_completion_length=N, save_strategy="no", beta=0.0)
    trainer = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tiny.sft_model_path()), args=args,
                         reward_funcs=[ids_reward, async_len_reward, str(tiny.reward_model_path())],
                         train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
    prompts = [r["prompt"] for r in rows]
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    theirs = trainer._calculate_rewards([dict(r) for r in rows], prompts, texts, completion_ids)
    cfg = GRPOConfig(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=N)
    t, _ = ours_stub(cfg, [dict(r) for r in rows], prompt_ids, completion_ids, tok)
    ours = t.rewards.score(prompts, texts, completion_ids, rows=[dict(r) for r in rows], trainer_state=t.trainer_state)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


def test_a_language_model_is_refused_as_a_reward_model(tmp_path):
    """A plain causal LM given as a reward model (its folder or the object) is one sentence: loaded as a
    classifier its score head would be random, so GRPO would train on noise (TRL takes it without a word)."""
    from transformers import AutoModelForCausalLM

    from posttrain.scripts.data import bundled_prompts

    path = str(tiny.sft_model_path())
    said = "is a language model (LlamaForCausalLM) without a trained score head"
    with pytest.raises(ConfigError, match=rf"^reward model {path} {re.escape(said)}"):
        rewards.resolve_reward_specs([path])
    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4)
    lm = AutoModelForCausalLM.from_pretrained(path, num_labels=1)  # one label, still no score head
    for reward, what in ((path, f"reward model {path}"), (lm, "the reward model object")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(what)} {re.escape(said)}"):
            GRPOTrainer(path, reward_funcs=reward, args=cfg, train_dataset=bundled_prompts(16))
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_reward_funcs_as_trl_takes_them(tmp_path):
    """One reward or a list; a function, TRL's built-in name, a dotted ``module.function`` name, the reward
    model's path: each names its reward in the metrics, in the order given."""
    from posttrain.demo import synthetic
    from posttrain.scripts.data import bundled_prompts

    cfg = GRPOConfig(output_dir=str(tmp_path / "a"), per_device_train_batch_size=8, num_generations=4)
    one = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs=synthetic.sentiment_reward, args=cfg,
                      train_dataset=bundled_prompts(16))
    assert one.rewards.names == ["sentiment_reward"] and one.rewards.roles == []
    one.end()
    cfg = GRPOConfig(output_dir=str(tmp_path / "b"), per_device_train_batch_size=8, num_generations=4)
    many = GRPOTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=bundled_prompts(16),
                       reward_funcs=["posttrain.demo.synthetic.sentiment_reward", "think_format_reward",
                                     str(tiny.reward_model_path())])
    assert many.rewards.names == ["sentiment_reward", "think_format_reward", "reward-trained-s0-n200"]
    assert many.rewards.roles == ["reward"]
    many.end()
    with pytest.raises(ConfigError, match="^GRPO needs a reward: pass reward_funcs="):
        GRPOTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=bundled_prompts(16))
