"""Reward model: data, Bradley-Terry loss (with margin, centring), accuracy, margin and reward metrics
and gradients equal trl.RewardTrainer's (fp32, TRL in the test); bad data in one sentence."""

import pytest
import torch

from posttrain.demo import synthetic, tiny
from posttrain.errors import ConfigError
from posttrain.trainers.reward import collator, prepare_reward_dataset, reward_loss


def standard() -> list[dict]:
    return synthetic.preference_pairs(8, seed=4)


def conversational() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in standard()]


def implicit() -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in standard()]


def with_margin() -> list[dict]:
    return [{**r, "margin": 0.25 * i} for i, r in enumerate(standard())]


DATA = {"standard": standard, "conversational": conversational, "implicit": implicit, "margin": with_margin}
CASES = [("standard", {}), ("conversational", {}), ("implicit", {}), ("margin", {}),
         ("standard", {"center_rewards_coefficient": 0.01}), ("margin", {"center_rewards_coefficient": 0.5})]


def model():
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(tiny.model_path("reward", seed=0), dtype=torch.float32)


def ours(data: str, fields: dict) -> dict:
    tok = tiny.load_tokenizer()
    rows = prepare_reward_dataset(DATA[data](), tok, max_length=1024)
    batch = collator(tok)(rows[:4])
    m = model()
    m.config.pad_token_id = tok.pad_token_id
    rewards = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    loss, values = reward_loss(rewards, batch.get("margin"), fields.get("center_rewards_coefficient"))
    loss.backward()
    return {"rows": rows, "batch": batch, "loss": loss.item(), "accuracy": values["accuracy"].mean().item(),
            "margin": values["margin"].mean().item(), "min_reward": values["rewards"].min().item(),
            "mean_reward": values["rewards"].mean().item(), "max_reward": values["rewards"].max().item(),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters()}}


def theirs(data: str, fields: dict, tmp_path) -> dict:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                        report_to=[], per_device_train_batch_size=4, **fields)
    m = model()
    trainer = RewardTrainer(model=m, args=args, train_dataset=Dataset.from_list(DATA[data]()),
                            processing_class=tiny.load_tokenizer())
    rows = [{k: r[k] for k in ("chosen_ids", "rejected_ids", "margin") if k in r} for r in trainer.train_dataset]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    metrics = trainer._metrics["train"] or trainer._metrics["eval"]
    return {"rows": rows, "batch": batch, "loss": loss.item(), **{k: v[-1] for k, v in metrics.items()},
            "grads": {n: p.grad.clone() for n, p in m.named_parameters()}}


@pytest.mark.parametrize("data,fields", CASES, ids=[f"{d}-{'-'.join(f)}" for d, f in CASES])
def test_loss_metrics_and_gradients_equal_trl(data, fields, tmp_path):
    a, b = ours(data, fields), theirs(data, fields, tmp_path)
    assert a["rows"] == b["rows"]
    assert a["batch"].keys() == b["batch"].keys()
    for key in a["batch"]:
        assert torch.equal(a["batch"][key], b["batch"][key]), key
    for key in ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), key
    for n, g in a["grads"].items():
        torch.testing.assert_close(g, b["grads"][n], atol=1e-5, rtol=1e-5, msg=n)
    assert abs(a["margin"]) > 1e-4  # random weights still separate the pairs a little: not a trivial case


def test_max_length_drops_long_pairs_as_trl():
    tok = tiny.load_tokenizer()
    rows = prepare_reward_dataset(standard(), tok, max_length=None)
    longest = [max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]
    limit = max(longest) - 1
    kept = prepare_reward_dataset(standard(), tok, max_length=limit)
    assert len(kept) == sum(n <= limit for n in longest) and 1 <= len(kept) < len(rows)
    assert all(len(r["chosen_ids"]) <= limit and len(r["rejected_ids"]) <= limit for r in kept)


def test_bad_data_names_the_fix():
    tok = tiny.load_tokenizer()
    with pytest.raises(ConfigError, match="no column 'rejected'.*rename its columns"):
        prepare_reward_dataset([{"prompt": "a", "chosen": "b"}], tok, max_length=64)
    with pytest.raises(ConfigError, match="row 1 has margin nan, not a finite number: fix or drop the row"):
        prepare_reward_dataset([{**standard()[0], "margin": 1.0}, {**standard()[1], "margin": float("nan")}],
                               tok, max_length=64)
    no_template = tiny.load_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ConfigError, match="no chat template: give one with --chat_template_path"):
        prepare_reward_dataset(conversational(), no_template, max_length=64)
    with pytest.raises(ConfigError, match="every pair has a side longer than max_length=2"):
        prepare_reward_dataset(standard(), tok, max_length=2)



def test_adapters_train_the_score_head(tmp_path):
    """peft_config with TRL ModelConfig's default task type (CAUSAL_LM) is trained as SEQ_CLS, so the new score
    head trains beside the adapters: TRL 1.16 takes the task type as given and leaves that head at its random
    initialisation (its docs ask for --lora_task_type SEQ_CLS). Other task types are kept."""
    from peft import LoraConfig

    from posttrain import RewardConfig, RewardTrainer
    from posttrain.trainers.reward import sequence_classification_adapters

    given = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8)
    changed, retyped = sequence_classification_adapters(given)
    assert retyped and changed.task_type == "SEQ_CLS" and given.task_type == "CAUSAL_LM"  # the caller's is kept
    assert sequence_classification_adapters(LoraConfig(task_type="SEQ_CLS"))[1] is False
    assert sequence_classification_adapters(None) == (None, False)
    trainer = RewardTrainer(str(tiny.sft_model_path()), args=RewardConfig(output_dir=str(tmp_path), max_steps=1),
                            train_dataset=standard(), peft_config=given)
    trained = [n for n, p in trainer.session.unwrap("reward").named_parameters() if p.requires_grad]
    assert any("score" in n for n in trained) and any("lora_A" in n for n in trained)
    trainer.end()
