"""KTO: TRL 1.16's KTOTrainer run in the test on the same rows, batches and models (fp32, one process) logs the
same loss, metrics and gradient norms, and ends on the same weights; standard, conversational and paired data,
with a reference model and with LoRA without one, both loss types (APO-zero on the conversational rows),
precomputed reference; evaluation; exact resume; bad data refused before a model loads."""

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM

from posttrain.demo import synthetic, tiny
from posttrain.errors import ConfigError

TOL = 1e-5
# Varied labels, so micro-batches hold different numbers of desirable and undesirable rows.
LABELS = [True, False, True, True, False, False, True, False, False, True, True, True, False, True, False, False]
SETTINGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
                learning_rate=1e-3, disable_tqdm=True, max_length=64, report_to=[], bf16=False,
                gradient_checkpointing=False, save_strategy="no", per_device_eval_batch_size=3)
LOGGED = ["loss", "grad_norm", "learning_rate", "epoch", "kl", "entropy", "num_tokens", "logits/chosen",
          "logits/rejected", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins"]
EVALUATED = ["loss", "num_tokens", "kl", "entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen",
             "rewards/rejected", "logps/rejected", "rewards/margins"]


def unpaired_rows(n: int = 16, seed: int = 3) -> list[dict]:
    pairs = synthetic.preference_pairs(n, seed=seed)
    return [{"prompt": p["prompt"], "completion": p["chosen"] if label else p["rejected"], "label": label}
            for p, label in zip(pairs, LABELS * (n // len(LABELS) + 1))]


def conversational(rows: list[dict]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]} for r in rows]


def lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)


EVAL_ROWS = unpaired_rows(10, seed=4)
# name: (train rows, KTOConfig fields, LoRA without a reference model)
CASES = {
    "standard": (unpaired_rows(), {}, False),
    "conversational_apo": (conversational(unpaired_rows()), {"beta": 0.3, "loss_type": "apo_zero_unpaired"}, False),
    "paired": (synthetic.preference_pairs(8, seed=3), {"desirable_weight": 1.5}, False),
    "lora": (unpaired_rows(), {"learning_rate": 1e-2}, True),
    # TR-DPO's reference update after every step: step 2 scores against the blended reference.
    "sync_ref": (unpaired_rows(), {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
                 False),
}


def trl_run(name: str, out) -> dict:
    import trl

    rows, fields, with_lora = CASES[name]
    args = trl.KTOConfig(output_dir=str(out), use_cpu=True, **{**SETTINGS, **fields})
    ref = None if with_lora else AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1))
    trainer = trl.KTOTrainer(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0)), ref_model=ref, args=args,
                             train_dataset=Dataset.from_list(rows), processing_class=tiny.load_tokenizer(),
                             peft_config=lora() if with_lora else None)
    trainer.train()
    evaluated = trainer.evaluate(Dataset.from_list(EVAL_ROWS)) if name == "standard" else {}
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"rows": [r for r in trainer.state.log_history if "loss" in r], "eval": evaluated, "weights": weights,
            "trainer": trainer}


def ours_run(name: str, out, **extra) -> dict:
    from posttrain import KTOConfig, KTOTrainer

    rows, fields, with_lora = CASES[name]
    args = KTOConfig(output_dir=str(out), **{**SETTINGS, **fields, **extra})
    trainer = KTOTrainer(str(tiny.model_path(seed=0)), ref_model=None if with_lora else str(tiny.model_path(seed=1)),
                         args=args, train_dataset=rows, eval_dataset=EVAL_ROWS if name == "standard" else None,
                         peft_config=lora() if with_lora else None)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.session.unwrap("policy").state_dict().items()}
    return {"rows": [r for r in trainer.state.log_history if "loss" in r],
            "eval": trainer.evaluate() if name == "standard" else {}, "engines": sorted(trainer.session.engines),
            "weights": weights, "trainer": trainer}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kto")
    out = {name: (trl_run(name, tmp / f"trl_{name}"), ours_run(name, tmp / name)) for name in CASES}
    out["precomputed"] = (out["standard"][0], ours_run("standard", tmp / "pre", precompute_ref_log_probs=True))
    return out


@pytest.mark.parametrize("name", [*CASES, "precomputed"])
def test_loss_and_metrics_match_trl(runs, name):
    theirs, ours = runs[name]
    assert len(ours["rows"]) == len(theirs["rows"]) == 2
    for a, b in zip(theirs["rows"], ours["rows"]):
        assert set(a) - {"step"} <= set(b), (name, set(a) - set(b))
        for key in LOGGED:
            if key in a:  # rewards/margins is absent where a step had one kind of row only, in both
                assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), (name, a["step"], key)
    # The weights after training agree to Adam's amplification of rounding in near-zero gradients (lr 1e-3).
    diff = max((ours["weights"][k] - v).abs().max().item() for k, v in theirs["weights"].items())
    assert diff < 1e-4, name


