"""Distillation: the loss against TRL's own GKD loss (one process), and the trainer on two CPU
processes: placement, placement-invariant losses, every sequence source, checkpoint and resume."""

import json
import os

import pytest
import torch
from conftest import together_json

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.trainers.distill import (
    DistillationConfig,
    DistillationTrainer,
    check_vocabularies,
    generalized_jsd_loss,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def logits_and_labels(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 7, 50, generator=g) * 3
    teacher = torch.randn(3, 7, 50, generator=g) * 3
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_loss_equals_trl(beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = logits_and_labels(int(beta * 10 + temperature * 100))
    for lab in (labels, None):
        for reduction in ("batchmean", "sum", "mean"):
            ours = generalized_jsd_loss(student, teacher, lab, beta=beta, temperature=temperature, reduction=reduction)
            trl = GKDTrainer.generalized_jsd_loss(student, teacher, lab, beta=beta, temperature=temperature,
                                                  reduction=reduction)
            assert ours.item() == pytest.approx(trl.item(), rel=1e-6, abs=1e-7)
            assert ours.item() > 0


def test_loss_gradient_equals_trl():
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = logits_and_labels(5)
    grads = []
    for fn in (generalized_jsd_loss, GKDTrainer.generalized_jsd_loss):
        s = student.clone().requires_grad_(True)
        fn(s, teacher, labels, beta=0.3, temperature=1.5).backward()
        grads.append(s.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_loss_ends_are_forward_and_reverse_kl():
    student, teacher, _ = logits_and_labels(1)
    p, q = teacher.log_softmax(-1), student.log_softmax(-1)
    forward = (p.exp() * (p - q)).sum(-1).mean()
    reverse = (q.exp() * (q - p)).sum(-1).mean()
    # Without labels, "batchmean" sums each sequence's 7 positions and averages over sequences.
    assert generalized_jsd_loss(student, teacher, beta=0.0).item() == pytest.approx(forward.item() * 7, rel=1e-5)
    assert generalized_jsd_loss(student, teacher, beta=1.0).item() == pytest.approx(reverse.item() * 7, rel=1e-5)
    assert generalized_jsd_loss(teacher, teacher, beta=0.5).item() == pytest.approx(0.0, abs=1e-6)


def test_different_vocabularies_are_refused(tmp_path):
    student = tiny.model_config()
    teacher = tiny.model_config()
    teacher.vocab_size = student.vocab_size + 24
    with pytest.raises(ConfigError, match="vocabulary has .* tokens but the teacher's has"):
        check_vocabularies(student, teacher)
    # The trainer checks before it builds anything distributed.
    teacher.save_pretrained(tmp_path / "teacher")
    cfg = DistillationConfig(output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=f"{student.vocab_size} tokens but the teacher's has {teacher.vocab_size}"):
        DistillationTrainer(str(tiny.model_path()), str(tmp_path / "teacher"), args=cfg,
                            train_dataset=[{"prompt": "the cat", "completion": " is calm ."}])


def test_config_errors():
    with pytest.raises(ConfigError, match="beta must be in"):
        DistillationConfig(beta=1.5)
    with pytest.raises(ConfigError, match="lmbda must be in"):
        DistillationConfig(lmbda=-0.1)
    with pytest.raises(ConfigError, match="shuffle_dataset is False, which posttrain does not support"):
        DistillationConfig(shuffle_dataset=False)
    with pytest.raises(ConfigError, match="needs a teacher"):
        DistillationTrainer("x", args=DistillationConfig(), train_dataset=[])
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match="row 0 mixes forms: prompt and completion must both be text or both"):
        DistillationTrainer("x", "t", args=DistillationConfig(), train_dataset=[{"prompt": messages, "completion": "yo"}])
    with pytest.raises(ConfigError, match="distillation needs a 'prompt' column"):
        DistillationTrainer("x", "t", args=DistillationConfig(), train_dataset=[{"text": "the cat is calm ."}])
    # The dataset's completions train only where lmbda < 1 without seq_kd; TRL's default needs prompts alone.
    with pytest.raises(ConfigError, match="row 0 has no 'completion', which lmbda < 1 without seq_kd trains on"):
        DistillationTrainer("x", "t", args=DistillationConfig(lmbda=0.0), train_dataset=[{"prompt": "the cat"}])
    with pytest.raises(ConfigError, match=r"DistillationTrainer\(tools=...\) is not supported"):
        DistillationTrainer("x", "t", train_dataset=[{"prompt": "the cat"}], tools=[len])


def test_every_trl_field_is_accounted_for():
    from posttrain.trainers.multi import MultiConfig
    from posttrain.trainers.ppo import PPOConfig
    from posttrain.trainers.trl_fields import field_status

    for cls in (DistillationConfig, PPOConfig, MultiConfig):
        assert "?" not in field_status(cls).values(), cls
    import inspect

    import trl

    ours, theirs = (inspect.signature(c.__init__).parameters for c in (DistillationTrainer, trl.DistillationTrainer))
    assert list(ours) == list(theirs)  # TRL's constructor, argument for argument


def test_rows_tokenize_as_trl_does():
    """A text prompt with the tokenizer's special tokens and a bare completion + EOS; messages through the chat
    template (the generation prompt; the template ends the assistant's turn); max_length cuts the prompt's start."""
    trainer = DistillationTrainer.__new__(DistillationTrainer)
    trainer.tokenizer, trainer.cfg = tiny.load_tokenizer(), DistillationConfig()
    tok = trainer.tokenizer
    messages = [{"role": "user", "content": "the cat"}]
    prompts, completions = trainer._encode([{"prompt": "the cat", "completion": " is calm ."}, {"prompt": messages},
                                            {"prompt": messages, "completion": [{"role": "assistant", "content": "yo"}]}])
    assert prompts[0] == tok("the cat")["input_ids"] and completions[0] == tok(" is calm .")["input_ids"] + [tok.eos_token_id]
    as_trl = tok.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompts[1] == prompts[2] == as_trl["input_ids"][0] and completions[1] is None
    assert tok.decode(completions[2]) == "yo" + tok.eos_token
    trainer.cfg = DistillationConfig(max_length=3)
    prompts, completions = trainer._encode([{"prompt": "the cat is very", "completion": " calm ."}])
    assert prompts[0] == tok("the cat is very")["input_ids"][-2:] and len(completions[0]) == 1


@pytest.fixture(scope="module")
def run(launched_together):
    return together_json(launched_together, "test_distill")  # tests/dist/distill_checks.py


def test_teacher_partitioned_student_whole(run):
    assert run["world"] == 2 and run["stages"] == [2, 3]
    assert run["teacher_data_empty"] and run["student_whole"]
    assert abs(run["teacher_local"] / run["teacher_full"] - 0.5) < 0.01


def test_losses_placement_invariant(run):
    base = run["losses"]["zero2-zero3"]
    assert len(base) == 3 and min(base) > 0.05
    for mix in ("zero2-replicated", "zero3"):
        assert run["losses"][mix] == pytest.approx(base, abs=1e-4), mix
        for key, value in run["eval"][mix].items():
            assert value == pytest.approx(run["eval"]["zero2-zero3"][key], abs=1e-4), (mix, key)
    ev = run["eval"]["zero2-zero3"]
    assert ev["eval/forward_kl"] > ev["eval/jsd"] > 0


def test_sequence_sources(run):
    assert run["on_policy"]["on_policy"] == [1.0] * 4 and run["on_policy"]["seq_kd"] == [0.0] * 4
    assert run["seq_kd"]["seq_kd"] == [1.0] * 4 and run["seq_kd"]["on_policy"] == [0.0] * 4
    # lmbda 0.5: some micro-batches are the student's, the others the teacher's.
    on, kd = run["mixed"]["on_policy"], run["mixed"]["seq_kd"]
    assert 0 < sum(on) < len(on) and all(a + b == 1.0 for a, b in zip(on, kd))
    # Generated completions are at most max_new_tokens long; different sources, different sequences.
    assert all(0 < n <= 6 for n in run["on_policy"]["length"] + run["seq_kd"]["length"])
    assert run["on_policy"]["losses"][1:] != run["seq_kd"]["losses"][1:]
    z3 = run["zero3_on_policy"]
    assert z3["on_policy"] == [1.0, 1.0] and all(0 < x < 10 for x in z3["losses"])


def test_epoch_and_learning_rate(run):
    # 64 rows, 2 ranks x 4 rows x 2 micro-batches a step: a quarter epoch a step, TRL's fractional
    # epoch; the rate each step used under a linear schedule over 4 steps (never 0).
    assert run["mixed"]["epoch"] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert run["mixed"]["learning_rate"] == pytest.approx([2e-3, 1.5e-3, 1e-3, 5e-4])


def test_resume_gives_same_losses(run):
    assert run["resumed"]["on_policy"] == run["mixed"]["on_policy"][2:]
    assert run["resumed"]["losses"] == pytest.approx(run["mixed"]["losses"][2:], abs=1e-6)
    assert "model.safetensors" in run["student_export"] and "tokenizer.json" in run["student_export"]



def test_example_divergence_falls(tmp_path):
    from conftest import ROOT, torchrun

    out = tmp_path / "run"
    torchrun(ROOT / "examples" / "distill.py", "--config", ROOT / "configs" / "distill.yaml", "--output_dir", out,
             "--max_steps", "30", "--eval_steps", "30", "--save_steps", "30", "--teacher_steps", "60",
             "--heldout_lines", "100", "--disable_tqdm", "true")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement"] == {"student": 2, "teacher": 3}
    assert summary["steps"] == 30 and summary["heldout_lines"] > 50
    assert summary["forward_kl_fall_factor"] > 1.5
    assert summary["jsd_after"] < summary["jsd_before"]
    assert (out / "model.safetensors").exists()  # the trained student at the top, as TRL


def test_eval_strategy_epoch_evaluates_at_each_epoch_end(tmp_path):
    """eval_strategy epoch in the Python API: an evaluation after each of transformers' epochs of optimizer steps
    (ceil(rows / (batch x processes x accumulation)): 10 rows in steps of 4 make 3), not only at the end."""
    rows = [{"prompt": "the cat", "completion": f" is calm {'.' * (i % 3 + 1)}"} for i in range(10)]
    cfg = DistillationConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=2, lmbda=0.0, eval_strategy="epoch",
                             logging_steps=1, save_strategy="no", disable_tqdm=True, report_to=[],
                             per_device_eval_batch_size=2, gradient_checkpointing=False)
    trainer = DistillationTrainer(str(tiny.model_path()), str(tiny.model_path(seed=1)), args=cfg,
                                  train_dataset=rows, eval_dataset=rows[:4])
    trainer.train()
    assert trainer.total_steps == 5  # TRL's ceil(2 epochs x 10 / 4); epochs end after steps 3 and 6 (cut at 5)
    assert [r["step"] for r in trainer.state.log_history if "eval/loss" in r] == [3, 5]
