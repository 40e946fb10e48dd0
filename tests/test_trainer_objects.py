"""Trainers take objects, as TRL's do: a model built by the caller (with its processing_class)
trains exactly as the same weights given by path, the reference being a copy of its initial
weights, in every trainer (GRPO, RLOO, DPO, SFT, reward, PPO with its reward and value models,
distillation with its teacher), and data as datasets.Dataset objects; a model given twice, an
object without its tokenizer, or one object for two roles is one sentence. Runs follow one
another in one Python process, also after one destroyed the process group."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.demo import synthetic, tiny
from posttrain.errors import ConfigError
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

PROMPTS = bundled_prompts(16)  # what `posttrain grpo --num_prompts 16` trains on


SENTIMENT = "posttrain.demo.synthetic.sentiment_reward"  # the bundled reward, as TRL's scripts name a function


def config(out, **kw):
    settings = dict(beta=0.04, learning_rate=5e-2, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no", disable_tqdm=True)
    return GRPOConfig(output_dir=str(out), **{**settings, **kw})


def grpo_rows(trainer) -> list[dict]:
    trainer.train()
    return trainer.state.log_history


def losses(run, key="loss"):
    return [r[key] for r in run if key in r]


def test_a_model_object_trains_as_its_path(tmp_path):
    """GRPO given the policy, and a reward model among reward_funcs (with its tokenizer in
    reward_processing_classes, TRL's way), as objects: the run by paths."""
    path, reward = tiny.sft_model_path(), tiny.reward_model_path()
    by_path = grpo_rows(GRPOTrainer(str(path), reward_funcs=[str(reward), SENTIMENT], args=config(tmp_path / "path"),
                                    train_dataset=PROMPTS))
    model = AutoModelForCausalLM.from_pretrained(path)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward)
    # The same bundled prompts as a datasets.Dataset (TRL's train_dataset).
    prompts = Dataset.from_list(PROMPTS)
    trainer = GRPOTrainer(model, args=config(tmp_path / "object"), processing_class=tiny.load_tokenizer(path),
                          train_dataset=prompts, reward_funcs=[reward_model, SENTIMENT],
                          reward_processing_classes=[tiny.load_tokenizer(reward), None])
    by_object = grpo_rows(trainer)
    name = f"rewards/{reward.name}/mean"
    for a, b in zip(by_path, by_object):
        for k in ("reward", "kl", "loss", "grad_norm", name):
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k
    assert by_object[1]["kl"] > 0  # the reference (a copy of the initial weights) did not train along
    assert trainer.session.unwrap("policy") is model and trainer.session.unwrap("reward") is reward_model


def test_the_policy_given_twice_or_without_its_tokenizer_is_refused(tmp_path):
    path = tiny.sft_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    model.name_or_path = "not/a-local-folder"
    with pytest.raises(ConfigError, match=r"^a model object needs its tokenizer: pass processing_class=$"):
        GRPOTrainer(model, SENTIMENT, args=config(tmp_path / "b"), train_dataset=PROMPTS)
    assert not (tmp_path / "b").exists()
    assert torch.is_grad_enabled()


def test_a_run_after_one_that_destroyed_the_process_group(tmp_path):
    """accelerate's end_training (and TRL's trainers) destroy the process group at the end of a run;
    DeepSpeed keeps the destroyed group, and the next engine in the process failed with "Group ...
    is not registered". The session lets the next run build its own."""
    path = str(tiny.sft_model_path())
    first = grpo_rows(GRPOTrainer(path, SENTIMENT, args=config(tmp_path / "first", max_steps=1), train_dataset=PROMPTS))
    torch.distributed.destroy_process_group()
    second = grpo_rows(GRPOTrainer(path, SENTIMENT, args=config(tmp_path / "second", max_steps=1),
                                   train_dataset=PROMPTS))
    assert second[0]["loss"] == pytest.approx(first[0]["loss"], abs=1e-6)


