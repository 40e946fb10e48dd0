"""DPO: parity with trl.DPOTrainer for every loss type, placements, reference modes, resume, LoRA, data."""


import json

import pytest
from conftest import ROOT, torchrun

from posttrain.demo import synthetic, tiny

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
def launched(tmp_path_factory):
    """tests/dist/dpo_checks.py: the parity, training and reference-sync runs in one two-process launch; the
    folder of their JSON (parity.json, train.json, sync.json)."""
    tmp = tmp_path_factory.mktemp("dpo_launch")
    torchrun(ROOT / "tests" / "dist" / "dpo_checks.py", tmp)
    return tmp


@pytest.fixture(scope="module")
def parity(launched, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_parity")
    ours = json.loads((launched / "parity.json").read_text())
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
    for key in ["loss", *METRICS]:  # posttrain on packed rows (its default) and padded, as TRL pads
        assert ours[name][key] == pytest.approx(theirs[name][key], rel=1e-5, abs=1e-5), (name, key)
        assert ours["padded"][name][key] == pytest.approx(theirs[name][key], rel=1e-5, abs=1e-5), (name, key)
    # A non-trivial case: policy and reference differ, so rewards are not all zero.
    assert abs(ours[name]["rewards/margins"]) > 1e-3


# -- training on the role layer ------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(launched):
    return json.loads((launched / "train.json").read_text())


def test_placements(runs):
    assert runs["zero2-zero3"]["stages"] == {"policy": 2, "reference": 3}
    assert runs["zero2-replicated"]["stages"] == {"policy": 2, "reference": 0}
    assert runs["zero3"]["stages"] == {"policy": 3, "reference": 3}


def test_placement_invariance(runs):
    first = runs["zero2-zero3"]["losses"][:5]
    assert len(first) == 5 and first[4] < first[0] - 0.02  # it trains, so agreement is not trivial
    for mix in ("zero2-replicated", "zero3"):
        assert runs[mix]["losses"][:5] == pytest.approx(first, abs=1e-4), mix


def test_precomputed_reference_equals_live(runs):
    assert runs["precomputed"]["losses"] == pytest.approx(runs["zero2-zero3"]["losses"], abs=1e-5)
    # The reference engine was released after the precompute pass.
    assert runs["precomputed"]["engines"] == ["policy"]


def test_resume_gives_same_next_losses(runs):
    assert runs["resumed"]["losses"] == pytest.approx(runs["zero2-zero3"]["losses"][3:], abs=1e-6)
    assert [r["step"] for r in runs["resumed"]["rows"]] == [4, 5, 6]


def test_learning_rate_and_epoch_are_trls(runs, tmp_path):
    """The logged learning_rate is the rate each step used and epoch the fraction of the data seen,
    as TRL's DPOTrainer (transformers.Trainer) logs them for the same schedule: TRL on one process
    with the global batch (2 ranks x 4 pairs x 2 micro-batches) of the same 64 pairs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
                     per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-3, max_steps=6,
                     logging_steps=1, max_length=64, save_strategy="no", disable_tqdm=True)
    trainer = DPOTrainer(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0)),
                         ref_model=AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1)), args=args,
                         train_dataset=Dataset.from_list(synthetic.preference_pairs(64, seed=0)),
                         processing_class=tiny.load_tokenizer())
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "loss" in r]
    ours = runs["zero2-zero3"]["rows"]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5, 6]
    assert [r["learning_rate"] for r in ours] == pytest.approx([r["learning_rate"] for r in theirs], rel=1e-12)
    assert ours[0]["learning_rate"] == 1e-3 and ours[-1]["learning_rate"] == pytest.approx(1e-3 / 6)  # not 0
    assert [r["epoch"] for r in ours] == pytest.approx([r["epoch"] for r in theirs], rel=1e-12)


def test_lora_trains_without_reference_role(runs):
    lora = runs["lora"]
    assert lora["engines"] == ["policy"] and "reference" not in lora["stages"]
    assert lora["losses"][0] == pytest.approx(0.6931, abs=1e-3)  # adapters start at zero: policy == reference
    assert lora["losses"][-1] < lora["losses"][0] - 0.1
    assert "adapter_model.safetensors" in runs["lora_files"]
    # Precomputing with adapters disabled gives the same reference as disabling them live.
    assert runs["lora_precomputed"]["losses"] == pytest.approx(lora["losses"], abs=1e-5)


def test_eval_and_logging(runs):
    r = runs["zero2-zero3"]
    assert [e["step"] for e in r["evals"]] == [3, 6]
    for key in METRICS + ["loss"]:
        assert f"eval/{key}" in r["evals"][0]
    assert r["evals"][-1]["eval/rewards/accuracies"] > 0.8
    row = r["rows"][0]
    assert {"loss", "rewards/margins", "grad_norm", "learning_rate", "epoch"} <= set(row)
    assert runs["metrics_lines"] == 8  # 6 train rows + 2 eval rows in metrics.jsonl


# -- data ----------------------------------------------------------------------------------------
def test_local_files_and_formats(tmp_path):
    from datasets import Dataset

    from posttrain.data.preference import load_dataset_source, prepare_preference_dataset, write_jsonl

    tok = tiny.load_tokenizer()
    rows = synthetic.preference_pairs(6, seed=5)
    expected = prepare_preference_dataset(rows, tok)
    Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "p.json").write_text(json.dumps(rows))
    for path in (write_jsonl(rows, tmp_path / "p.jsonl"), tmp_path / "p.parquet", tmp_path / "p.json"):
        assert prepare_preference_dataset(load_dataset_source(str(path)), tok) == expected, path
    with pytest.raises(ValueError, match="only the split 'train'"):
        load_dataset_source(str(tmp_path / "p.jsonl"), split="test")
    # Implicit prompt: chosen/rejected carry the shared prompt, TRL's extract_prompt splits it.
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    got = prepare_preference_dataset(implicit, tok)
    assert [g["chosen_ids"][-1] for g in got] == [tok.eos_token_id] * 6
    conv = prepare_preference_dataset(conversational(rows), tok)
    assert tok.decode(conv[0]["prompt_ids"]).startswith("<|user|>")
    assert tok.decode(conv[0]["prompt_ids"]).endswith("<|assistant|>")


@pytest.mark.parametrize("column,value", [("chosen", ""), ("rejected", None), ("prompt", "  ")])
def test_empty_field_names_row_and_column(column, value):
    from posttrain.data.preference import prepare_preference_dataset

    rows = synthetic.preference_pairs(5, seed=5)
    rows[3][column] = value
    with pytest.raises(ValueError, match=rf"row 3 has a missing or empty '{column}'"):
        prepare_preference_dataset(rows, tiny.load_tokenizer())


def test_empty_message_and_missing_column():
    from posttrain.data.preference import prepare_preference_dataset

    rows = conversational(synthetic.preference_pairs(4, seed=5))
    rows[2]["rejected"] = [{"role": "assistant", "content": ""}]
    with pytest.raises(ValueError, match="row 2 has a missing or empty 'rejected'"):
        prepare_preference_dataset(rows, tiny.load_tokenizer())
    # Content parts (one schema for every row, as Arrow needs): a blank text part is empty too.
    for i, row in enumerate(rows):
        row["rejected"] = [{"role": "assistant", "content": [{"type": "text", "text": " " if i == 2 else "no"}]}]
    with pytest.raises(ValueError, match="row 2 has a missing or empty 'rejected'"):
        prepare_preference_dataset(rows, tiny.load_tokenizer())
    with pytest.raises(ValueError, match="no column 'rejected'"):
        prepare_preference_dataset([{"prompt": "a", "chosen": "b"}], tiny.load_tokenizer())


@pytest.mark.parametrize("fields,message", [
    ({"loss_type": ["dpo"]}, "unknown loss_type 'dpo'"),
    ({"loss_type": ["exo_pair"]}, "needs label_smoothing > 0"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights has 1 values for 2"),
    ({"loss_type": ["nca_pair"], "f_divergence_type": "js_divergence"}, "supports only"),
    ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "precomputed reference log-probs would go stale"),
    ({"sync_ref_model": True, "ref_model_sync_steps": 0}, "ref_model_sync_steps >= 1"),
])
def test_config_errors(fields, message):
    from posttrain.trainers.dpo import DPOConfig

    with pytest.raises(ValueError, match=message):
        DPOConfig(**fields)


def test_sync_ref_model_with_adapters_is_refused_before_loading(tmp_path):
    from peft import LoraConfig

    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    with pytest.raises(ValueError, match="sync_ref_model needs a reference model of its own"):
        DPOTrainer("not/loaded", args=DPOConfig(output_dir=str(tmp_path), sync_ref_model=True),
                   train_dataset=parity_rows(), peft_config=LoraConfig(task_type="CAUSAL_LM"))


# -- the example -----------------------------------------------------------------------------------
def test_example_learns_held_out_preferences_under_accelerate_launch(tmp_path):
    """examples/dpo.py on the demo settings, launched as a user would with accelerate (two processes)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
           "examples/dpo.py", "--config", "configs/dpo.yaml", "--output_dir", str(tmp_path / "run"), "--report_to",
           "tensorboard"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/rewards/accuracies"] for r in rows if "eval/rewards/accuracies" in r]
    assert evals[-1] > 0.8
    assert "held-out eval/rewards/accuracies" in proc.stdout
    # Two processes: 10 steps x 16 pairs x 2 ranks of 512 pairs.
    assert next(r for r in rows if r["step"] == 10 and "loss" in r)["epoch"] == pytest.approx(0.625)
    assert (tmp_path / "run" / "checkpoint-60" / "policy" / "model.safetensors").exists()
    assert list((tmp_path / "run").rglob("events.out.tfevents.*"))  # the accelerate tracker wrote
    assert (tmp_path / "run" / "model.safetensors").exists()  # the trained policy at the top, as TRL


@pytest.fixture(scope="module")
def synced(launched):
    return json.loads((launched / "sync.json").read_text())


def test_blend_every_placement(synced):
    b = synced["blend"]
    assert b["fast_used"] == ["fast", "fast2"]
    # target = 0.4 * reference + 0.6 * policy, exactly (fp32), into fast/stock ZeRO-3 and replicated
    # targets, from a ZeRO-2 and a ZeRO-3 policy.
    for key in ("fast<-policy", "stock<-policy", "rep<-policy", "fast2<-policy3"):
        assert b[key] < 1e-6, key
    assert b["fast_forward_vs_blended"] < 1e-5
    assert "trains" in b["blend_trained_error"]


def test_sync_ref_model_changes_the_reference_and_is_placement_invariant(synced):
    ref = synced["zero2-zero3"]["losses"]
    # The first sync (after step 2) moves the reference: step 3's loss differs from a run without it.
    assert ref[:2] == pytest.approx(synced["no_sync"]["losses"][:2], abs=1e-6)
    assert abs(ref[2] - synced["no_sync"]["losses"][2]) > 1e-4
    for mix in ("zero2-replicated", "zero3"):
        assert synced[mix]["losses"] == pytest.approx(ref, rel=1e-4, abs=1e-5), mix
    sync_steps = [i + 1 for i, t in enumerate(synced["zero2-zero3"]["sync_times"]) if t > 0]
    assert sync_steps == [2, 4, 6]


def test_sync_ref_model_resumes_with_the_synced_reference(synced):
    assert any(f.endswith(".safetensors") for f in synced["ckpt_reference_files"])
    assert synced["resumed"]["losses"] == pytest.approx(synced["zero2-zero3"]["losses"][3:], abs=1e-6)
