"""DPO: parity with trl.DPOTrainer for every loss type, placements, reference modes, resume, LoRA, data."""


import pytest
from conftest import run_json

from posttrain import synthetic, tiny

# (name, DPOConfig fields, batch format). Every loss_type TRL 1.16 accepts, plus combinations and options.
CASES = [
    ("sigmoid", {"loss_type": ["sigmoid"]}, "standard"),
    ("hinge", {"loss_type": ["hinge"]}, "standard"),
    ("ipo", {"loss_type": ["ipo"]}, "standard"),
    ("exo_pair", {"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, "standard"),
    ("nca_pair", {"loss_type": ["nca_pair"]}, "standard"),
    ("robust", {"loss_type": ["robust"], "label_smoothing": 0.1}, "standard"),
    ("bco_pair", {"loss_type": ["bco_pair"]}, "standard"),
    ("sppo_hard", {"loss_type": ["sppo_hard"]}, "standard"),
    ("aot", {"loss_type": ["aot"], "label_smoothing": 0.1}, "standard"),
    ("aot_unpaired", {"loss_type": ["aot_unpaired"]}, "standard"),
    ("apo_zero", {"loss_type": ["apo_zero"]}, "standard"),
    ("apo_down", {"loss_type": ["apo_down"]}, "standard"),
    ("discopop", {"loss_type": ["discopop"], "beta": 0.5}, "standard"),
    ("sft", {"loss_type": ["sft"]}, "standard"),
    ("sigmoid_norm", {"loss_type": ["sigmoid_norm"]}, "standard"),
    ("mpo", {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}, "standard"),
    ("js_divergence", {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"}, "standard"),
    ("alpha_ipo", {"loss_type": ["ipo"], "f_divergence_type": "alpha_divergence",
                   "f_alpha_divergence_coef": 0.3}, "standard"),
    ("forward_kl_hinge", {"loss_type": ["hinge"], "f_divergence_type": "forward_kl", "beta": 2.0}, "standard"),
    ("ld_alpha", {"loss_type": ["sigmoid"], "ld_alpha": 0.5}, "standard"),
    ("wpo", {"loss_type": ["sigmoid"], "use_weighting": True}, "standard"),
    ("conversational", {"loss_type": ["sigmoid"], "beta": 0.3}, "conversational"),
]
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"]


def parity_rows() -> list[dict]:
    return synthetic.preference_pairs(8, seed=3)


def conversational(rows: list[dict]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]


def trl_numbers(tmp_path) -> dict:
    """TRL's own DPOTrainer (one process, no DeepSpeed, fp32) on the same models and batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = tiny.load_tokenizer(tiny.model_path(seed=0))
    rows = parity_rows()
    out = {}
    for name, fields, fmt in CASES:
        data = Dataset.from_list(conversational(rows) if fmt == "conversational" else rows)
        args = DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                         report_to=[], per_device_train_batch_size=4, max_length=1024, **fields)
        trainer = DPOTrainer(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0)),
                             ref_model=AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1)),
                             args=args, train_dataset=data, processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        loss = trainer.compute_loss(trainer.model, batch).item()
        mode = "train" if trainer._metrics["train"] else "eval"
        out[name] = {"loss": loss, **{k: v[-1] for k, v in trainer._metrics[mode].items()},
                     "input_ids": batch["input_ids"].tolist()}
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_parity")
    ours = run_json("dpo_parity.py", tmp / "run", tmp_path=tmp)
    return ours, trl_numbers(tmp)


def test_parity_runs_on_role_layer(parity):
    ours, _ = parity
    assert ours["world"] == 2 and ours["policy_stage"] == 2 and ours["ref_stage"] == 3


def test_tokenization_matches_trl(parity):
    ours, theirs = parity
    assert ours["input_ids"]["standard"] == theirs["sigmoid"]["input_ids"]
    assert ours["input_ids"]["conversational"] == theirs["conversational"]["input_ids"]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_loss_and_metrics_match_trl(parity, name):
    ours, theirs = parity
    for key in ["loss", *METRICS]:
        assert ours[name][key] == pytest.approx(theirs[name][key], rel=1e-5, abs=1e-5), (name, key)
    # A non-trivial case: policy and reference differ, so rewards are not all zero.
    assert abs(ours[name]["rewards/margins"]) > 1e-3