def test_dpo_takes_a_model_object(tmp_path):
    """DPO the same way: a policy object (the reference a copy of its initial weights) gives the
    losses of the same weights by path."""
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    path, pairs = tiny.sft_model_path(), synthetic.preference_pairs(16, seed=3)
    settings = dict(per_device_train_batch_size=4, max_steps=3, logging_steps=1, learning_rate=1e-3,
                    disable_tqdm=True, max_length=64)
    by_path = DPOTrainer(str(path), args=DPOConfig(output_dir=str(tmp_path / "path"), **settings), train_dataset=pairs)
    by_path.train()
    by_path = by_path.state.log_history
    by_object = DPOTrainer(AutoModelForCausalLM.from_pretrained(path),
                           args=DPOConfig(output_dir=str(tmp_path / "object"), **settings), train_dataset=pairs,
                           processing_class=tiny.load_tokenizer(path))
    by_object.train()
    by_object = by_object.state.log_history
    assert losses(by_object) == pytest.approx(losses(by_path), abs=1e-6) and losses(by_path)[-1] < losses(by_path)[0]


def test_sft_and_reward_take_model_objects(tmp_path):
    """SFT (a causal LM, on a ZeRO-3 role: the object is partitioned when prepared) and the reward
    trainer (a one-logit classifier) given the model as an object with its processing_class, the
    data as a datasets.Dataset: the losses of the same weights by path; the trained engine wraps
    the object itself."""
    from posttrain.trainers.reward import RewardConfig, RewardTrainer
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    settings = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, disable_tqdm=True, max_length=64,
                    logging_steps=1)
    text = Dataset.from_list([{"text": line} for line in tiny.corpus()[:12]])
    path = tiny.model_path("causal")
    zero3 = dict(role_configs={"policy": "zero3_train"})
    by_path = SFTTrainer(str(path), args=SFTConfig(output_dir=str(tmp_path / "sft_path"), **settings, **zero3),
                         train_dataset=text)
    by_path.train()
    by_path = by_path.state.log_history
    model = AutoModelForCausalLM.from_pretrained(path)
    sft = SFTTrainer(model, args=SFTConfig(output_dir=str(tmp_path / "sft_object"), **settings, **zero3),
                     train_dataset=text, processing_class=tiny.load_tokenizer(path))
    sft.train()
    by_object = sft.state.log_history
    assert losses(by_object) == pytest.approx(losses(by_path), abs=1e-6) and len(losses(by_path)) == 3
    assert losses(by_path)[-1] < losses(by_path)[0] and sft.session.unwrap("policy") is model
    assert sft.session.zero_stage("policy") == 3 and all(hasattr(p, "ds_id") for p in model.parameters())

    pairs = Dataset.from_list(synthetic.preference_pairs(12, seed=3))
    path = tiny.reward_model_path()
    by_path = RewardTrainer(str(path), args=RewardConfig(output_dir=str(tmp_path / "rm_path"), **settings),
                            train_dataset=pairs)
    by_path.train()
    by_path = by_path.state.log_history
    model = AutoModelForSequenceClassification.from_pretrained(path)
    by_object = RewardTrainer(model, args=RewardConfig(output_dir=str(tmp_path / "rm_object"), **settings),
                              train_dataset=pairs, processing_class=tiny.load_tokenizer(path))
    by_object.train()
    by_object = by_object.state.log_history
    assert losses(by_object) == pytest.approx(losses(by_path), abs=1e-6) and len(losses(by_path)) == 3


def ppo_config(out, **kw):
    from posttrain.trainers.ppo import PPOConfig

    settings = dict(learning_rate=3e-4, lr_scheduler_type="constant", per_device_train_batch_size=4,
                    num_mini_batches=2, num_ppo_epochs=1, response_length=6, temperature=1.0, stop_token="eos",
                    local_rollout_forward_batch_size=8, disable_tqdm=True, num_sample_generations=1,
                    total_episodes=16, logging_steps=1, save_steps=None)
    return PPOConfig(output_dir=str(out), **{**settings, **kw})