@pytest.mark.parametrize("name", [*CASES, "precomputed"])
def test_gradients_match_trl(runs, name):
    """From TRL's trained weights, one micro-batch's loss and every trained parameter's gradient (LoRA: the
    adapters') are TRL's."""
    import torch

    theirs, ours = (side["trainer"] for side in runs[name])
    model = ours.session.unwrap("policy")
    trl_params = dict(theirs.model.named_parameters())
    with torch.no_grad():
        for key, param in model.named_parameters():
            param.copy_(trl_params[key])
    from posttrain.trainers.kto import _model_inputs

    theirs.model.zero_grad()
    trl_loss = theirs.compute_loss(theirs.model, theirs.data_collator([theirs.train_dataset[i] for i in range(4)]))
    trl_loss.backward()
    model.zero_grad()
    loss = ours.compute_loss(ours.collate([_model_inputs(ours.train_rows[i]) for i in range(4)]))[0]
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    trained = [(key, p) for key, p in model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for _, p in trained)
    scale = max(trl_params[key].grad.abs().max().item() for key, _ in trained)
    assert scale > 1e-3, name  # gradients that are not all zero
    assert max((p.grad - trl_params[key].grad).abs().max().item() for key, p in trained) < TOL * scale, name


def test_cases_are_not_trivial(runs):
    rows = runs["standard"][1]["rows"]
    assert rows[0]["kl"] > 0.01 and abs(rows[0]["rewards/margins"]) > 1e-3
    assert runs["conversational_apo"][1]["rows"][0]["kl"] == 0.0  # no KL term in APO-zero
    assert runs["paired"][1]["rows"][1]["kl"] > 0.01
    lora_rows = runs["lora"][1]["rows"]
    assert lora_rows[0]["rewards/chosen"] == 0.0 and lora_rows[1]["rewards/chosen"] != 0.0  # B starts at zero
    assert runs["lora"][1]["engines"] == ["policy"]  # the reference is the base, adapters disabled
    assert runs["precomputed"][1]["engines"] == ["policy"]  # the reference was freed after its pass
    synced, fixed = runs["sync_ref"][1]["rows"][1], runs["standard"][1]["rows"][1]
    assert abs(synced["rewards/chosen"] - fixed["rewards/chosen"]) > 1e-3  # step 2 saw another reference


@pytest.mark.parametrize("name", ["standard", "precomputed"])
def test_evaluation_matches_trl(runs, name):
    theirs, ours = runs[name]
    for key in EVALUATED:
        assert ours["eval"][f"eval/{key}"] == pytest.approx(theirs["eval"][f"eval_{key}"], rel=TOL, abs=TOL), key


def test_resume_is_exact(tmp_path):
    """A run resumed from its step-2 checkpoint (what a run killed after it finds) logs the uninterrupted
    run's steps 3 and 4 and ends on its weights."""
    from posttrain import KTOConfig, KTOTrainer

    fields = {**SETTINGS, "gradient_accumulation_steps": 1, "max_steps": 4, "save_strategy": "steps",
              "save_steps": 2}

    def run(out, **extra):
        trainer = KTOTrainer(str(tiny.model_path(seed=0)), args=KTOConfig(output_dir=str(out), **fields, **extra),
                             train_dataset=unpaired_rows())
        trainer.train()
        return trainer.state.log_history, trainer.session.unwrap("policy").state_dict()

    full, full_weights = run(tmp_path / "full")
    resumed, weights = run(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert [r["step"] for r in resumed if "loss" in r][-2:] == [3, 4]
    for a, b in zip([r for r in full if "loss" in r][2:], [r for r in resumed if "loss" in r][-2:]):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "num_tokens", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert max((weights[k] - v).abs().max().item() for k, v in full_weights.items()) < 1e-6


def test_sequential_order_and_kl_pairs():
    """TRL's order: rows in dataset order; each row's KL completion is its predecessor's within a
    per_device_train_batch_size group (the first takes the group's last)."""
    from posttrain.data.unpaired import prepare_unpaired_dataset

    rows = prepare_unpaired_dataset(unpaired_rows(), tiny.load_tokenizer(), max_length=64, kl_group=4)
    for start in range(0, 16, 4):
        group = rows[start : start + 4]
        assert [r["KL_completion_ids"] for r in group] == [group[-1]["completion_ids"]] + [
            r["completion_ids"] for r in group[:-1]]


# -- bad data: one sentence naming the fix, before any model loads ---------------------------------
def _refused(rows, match, tmp_path, **fields):
    from posttrain import KTOConfig, KTOTrainer

    with pytest.raises(ConfigError, match=match):
        KTOTrainer("no/such-model-is-loaded", args=KTOConfig(output_dir=str(tmp_path), **fields), train_dataset=rows)


def test_missing_label_is_refused(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "label"} for r in unpaired_rows(4)]
    _refused(rows, r"^train_dataset: no column 'label'; KTO's unpaired data needs prompt, completion, label", tmp_path)


