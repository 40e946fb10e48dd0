"""TR-DPO's reference sync on two processes: Session.blend for every placement of the target
(fast ZeRO-3, DeepSpeed's ZeRO-3, replicated) and of the source (ZeRO-2, ZeRO-3), then DPO with
sync_ref_model under three mixes and resumed from a checkpoint taken after a sync."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain import Role, Session
from posttrain.demo import synthetic, tiny
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

ALPHA = 0.6
TRAIN = synthetic.preference_pairs(64, seed=0)


def blend_checks() -> dict:
    base, sft = tiny.model_path(), tiny.sft_model_path()
    roles = [Role("policy", "zero2_train", trains=True), Role("policy3", "zero3_train", trains=True),
             Role("fast", "zero3_inference"), Role("stock", "zero3_inference", fast_frozen=False),
             Role("rep", "replicated_inference"), Role("fast2", "zero3_inference")]
    s = Session(roles, micro_batch_size=2)
    for name in ("policy", "policy3"):
        model = s.load(name, sft)
        s.prepare(name, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for name in ("fast", "stock", "rep", "fast2"):
        s.prepare(name, s.load(name, base))
    ref0 = AutoModelForCausalLM.from_pretrained(base).state_dict()
    pol = AutoModelForCausalLM.from_pretrained(sft).state_dict()
    want = {k: (1 - ALPHA) * ref0[k] + ALPHA * pol[k] for k in ref0}
    res = {"fast_used": sorted(s.fast_frozen)}
    for target, source in (("fast", "policy"), ("stock", "policy"), ("rep", "policy"), ("fast2", "policy3")):
        s.blend(target, source, ALPHA)
        got = s.state_dict(target)
        res[f"{target}<-{source}"] = max((got[k] - want[k]).abs().max().item() for k in want)
    # The fast model's forward uses the new weights (its shards, not only the state dict, changed).
    ids = torch.randint(3, 100, (2, 12))
    plain = AutoModelForCausalLM.from_pretrained(base)
    plain.load_state_dict(want)
    with torch.no_grad():
        res["fast_forward_vs_blended"] = (s.engines["fast"](input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()
    res["blend_trained_error"] = None
    try:
        s.blend("policy", "fast", ALPHA)
    except Exception as err:  # noqa: BLE001
        res["blend_trained_error"] = str(err)
    return res


def run(tmp: Path, name: str, **fields) -> dict:
    base = dict(output_dir=str(tmp / name), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                learning_rate=1e-3, max_steps=6, logging_steps=1, max_length=64, disable_tqdm=True,
                sync_ref_model=True, ref_model_mixup_alpha=ALPHA, ref_model_sync_steps=2)
    trainer = DPOTrainer(str(tiny.sft_model_path()), args=DPOConfig(**{**base, **fields}), train_dataset=TRAIN)
    trainer.train()
    history = trainer.state.log_history
    return {"losses": [r["loss"] for r in history if "loss" in r],
            "sync_times": [r.get("time/ref_sync", 0.0) for r in history if "loss" in r]}


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res = {"blend": blend_checks()}
    for mix in ("zero2-zero3", "zero2-replicated", "zero3"):
        res[mix] = run(tmp, mix, mix=mix, save_steps=3 if mix == "zero2-zero3" else None)
    res["no_sync"] = run(tmp, "no_sync", sync_ref_model=False)
    res["resumed"] = run(tmp, "resumed", resume_from_checkpoint=str(tmp / "zero2-zero3" / "checkpoint-3"))
    res["ckpt_reference_files"] = sorted(p.name for p in (tmp / "zero2-zero3" / "checkpoint-3" / "reference").iterdir())
    if torch.distributed.get_rank() == 0:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
