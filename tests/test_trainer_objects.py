"""Trainers take objects, as TRL's do: a policy model built by the caller (with its
processing_class) trains exactly as the same weights given by path, the reference being a copy of
its initial weights; the policy given twice, or an object without its tokenizer, is one sentence.
Runs follow one another in one Python process, also after one destroyed the process group."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.demo import tiny
from posttrain.dsconfig import ConfigError
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def config(out, **kw):
    settings = dict(beta=0.04, reward_funcs=["posttrain.demo.synthetic:sentiment_reward"], learning_rate=5e-2,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_steps=2,
                    disable_tqdm=True, num_prompts=16)
    return GRPOConfig(output_dir=str(out), **{**settings, **kw})


def test_a_model_object_trains_as_its_path(tmp_path):
    path = tiny.sft_model_path()
    by_path = GRPOTrainer(config(tmp_path / "path", model_name_or_path=str(path))).train()
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = GRPOTrainer(config(tmp_path / "object"), model=model, processing_class=tiny.load_tokenizer(path))
    by_object = trainer.train()
    for a, b in zip(by_path, by_object):
        for k in ("reward", "kl", "loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k
    assert by_object[1]["kl"] > 0  # the reference (a copy of the initial weights) did not train along
    assert trainer.session.unwrap("policy") is model


def test_the_policy_given_twice_or_without_its_tokenizer_is_refused(tmp_path):
    path = tiny.sft_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ConfigError, match=r"^the policy is given twice \(model= and model_name_or_path\)"):
        GRPOTrainer(config(tmp_path / "a", model_name_or_path=str(path)), model=model)
    model.name_or_path = "not/a-local-folder"
    with pytest.raises(ConfigError, match=r"^a model object needs its tokenizer: pass processing_class=$"):
        GRPOTrainer(config(tmp_path / "b"), model=model)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert torch.is_grad_enabled()


def test_a_run_after_one_that_destroyed_the_process_group(tmp_path):
    """accelerate's end_training (and TRL's trainers) destroy the process group at the end of a run;
    DeepSpeed keeps the destroyed group, and the next engine in the process failed with "Group ...
    is not registered". The session lets the next run build its own."""
    first = GRPOTrainer(config(tmp_path / "first", max_steps=1)).train()
    torch.distributed.destroy_process_group()
    second = GRPOTrainer(config(tmp_path / "second", max_steps=1)).train()
    assert second[0]["loss"] == pytest.approx(first[0]["loss"], abs=1e-6)


def test_dpo_takes_a_model_object(tmp_path):
    """DPO the same way: a policy object (the reference a copy of its initial weights) gives the
    losses of the same weights by path."""
    from posttrain.demo import synthetic
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    path, pairs = tiny.sft_model_path(), synthetic.preference_pairs(16, seed=3)
    settings = dict(per_device_train_batch_size=4, max_steps=3, logging_steps=1, learning_rate=1e-3,
                    disable_tqdm=True, max_length=64)
    by_path = DPOTrainer(DPOConfig(output_dir=str(tmp_path / "path"), model_name_or_path=str(path), **settings),
                         train_dataset=pairs).train()
    by_object = DPOTrainer(DPOConfig(output_dir=str(tmp_path / "object"), **settings), train_dataset=pairs,
                           model=AutoModelForCausalLM.from_pretrained(path), tokenizer=tiny.load_tokenizer(path)).train()
    losses = [[r["loss"] for r in run if "loss" in r] for run in (by_path, by_object)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6) and losses[0][-1] < losses[0][0]
