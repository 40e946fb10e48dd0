"""posttrain's DPO loss and metrics on a Session (ZeRO-2 policy, ZeRO-3 reference, two processes),
for each case of tests/test_dpo.py::CASES, on one fixed batch, padding-free and padded; rank 0 writes them as
JSON."""

import json
import sys
from dataclasses import replace

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from test_dpo import CASES, conversational, parity_rows  # noqa: E402

from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


def run_case(trainer: DPOTrainer, batch: dict) -> dict:
    with torch.no_grad():
        loss, pairs, tok = trainer.compute_loss(batch)
    out = {"loss": loss.item(), **{k: v.mean().item() for k, v in pairs.items() if k != "loss"}}
    out.update({k: a / b for k, (a, b) in tok.items()})
    return out


def main(out: str, tmp: str) -> None:
    rows = parity_rows()
    cfg = DPOConfig(output_dir=tmp, per_device_train_batch_size=4, mix="zero2-zero3", disable_tqdm=True)
    trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)), args=cfg,
                         train_dataset=rows)
    res = {"world": trainer.session.num_processes, "ref_stage": trainer.session.zero_stage("reference"),
           "policy_stage": trainer.session.zero_stage("policy")}
    standard = trainer.collate(trainer.train_rows[:4])
    conv_rows = preference.prepare_preference_dataset(conversational(rows), trainer.tokenizer)
    conv = trainer.collate(conv_rows[:4])
    res["input_ids"] = {"standard": standard["input_ids"].tolist(), "conversational": conv["input_ids"].tolist()}
    base = trainer.cfg
    assert base.padding_free  # posttrain's default: the cases run on packed rows, and again padded
    res["padded"] = {}
    for name, fields, fmt in CASES:
        batch = conv if fmt == "conversational" else standard
        trainer.cfg = replace(base, **fields)
        res[name] = run_case(trainer, batch)
        trainer.cfg = replace(base, **fields, padding_free=False)
        res["padded"][name] = run_case(trainer, batch)
    if trainer.session.is_main_process:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
