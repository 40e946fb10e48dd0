"""Two or more processes, bf16 gradients and fp32 master weights, the policy under ZeRO-2 and under
ZeRO-3: posttrain's DPO with and without zero_fixes.cast_grads_while_flattening, on the same pairs;
rank 0 writes the losses, grad norms and how often each rank's partition was cast while flattened
(tests/test_precision.py)."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from posttrain.demo import synthetic, tiny
from posttrain.placement import session as session_module
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


def run(tmp: Path, cast: bool, policy: str) -> dict:
    original = session_module.cast_grads_while_flattening
    if not cast:
        session_module.cast_grads_while_flattening = lambda optimizer: False
    try:
        cfg = DPOConfig(output_dir=str(tmp / f"cast-{cast}-{policy}"), overwrite_output_dir=True, max_steps=4, learning_rate=1e-3,
                        per_device_train_batch_size=2, logging_steps=1, gradient_checkpointing=False,
                        disable_tqdm=True, bf16=True, seed=0, master_weights="fp32",
                        role_configs={"policy": policy})
        trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)), args=cfg,
                             train_dataset=synthetic.preference_pairs(8, seed=3))
        zero = trainer.session.engines["policy"].optimizer
        trainer.train()
        history = trainer.state.log_history
        casts = [0] * dist.get_world_size()
        dist.all_gather_object(casts, getattr(zero, "posttrain_flat_casts", 0))
        return {"losses": [h["loss"] for h in history if "loss" in h],
                "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
                "flat_casts": casts, "stage": trainer.session.zero_stage("policy")}
    finally:
        session_module.cast_grads_while_flattening = original


def main(out: str, tmp: str) -> None:
    res = {f"{policy}-{cast}": run(Path(tmp), cast, policy) for policy in ("zero2_train", "zero3_train")
           for cast in (True, False)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:])