def test_non_boolean_label_is_refused(tmp_path):
    rows = [{**r, "label": int(r["label"])} for r in unpaired_rows(4)]
    _refused(rows, r"^train_dataset: its 'label' column holds int64 values, not booleans: give each row's label as "
                   r"true", tmp_path)
    rows = [{**r, "label": "yes" if r["label"] else "no"} for r in unpaired_rows(4)]
    _refused(rows, r"'label' column holds text, not booleans", tmp_path)


def test_one_label_only_is_refused(tmp_path):
    rows = [{**r, "label": True} for r in unpaired_rows(4)]
    _refused(rows, r"^train_dataset: every row's label is true \(desirable\); KTO learns from both kinds of "
                   r"completion: add rows labelled false$", tmp_path)


def test_conversation_without_assistant_turn_is_refused(tmp_path):
    rows = conversational(unpaired_rows(4))
    rows[2]["completion"] = [{"role": "user", "content": "more"}]
    _refused(rows, r"^train_dataset: row 2's 'completion' has no assistant message, so there is no completion to "
                   r"train on: end it with", tmp_path)


def test_missing_value_and_bad_settings_are_refused(tmp_path):
    rows = unpaired_rows(4)
    rows[1]["completion"] = ""
    _refused(rows, r"^train_dataset: row 1 has a missing or empty 'completion'; fill it in or drop the row$", tmp_path)
    from posttrain import KTOConfig

    with pytest.raises(ConfigError, match=r"^loss_type 'kto' estimates the KL term from the other rows"):
        KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1)
    with pytest.raises(ConfigError, match=r"set train_sampling_strategy 'sequential' \(TRL's rule\)$"):
        KTOConfig(output_dir=str(tmp_path), train_sampling_strategy="random")
    with pytest.raises(ConfigError, match=r"^unknown loss_type 'sigmoid': choose from kto, apo_zero_unpaired$"):
        KTOConfig(output_dir=str(tmp_path), loss_type="sigmoid")


def test_jit_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """enable_jit_checkpoint on a real trainer: SIGTERM during step 2 leaves checkpoint-2 and stops (whole, though
    the run's other checkpoints hold only the model: save_only_model); resuming it logs the uninterrupted run's
    steps 3 and 4 and ends on its weights."""
    import os
    import signal

    from transformers import TrainerCallback

    from posttrain import KTOConfig, KTOTrainer

    class Sigterm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:  # during step 2
                os.kill(os.getpid(), signal.SIGTERM)

    fields = {**SETTINGS, "gradient_accumulation_steps": 1, "max_steps": 4, "enable_jit_checkpoint": True}

    def run(out, callbacks=None, **extra):
        trainer = KTOTrainer(str(tiny.model_path(seed=0)), args=KTOConfig(output_dir=str(out), **{**fields, **extra}),
                             train_dataset=unpaired_rows(), callbacks=callbacks)
        trainer.train()
        return trainer.state.log_history, trainer.session.unwrap("policy").state_dict()

    full, full_weights = run(tmp_path / "full")
    assert not list((tmp_path / "full").glob("checkpoint-*"))  # save_strategy no: no SIGTERM, no checkpoint
    with pytest.raises(KeyboardInterrupt):  # save_only_model: checkpoint-1 holds the model alone
        run(tmp_path / "stopped", callbacks=[Sigterm()], save_strategy="steps", save_steps=1, save_only_model=True)
    stopped = tmp_path / "stopped"
    assert sorted(p.name for p in stopped.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in (stopped / "checkpoint-1" / "state").iterdir()) == ["saved_by.json",
                                                                                     "trainer_state.json"]
    assert AutoModelForCausalLM.from_pretrained(stopped / "checkpoint-1" / "policy").config.vocab_size > 0
    assert (stopped / "checkpoint-2" / "state" / "policy").is_dir()  # the stop's checkpoint is whole
    resumed, weights = run(stopped, resume_from_checkpoint="latest")
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4]
    for a, b in zip([r for r in full if "loss" in r], [r for r in resumed if "loss" in r]):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "num_tokens", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert max((weights[k] - v).abs().max().item() for k, v in full_weights.items()) < 1e-6
