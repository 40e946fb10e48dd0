"""Two-process checks of disjoint multi-model training (a ZeRO-2 LM beside a ZeRO-3 classifier), one
launch; rank 0 writes the findings as JSON for test_multi.py."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from posttrain.demo import synthetic, tiny
from posttrain.placement import dsconfig
from posttrain.trainers.multi import MultiConfig, MultiTrainer, Task, text_collate


def sentiment_items(n: int, seed: int) -> list[tuple[str, float]]:
    pairs = synthetic.preference_pairs(n, seed=seed)
    return [(p["prompt"] + p[key], label) for p in pairs for key, label in (("chosen", 1.0), ("rejected", 0.0))]


def tasks() -> dict[str, Task]:
    tok = tiny.load_tokenizer()
    texts = text_collate(tok, lm_labels=False)

    def collate_sentiment(items):
        return {**texts([t for t, _ in items]), "labels": torch.tensor([y for _, y in items])}

    def bce(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.binary_cross_entropy_with_logits(logits.squeeze(-1).float(), batch["labels"])

    return {
        "lm": Task(tiny.model_path(), tiny.corpus()[:64], text_collate(tok), tokenizer=tok),
        "classifier": Task(tiny.model_path("reward"), sentiment_items(32, seed=0), collate_sentiment, bce,
                           model_cls=AutoModelForSequenceClassification, tokenizer=tok),
    }


def trainer(tmp: Path, name: str, **kw) -> MultiTrainer:
    # The LM's own clipping threshold; the classifier's comes from max_grad_norm (1.0).
    lm_config = {**dsconfig.read_config("zero2_train"), "gradient_clipping": 0.5}
    settings = {"logging_steps": 1, "save_steps": None, **kw}  # a row each step; checkpoints only where asked
    cfg = MultiConfig(output_dir=str(tmp / name), role_configs={"lm": lm_config, "classifier": "zero3_train"},
                      per_device_train_batch_size=4, learning_rate=3e-3, learning_rates={"classifier": 1e-3},
                      max_steps=4, disable_tqdm=True, **settings)
    return MultiTrainer(tasks(), args=cfg)


def train(t: MultiTrainer) -> list[dict]:
    t.train()
    return t.state.log_history


def state(t: MultiTrainer) -> dict[str, dict[str, torch.Tensor]]:
    # A trained ZeRO-3 role's full weights are consolidated on rank 0 only (None elsewhere).
    return {name: {k: v.float().clone() for k, v in (t.session.state_dict(name) or {}).items()} for name in t.tasks}


def moved(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=float("nan"))


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res = {}
    t = trainer(tmp, "isolation")
    s = t.session
    lm = s.engines["lm"].module
    res["world"], res["stages"] = s.num_processes, [s.zero_stage("lm"), s.zero_stage("classifier")]
    res["clf_local"], res["clf_full"] = s.numel_at_rest("classifier")
    res["lm_whole"] = all(not hasattr(p, "ds_id") and p.numel() > 0 for p in lm.parameters())
    res["clipping"] = {name: s.engines[name].gradient_clipping() for name in t.tasks}
    res["accelerators_distinct"] = s._accelerators["lm"] is not s._accelerators["classifier"]
    before = state(t)
    t.train_step("lm")
    after_lm = state(t)
    t.train_step("classifier")
    after_clf = state(t)
    res["lm_step"] = {"lm": moved(before["lm"], after_lm["lm"]),
                      "classifier": moved(before["classifier"], after_lm["classifier"])}
    res["clf_step"] = {"lm": moved(after_lm["lm"], after_clf["lm"]),
                       "classifier": moved(after_lm["classifier"], after_clf["classifier"])}
    res["lrs"] = {name: s.learning_rate(name) for name in t.tasks}

    full = train(trainer(tmp, "full", save_steps=2))
    resumed = train(trainer(tmp, "resumed", resume_from_checkpoint=str(tmp / "full" / "checkpoint-2")))
    keys = ("lm/loss", "classifier/loss", "lm/grad_norm", "classifier/grad_norm", "lm/learning_rate",
            "classifier/learning_rate")
    res["full"] = {k: [h[k] for h in full] for k in keys}
    res["resumed"] = {k: [h[k] for h in resumed] for k in keys}
    res["steps"] = {"full": [h["step"] for h in full], "resumed": [h["step"] for h in resumed]}
    ckpt = tmp / "full" / "checkpoint-2"
    res["checkpoint"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("*/*") if p.parent.name != "state")
    res["state"] = sorted(p.name for p in (ckpt / "state").iterdir())
    if s.is_main_process:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
