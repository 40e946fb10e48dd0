"""Bad GRPO/RLOO input gets one sentence naming the fix, before anything loads (table-driven,
the exact sentence): settings, reward specs and reward models, what a reward function returns;
and through the real script, that nothing loads and the output dir is untouched."""

import json

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.rewards import functions as reward_funcs
from posttrain.rewards import models as rewards
from posttrain.rewards.functions import RewardFuncError, call_reward_funcs
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.rloo import RLOOConfig

BASE = {"per_device_train_batch_size": 8, "num_generations": 4}

CONFIG_CASES = [
    (GRPOConfig, {"max_completion_length": 0},
     "max_completion_length must be >= 1 (new tokens per completion); got 0"),
    (RLOOConfig, {"max_completion_length": -4},
     "max_completion_length must be >= 1 (new tokens per completion); got -4"),
    (GRPOConfig, {"max_prompt_length": 0}, "max_prompt_length must be >= 1, or null for no truncation; got 0"),
    (RLOOConfig, {"max_prompt_length": -1}, "max_prompt_length must be >= 1, or null for no truncation; got -1"),
    (GRPOConfig, {"beta": -0.1}, "beta (the KL coefficient) must be >= 0; got -0.1"),
    (RLOOConfig, {"beta": -1.0}, "beta (the KL coefficient) must be >= 0; got -1.0"),
    (GRPOConfig, {"temperature": 0.0},
     "temperature must be > 0 (sampling; the loss divides logits by it); got 0.0"),
    (RLOOConfig, {"temperature": -0.5},
     "temperature must be > 0 (sampling; the loss divides logits by it); got -0.5"),
    (GRPOConfig, {"num_generations": 1, "per_device_train_batch_size": 1},
     "GRPO needs num_generations >= 2 to compare completions of one prompt; got 1"),
    (RLOOConfig, {"num_generations": 1, "per_device_train_batch_size": 1},
     "RLOO needs num_generations >= 2 to compare completions of one prompt; got 1"),
    (RLOOConfig, {"sync_ref_model": True, "beta": 0.0},
     "sync_ref_model needs a reference model, and beta: 0 loads none: set beta > 0 or drop sync_ref_model"),
    (GRPOConfig, {"eval_strategy": "steps", "per_device_eval_batch_size": 6},
     "the eval batch (per_device_eval_batch_size 6 x 1 processes) must be a multiple of num_generations_eval (4), "
     "TRL's rule: set --per_device_eval_batch_size or --num_generations_eval"),
    # TRL's fields posttrain does not take: refused by name unless at TRL's default.
    (GRPOConfig, {"use_vllm": True}, "use_vllm is True, which posttrain does not support (posttrain generates with "
     "its own engine (generation_backend), not vLLM): drop --use_vllm or set it to TRL's default False"),
    (RLOOConfig, {"cache_implementation": "static"}, "cache_implementation is 'static', which posttrain does not "
     "support (posttrain's engine keeps its own KV cache (generation_kv_slots)): drop --cache_implementation or set "
     "it to TRL's default None"),
    (RLOOConfig, {"generation_kwargs": {"num_beams": 4}}, "generation_kwargs 'num_beams' has no equivalent in "
     "posttrain's engine, which takes top_k, top_p, min_p, do_sample, min_new_tokens, min_tokens, repetition_penalty, "
     "eos_token_id, stop_token_ids, temperature: remove it"),
    (GRPOConfig, {"min_p": 1.5}, "min_p must be in [0, 1] (0 or None: off), got 1.5"),
    (GRPOConfig, {"entropy_coef": -0.01},
     "entropy_coef must be >= 0 (a bonus on the policy's entropy; 0 turns it off); got -0.01"),
    (GRPOConfig, {"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
     "use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max; got 0.5 and 0.1"),
]


@pytest.mark.parametrize("cls,fields,sentence", CONFIG_CASES,
                         ids=[f"{c.__name__}-{'-'.join(f)}" for c, f, _ in CONFIG_CASES])
def test_settings(cls, fields, sentence):
    with pytest.raises(ConfigError) as err:
        cls(**{**BASE, **fields})
    assert str(err.value) == sentence


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The current directory of a user with a reward module, a reward model with two labels and
    a folder that is not a saved model."""
    (tmp_path / "my_rewards.py").write_text("SCALE = 2\n\nclass Scorer:\n    pass\n\n"
                                            "def brevity(completions, **kw):\n    return [-len(c) for c in completions]\n")
    (tmp_path / "rm2").mkdir()
    (tmp_path / "rm2" / "config.json").write_text(json.dumps({"model_type": "llama", "id2label": {"0": "a", "1": "b"}}))
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


SPEC_CASES = [
    ("accuracy_rewrd", "unknown reward function 'accuracy_rewrd': did you mean 'accuracy_reward'? use one of TRL's "
     "built-in reward functions (accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
     "get_soft_overlong_punishment), a Python reference 'module.function', or a reward model's folder or hub id "
     "(org/name)"),
    ("no_such_module.fn", "reward function 'no_such_module.fn': importing 'no_such_module' failed: there is no module "
     "'no_such_module' in the current directory or on the import path; check the spelling, or run from the folder "
     "holding it (or add that folder to PYTHONPATH)"),
    ("my_rewards.nope", "reward function 'my_rewards.nope': my_rewards has no 'nope'; its functions are ['brevity']"),
    ("my_rewards:SCALE", "reward function 'my_rewards:SCALE' is not a function (of type int): name a function that "
     "takes completions and returns one reward each"),
    ("my_rewards.Scorer", "reward function 'my_rewards.Scorer' is not a function (the class Scorer): name a function "
     "that takes completions and returns one reward each"),
    ("my_rewards.py", "reward function 'my_rewards.py' is a file: name a function in it, as 'my_rewards.function' "
     "(run from its folder)"),
    ("my_rewards.py:brevity", "reward function 'my_rewards.py:brevity': name the module, not its file: "
     "'my_rewards.brevity'"),
    ("./reward-modle", "reward model ./reward-modle: no such folder; check the path (or give a reward function as "
     "'module.function')"),
    ("runs/reward-modle", "reward model runs/reward-modle: no such folder; check the path (or give a reward function "
     "as 'module.function')"),
    ("not_a_model", "reward model not_a_model: a folder without config.json, not a saved model: give the folder "
     "model.save_pretrained() wrote"),
    ("rm2", "reward model rm2 has 2 labels (num_labels in its config.json); a reward model gives one score per "
     "completion (TRL loads it with num_labels=1): use one trained with a single output, as TRL's RewardTrainer "
     "does"),
]


@pytest.mark.parametrize("spec,sentence", SPEC_CASES, ids=[s for s, _ in SPEC_CASES])
def test_reward_specs(user_dir, spec, sentence):
    with pytest.raises(ConfigError) as err:
        rewards.resolve_reward_specs(["my_rewards.brevity", spec])
    assert str(err.value) == sentence


def test_a_missing_dataset_column():
    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError) as err:
        reward_funcs.check_columns(needs_answer, ["solution"])
    assert str(err.value) == ("reward function 'needs_answer' needs the dataset column(s) ['answer'], which the "
                              "dataset does not have (its columns: ['solution']): use a dataset with them")
    reward_funcs.check_columns(needs_answer, ["answer"])


def strings(completions, **_):
    return ["good" for _ in completions]


def one_float(completions, **_):
    return 1.0


def too_many(completions, **_):
    return [1.0] * (len(completions) + 1)


def a_scalar_tensor(completions, **_):
    return torch.tensor(0.5)


def a_generator(completions, **_):
    return (1.0 for _ in completions)


def raises(completions, answer, **_):
    return [float(a["score"]) for a in answer]


async def async_raises(completions, **_):
    raise RuntimeError("the judge is down")


RETURN = "return a list of 2 rewards (floats, or None for a completion it does not score)"
CALL_CASES = [
    (strings, f"reward function 'strings' returned a str ('good') for completion 0: {RETURN}"),
    (one_float, f"reward function 'one_float' returned a float, not a list: {RETURN}"),
    (too_many, f"reward function 'too_many' returned 3 rewards for 2 completions: {RETURN}"),
    (a_scalar_tensor, f"reward function 'a_scalar_tensor' returned a Tensor, not a list: {RETURN}"),
    (a_generator, f"reward function 'a_generator' returned a generator, not a list: {RETURN}"),
    (raises, "reward function 'raises' raised TypeError: string indices must be integers, not 'str' "
     f"(at {__file__}:{raises.__code__.co_firstlineno + 1})"),
    (async_raises, "reward function 'async_raises' raised RuntimeError: the judge is down "
     f"(at {__file__}:{async_raises.__code__.co_firstlineno + 1})"),
]


@pytest.mark.parametrize("fn,sentence", CALL_CASES, ids=[f.__name__ for f, _ in CALL_CASES])
def test_what_reward_functions_return(fn, sentence):
    with pytest.raises(RewardFuncError) as err:
        call_reward_funcs([fn], ["p", "q"], ["a", "b"], [[1], [2]], answer=["x", "y"])
    assert str(err.value) == sentence


def test_none_nan_and_numbers_are_rewards():
    import numpy as np

    def mixed(completions, **_):
        return [None, True, torch.tensor(2.5), np.float32(-1.0)]

    def array(completions, **_):
        return np.array([0.5] * len(completions))

    out = call_reward_funcs([mixed, array], ["p"] * 4, ["a"] * 4)
    assert torch.isnan(out[0, 0]) and out[1:, 0].tolist() == [1.0, 2.5, -1.0] and out[:, 1].tolist() == [0.5] * 4


def test_the_script_loads_nothing_and_keeps_the_output_dir(tmp_path, monkeypatch, capsys):
    """`posttrain grpo` with a reward spec that does not import and --overwrite_output_dir true
    (the demo's): exit 2, one sentence, no session (so no model) and the previous run intact."""
    from posttrain.placement import session
    from posttrain.scripts import grpo
    from posttrain.scripts.args import run_script

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (out / "checkpoint-1").mkdir()

    def no_session(*a, **k):
        raise AssertionError("a session was created: models would load")

    monkeypatch.setattr(session.Session, "__init__", no_session)
    monkeypatch.chdir(tmp_path)
    for argv, sentence in [
        (["--reward_funcs", "my_rewardz.brevity"],
         "reward function 'my_rewardz.brevity': importing 'my_rewardz' failed: there is no module 'my_rewardz' in the "
         "current directory or on the import path; check the spelling, or run from the folder holding it (or add that "
         "folder to PYTHONPATH)"),
        (["--max_completion_length", "0"], "max_completion_length must be >= 1 (new tokens per completion); got 0"),
    ]:
        rc = run_script(grpo.main, ["--output_dir", str(out), "--overwrite_output_dir", "true", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.strip().splitlines()[-1] == f"error: {sentence}", err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'
    assert (out / "checkpoint-1").is_dir() and sorted(p.name for p in out.iterdir()) == ["checkpoint-1",
                                                                                        "metrics.jsonl"]


def test_a_hub_id_that_is_not_there(monkeypatch):
    """A spec spelled as a hub id (org/name) is looked up once; failing, one sentence."""
    from transformers import PretrainedConfig

    calls = []

    def missing(spec, **_):
        calls.append(spec)
        raise OSError("someorg/rm is not a local folder and is not a valid model identifier\nmore detail")

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", missing)
    with pytest.raises(ConfigError) as err:
        rewards.resolve_reward_specs(["someorg/rm"])
    assert str(err.value) == ("reward model someorg/rm: not a local folder and not found on the Hub (someorg/rm is not "
                              "a local folder and is not a valid model identifier); check the name, or give a local "
                              "folder")
    assert calls == ["someorg/rm"]


def test_the_online_trainers_require_their_models_and_rewards(tmp_path, monkeypatch):
    """GRPO, RLOO, PPO and distillation name no default model or reward: none given is one
    sentence naming the fix, before anything loads or the output dir is touched."""
    from posttrain.demo import tiny
    from posttrain.placement import session
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer
    from posttrain.trainers.rloo import RLOOTrainer

    def no_session(*a, **k):
        raise AssertionError("a session was created: models would load")

    monkeypatch.setattr(session.Session, "__init__", no_session)
    out, policy, prompts = str(tmp_path / "run"), str(tiny.sft_model_path()), [{"prompt": "the cat is"}] * 8
    no_policy = "no policy is given: pass model= (a hub name, a local path or a model object)"
    cases = [
        (lambda: GRPOTrainer(None, "m.f", args=GRPOConfig(output_dir=out, **BASE), train_dataset=prompts), no_policy),
        (lambda: RLOOTrainer(None, "m.f", args=RLOOConfig(output_dir=out, **BASE), train_dataset=prompts), no_policy),
        (lambda: PPOTrainer(PPOConfig(output_dir=out), train_dataset=prompts),
         "no policy is given: pass model= (a hub name, a local path or a model object)"),
        (lambda: GRPOTrainer(policy, args=GRPOConfig(output_dir=out, **BASE), train_dataset=prompts),
         "GRPO needs a reward: pass reward_funcs= (functions, one of TRL's reward names, \"module.function\", or a "
         "reward model's path or object)"),
        (lambda: RLOOTrainer(policy, None, args=RLOOConfig(output_dir=out, **BASE), train_dataset=prompts),
         "RLOO needs a reward: pass reward_funcs= (functions, one of TRL's reward names, \"module.function\", or a "
         "reward model's path or object)"),
        (lambda: PPOTrainer(PPOConfig(output_dir=out), model=policy, train_dataset=prompts),
         "PPO needs a reward: pass reward_model= (a sequence-classification model: a hub name, a local path or an "
         "object) and/or reward_funcs= (functions or \"module.function\" names)"),
        (lambda: DistillationTrainer(None, policy, args=DistillationConfig(output_dir=out),
                                     train_dataset=[{"prompt": "the cat", "completion": " is calm ."}]),
         "no student is given: pass model= (a hub name, a local path or a model object)"),
    ]
    for make, sentence in cases:
        with pytest.raises(ConfigError) as err:
            make()
        assert str(err.value) == sentence
    assert not (tmp_path / "run").exists()