PPO_KEYS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg")


def test_ppo_takes_its_models_and_prompts_as_objects(tmp_path):
    """PPO given the policy, reward and value models as objects (the reference a copy of the
    policy's initial weights) and the prompts as a datasets.Dataset: the run by paths, number for
    number. The reference, on a ZeRO-3 role of its own here, is the copy partitioned. Without a
    value model, the value model is a copy of the reward object, as by path it is the reward
    model's weights loaded again."""
    from posttrain.trainers.ppo import PPOTrainer

    policy, reward = tiny.sft_model_path(), tiny.reward_model_path()
    prompts = Dataset.from_list([{"prompt": p} for p in synthetic.prompts(16, seed=3)])
    zero3 = dict(role_configs={"reference": "zero3_inference"})
    by_path = PPOTrainer(ppo_config(tmp_path / "path", **zero3), model=str(policy), reward_model=str(reward),
                         value_model=str(reward), train_dataset=prompts)
    by_path.train()
    by_path = by_path.state.log_history
    model = AutoModelForCausalLM.from_pretrained(policy)
    trainer = PPOTrainer(ppo_config(tmp_path / "object", **zero3), train_dataset=prompts, model=model,
                         processing_class=tiny.load_tokenizer(policy),
                         reward_model=AutoModelForSequenceClassification.from_pretrained(reward),
                         value_model=AutoModelForSequenceClassification.from_pretrained(reward, num_labels=1))
    trainer.train()
    by_object = trainer.state.log_history
    # No value model given: a copy of the reward object (which stays frozen as given).
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward)
    before = {k: v.clone() for k, v in reward_model.state_dict().items()}
    default_value = PPOTrainer(ppo_config(tmp_path / "copy"), train_dataset=prompts,
                               model=AutoModelForCausalLM.from_pretrained(policy),
                               processing_class=tiny.load_tokenizer(policy), reward_model=reward_model)
    default_value.train()
    by_copy = default_value.state.log_history
    assert len(by_path) == len(by_object) == len(by_copy) == 2
    for a, b, c in zip(by_path, by_object, by_copy):
        for k in PPO_KEYS:
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k
            assert c[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k
    assert by_object[1]["objective/kl"] != 0.0  # the reference did not train along
    assert trainer.session.unwrap("policy") is model and trainer.session.zero_stage("reference") == 3
    assert default_value.session.unwrap("value") is not reward_model
    assert all(torch.equal(v, reward_model.state_dict()[k]) for k, v in before.items())


def test_distill_takes_student_and_teacher_objects(tmp_path):
    """Distillation given the student (model=, with its processing_class) and the teacher
    (teacher_model=) as objects, on a ZeRO-3 teacher role, and the rows as a datasets.Dataset:
    the losses of the same weights by path."""
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer

    student, teacher = tiny.model_path("causal"), tiny.model_path("causal", seed=1)
    rows = Dataset.from_list([{"prompt": " ".join(w[:2]), "completion": " " + " ".join(w[2:])}
                              for w in (line.split() for line in tiny.corpus()[:8])])
    settings = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, disable_tqdm=True,
                    role_configs={"teacher": "zero3_inference"}, lmbda=0.0, logging_steps=1, save_steps=None)
    by_path = DistillationTrainer(str(student), args=DistillationConfig(output_dir=str(tmp_path / "path"),
                                                                        teacher_model_name_or_path=str(teacher),
                                                                        **settings), train_dataset=rows)
    by_path.train()
    by_path = by_path.state.log_history
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher)
    trainer = DistillationTrainer(AutoModelForCausalLM.from_pretrained(student), teacher_model=teacher_model,
                                  args=DistillationConfig(output_dir=str(tmp_path / "object"), **settings),
                                  train_dataset=rows, processing_class=tiny.load_tokenizer(student))
    trainer.train()
    by_object = trainer.state.log_history
    assert losses(by_object) == pytest.approx(losses(by_path), abs=1e-6) and len(losses(by_path)) == 3
    assert losses(by_path)[-1] < losses(by_path)[0]
    assert trainer.session.unwrap("teacher") is teacher_model and trainer.session.zero_stage("teacher") == 3


