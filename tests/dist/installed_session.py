"""Run by test_package.py from a temp dir with the installed wheel: a two-process session on the
tiny default with the presets named, as a user's script would; rank 0 writes what it saw as JSON."""

import json
import math
import os
import sys

import torch

import posttrain
from posttrain import Session, roles_for
from posttrain.demo import tiny


def lm_loss(model, batch):
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(**batch, labels=labels).loss


def main(out: str) -> None:
    roles = roles_for(["policy"], ["reference"])  # the default mix: presets zero2_train, zero3_inference
    session = Session(roles, micro_batch_size=4, gradient_accumulation_steps=1)
    path = tiny.model_path()
    tok = tiny.load_tokenizer(path)
    policy = session.load("policy", path)
    policy = session.prepare("policy", policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
    reference = session.prepare("reference", session.load("reference", path))

    batch = tok(tiny.corpus()[:4], return_tensors="pt", padding=True).to(session.device)
    loss_before = lm_loss(policy, batch)
    session.backward("policy", loss_before)
    session.step("policy")
    with torch.no_grad():
        loss_after = lm_loss(policy, batch).item()
        with session.activate("reference"):
            reference_loss = lm_loss(reference, batch).item()

    if session.is_main_process:
        result = {
            "world": session.num_processes,
            "posttrain_file": posttrain.__file__,
            "configs": {r.name: r.config for r in roles},
            # As the engines report it, not as the config says.
            "stages": {"policy": policy.zero_optimization_stage(), "reference": reference.zero_optimization_stage()},
            "loss_before": loss_before.item(),
            "loss_after": loss_after,
            "reference_loss": reference_loss,
            "finite": all(math.isfinite(x) for x in (loss_before.item(), loss_after, reference_loss)),
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
        }
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
