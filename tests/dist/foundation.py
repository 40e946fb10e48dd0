"""Two-process checks of the role layer; writes its findings as JSON (rank 0) for test_foundation.py.

    OUT full CKPT | OUT resume CKPT | OUT_DIR full-then-resume CKPT (both, OUT_DIR/full.json and resume.json)
"""

import json
import sys

import torch

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.errors import ConfigError


def batch(tok, device):
    text = tiny.corpus()[:8]
    enc = tok(text, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in enc.items()}


def lm_loss(model, b):
    labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    return model(**b, labels=labels).loss


def main(out: str, mode: str, ckpt: str) -> None:
    from transformers.integrations import is_deepspeed_zero3_enabled

    path = tiny.model_path()
    tok = tiny.load_tokenizer(path)
    roles = [Role("policy", "zero2_train", trains=True), Role("reference", "zero3_inference")]
    s = Session(roles, micro_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=1.0)
    res = {"world": s.num_processes, "zero3_outside": is_deepspeed_zero3_enabled()}
    torch.manual_seed(0)
    policy = s.load("policy", path)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    policy = s.prepare("policy", policy, opt, sched)
    with s.activate("reference"):
        res["zero3_inside"] = is_deepspeed_zero3_enabled()
        res["active_inside"] = s.active_role
    res["zero3_after"] = is_deepspeed_zero3_enabled()
    try:
        with s.activate("reference"):
            raise KeyError("boom")
    except KeyError:
        pass
    res["active_after_raise"] = s.active_role
    # Errors.
    from transformers import AutoModelForCausalLM

    spare = AutoModelForCausalLM.from_pretrained(path)
    errors = {}
    for key, fn in {
        "unknown_role": lambda: s.activate("critic").__enter__(),
        "frozen_optimizer": lambda: s.prepare("reference", spare, torch.optim.SGD(spare.parameters(), lr=1)),
        "frozen_backward": lambda: s.backward("reference", torch.zeros(())),
    }.items():
        try:
            fn()
            errors[key] = None
        except ConfigError as err:
            errors[key] = str(err)
    res["errors"] = errors
    ref = s.prepare("reference", s.load("reference", path))
    res["ga_after_frozen"] = [s.accelerator.gradient_accumulation_steps, policy.gradient_accumulation_steps()]
    # Partitioning: each rank holds about 1/N of every ZeRO-3 parameter.
    local, full = s.numel_at_rest("reference")
    res["ref_full"], res["ref_local"] = full, local
    res["ref_data_empty"] = s.fast_frozen["reference"].at_rest()
    res["policy_whole"] = all(not hasattr(p, "ds_id") and p.numel() > 0 for p in policy.module.parameters())
    res["policy_numel"] = sum(p.numel() for p in policy.module.parameters())

    b = batch(tok, s.device)
    # The frozen ZeRO-3 model computes what the same weights compute unsharded.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path).to(s.device).eval()
    with torch.no_grad():
        res["ref_vs_plain"] = (ref(**b).logits - plain(**b).logits).abs().max().item()


    losses, lrs = [], []
    start = 0
    if mode == "resume":
        start = s.load_state(ckpt)["step"]
    for step in range(start, 20):
        loss = lm_loss(policy, b)
        s.backward("policy", loss)
        s.step("policy")
        losses.append(loss.item())
        lrs.append(s.learning_rate("policy"))
        if mode == "full" and step == 9:
            s.save_state(ckpt, {"step": 10})
    res["losses"], res["lrs"] = losses, lrs
    with torch.no_grad():
        res["ref_loss"] = lm_loss(ref, b).item()
    if s.is_main_process:
        json.dump(res, open(out, "w"))


if __name__ == "__main__":
    if sys.argv[2] == "full-then-resume":  # both in one launch (one start-up): OUT is a folder
        out, ckpt = sys.argv[1], sys.argv[3]
        main(f"{out}/full.json", "full", ckpt)
        main(f"{out}/resume.json", "resume", ckpt)  # a new Session, everything loaded from ckpt
    else:
        main(*sys.argv[1:])