def test_contradictions_are_refused_in_one_sentence(tmp_path):
    """A model given twice, an object for two roles, a reward object without one score, a value
    object (built from a config, no folder) of another vocabulary, and no model at all:
    one sentence each, before the output dir is touched."""
    from posttrain.trainers.distill import DistillationConfig, DistillationTrainer
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.reward import RewardConfig, RewardTrainer
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    path, tok = tiny.sft_model_path(), tiny.load_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = [{"text": "the cat is calm ."}] * 4
    with pytest.raises(ConfigError, match=r"^no model is given: pass model= \(a hub name, a local path or a model "
                                          r"object\)"):
        SFTTrainer(None, args=SFTConfig(output_dir=str(tmp_path / "a")), train_dataset=rows, processing_class=tok)
    with pytest.raises(ConfigError, match=r"^the reward model object has num_labels=2; a reward model needs 1"):
        RewardTrainer(model, args=RewardConfig(output_dir=str(tmp_path / "a")), train_dataset=rows, processing_class=tok)
    with pytest.raises(ConfigError, match=r"^model= and ref_model= are the same object: each role needs a model"):
        PPOTrainer(ppo_config(tmp_path / "a"), model=model, ref_model=model, processing_class=tok)
    with pytest.raises(ConfigError, match=r"^the reward model object has num_labels=2; it must give one score"):
        PPOTrainer(ppo_config(tmp_path / "a"), model=model, processing_class=tok,
                   reward_model=AutoModelForCausalLM.from_pretrained(path))
    other_vocab = tiny.model_config("reward")
    other_vocab.vocab_size = len(tok) + 8
    built = AutoModelForSequenceClassification.from_config(other_vocab)
    with pytest.raises(ConfigError, match=rf"^the value model object has a vocabulary of {len(tok) + 8} tokens and "
                                          rf"the policy {model.config.vocab_size}: it reads the policy's token ids"):
        PPOTrainer(ppo_config(tmp_path / "a"), reward_funcs=["posttrain.demo.synthetic:sentiment_reward"],
                   model=model, processing_class=tok, value_model=built)
    with pytest.raises(ConfigError, match=r"^a policy object needs its value model: pass value_model="):
        PPOTrainer(ppo_config(tmp_path / "a"), reward_funcs=["posttrain.demo.synthetic:sentiment_reward"],
                   model=model, processing_class=tok)
    with pytest.raises(ConfigError, match=r"^the teacher is given twice \(teacher_model= and teacher_model_name_or_path\)"):
        DistillationTrainer(str(path), teacher_model=model, train_dataset=[{"prompt": "a", "completion": "b"}],
                            args=DistillationConfig(output_dir=str(tmp_path / "a"), teacher_model_name_or_path=str(path)))
    with pytest.raises(ConfigError, match=r"^reward_processing_classes has 2 entries for 1 reward_funcs: give one per"):
        GRPOTrainer(str(path), args=config(tmp_path / "a"), train_dataset=PROMPTS,
                    reward_funcs=[AutoModelForSequenceClassification.from_pretrained(tiny.reward_model_path())],
                    reward_processing_classes=[tok, tok])
    # The prompts are required, as in TRL's trainers (the scripts load --dataset_name or the bundled ones).
    for trainer in (lambda: GRPOTrainer(str(path), SENTIMENT, args=config(tmp_path / "a")),
                    lambda: PPOTrainer(ppo_config(tmp_path / "a"), model=str(path),
                                       reward_model=str(tiny.reward_model_path()))):
        with pytest.raises(ConfigError, match=r"^(GRPO|PPO) needs prompts: pass train_dataset= \(a datasets.Dataset "
                                              r"or a list of dicts with a 'prompt'\)"):
            trainer()
    assert not (tmp_path / "a").exists()
