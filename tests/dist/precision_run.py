"""One process, bf16 mixed precision: posttrain's DPO with bf16 master weights and optimizer states
(DeepSpeed with the one-process shared master, DeepSpeed's own master copy, and the torch path
without an engine), with fp32 ones (DeepSpeed, and the torch path with an autocast forward), and
TRL's DPOTrainer on a bf16 model (AdamW on bf16 parameters) and on an fp32 model, on the same 4
pairs every step; writes the losses, grad norms and checks as JSON (tests/test_precision.py)."""

import json
import sys
from pathlib import Path

import torch

from posttrain.demo import synthetic, tiny
from posttrain.placement import session as session_module
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

STEPS, LR = 6, 1e-3  # a learning rate whose updates bf16 weights can hold


def settings(tmp: Path, name: str) -> dict:
    # padding_free off: the runs are compared with TRL's bf16 numerics, and TRL's DPOTrainer pads (packed bf16
    # rows round differently; tests/test_padding_free.py checks packed against padded in fp32).
    return dict(output_dir=str(tmp / name), overwrite_output_dir=True, max_steps=STEPS, learning_rate=LR,
                per_device_train_batch_size=4, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
                bf16=True, seed=0, padding_free=False)


def posttrain_run(tmp: Path, rows: list, master_weights: str, share: bool = True, cast: bool = True) -> dict:
    """``share``/``cast`` False: without zero_fixes' shared bf16 master / its cast while flattening."""
    original, original_cast = session_module.share_bf16_master, session_module.cast_grads_while_flattening
    if not share:
        session_module.share_bf16_master = lambda optimizer: False
    if not cast:
        session_module.cast_grads_while_flattening = lambda optimizer: False
    try:
        cfg = DPOConfig(master_weights=master_weights, single_process_engine="deepspeed",
                        **settings(tmp, f"{master_weights}-{share}-{cast}"))
        trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)), args=cfg,
                             train_dataset=rows)
        s = trainer.session
        engine = s.engines["policy"]
        zero = engine.optimizer
        master = zero.single_partition_of_fp32_groups[0]
        param = next(engine.module.parameters())
        flat = zero.bit16_groups_flat[0]
        trainer.train()
        history = trainer.state.log_history
        states = [t for st in zero.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        return {"losses": [h["loss"] for h in history if "loss" in h],
                "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
                "master_dtype": str(master.dtype), "state_dtypes": sorted({str(t.dtype) for t in states}),
                "fused": zero.optimizer.param_groups[0]["fused"], "flat_casts": getattr(zero, "posttrain_flat_casts", 0),
                "master_is_weights": master.data_ptr() == flat.data_ptr(),
                "param_in_flat": flat.data_ptr() <= param.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size(),
                "recorded": s.master_weights("policy"), "reference_stage": s.zero_stage("reference"),
                "policy_zero": {k: s.configs["policy"]["zero_optimization"].get(k) for k in ("overlap_comm", "reduce_scatter")},
                "one_rank_changes": s.one_rank_changes,
                "config_json": json.loads((tmp / f"{master_weights}-{share}-{cast}" / "posttrain_config.json").read_text()).get("master_weights")}
    finally:
        session_module.share_bf16_master, session_module.cast_grads_while_flattening = original, original_cast


def torch_run(tmp: Path, rows: list, master_weights: str) -> dict:
    """The torch path (posttrain.placement.plain): the model itself and torch's fused AdamW, no engine; DPO
    takes it under single_process_engine auto at either precision."""
    cfg = DPOConfig(master_weights=master_weights, single_process_engine="auto", **settings(tmp, f"torch-{master_weights}"))
    trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)), args=cfg,
                         train_dataset=rows)
    s = trainer.session
    trainer.train()
    history = trainer.state.log_history
    opt = s.optimizers["policy"]
    states = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
            "kind": s.engine_kind("policy"), "param_dtypes": sorted({str(p.dtype) for p in s.unwrap("policy").parameters()}),
            "state_dtypes": sorted({str(t.dtype) for t in states}), "fused": opt.param_groups[0]["fused"],
            "recorded": s.master_weights("policy"), "stage": s.zero_stage("policy"),
            "change": s.one_rank_changes["policy"]}


def placement_run(tmp: Path, rows: list, name: str, **fields) -> list[float]:
    """fp32 (no mixed precision) losses under the default mix, simplified or as named (DeepSpeed's
    engine: the simplification is of its configs)."""
    base = {**settings(tmp, name), "bf16": False, "single_process_engine": "deepspeed"}
    trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)),
                         args=DPOConfig(**{**base, **fields}), train_dataset=rows)
    stages = {n: trainer.session.zero_stage(n) for n in trainer.session.roles}
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "stages": stages}


def resume_run(tmp: Path, engine: str) -> dict:
    """bf16 states (DeepSpeed's shared master, or the torch path): 6 steps saved at 3, and a run
    resumed from that checkpoint (copied into a fresh output dir), whose last 3 losses must equal the first's."""
    import shutil

    rows = synthetic.preference_pairs(16, seed=3)

    def cfg(name: str, **kw) -> DPOConfig:
        return DPOConfig(master_weights="bf16", save_steps=3, single_process_engine=engine,
                         **{**settings(tmp, f"{name}-{engine}"), **kw})

    def losses(args: DPOConfig) -> list[float]:
        trainer = DPOTrainer(str(tiny.model_path(seed=0)), args=args, train_dataset=rows)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    full = losses(cfg("resume-full"))
    (tmp / f"resume-part-{engine}").mkdir()
    shutil.copytree(tmp / f"resume-full-{engine}" / "checkpoint-3", tmp / f"resume-part-{engine}" / "checkpoint-3")
    return {"full": full[3:], "resumed": losses(cfg("resume-part", resume_from_checkpoint="latest"))}


def trl_run(tmp: Path, rows: list, dtype: torch.dtype = torch.bfloat16) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig as TrlDPOConfig
    from trl import DPOTrainer as TrlDPOTrainer

    fields = settings(tmp, f"trl-{dtype}")
    fields.pop("overwrite_output_dir")
    args = TrlDPOConfig(**fields, use_cpu=True, report_to=[], save_strategy="no", max_length=1024)
    model = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=1), dtype=dtype)
    trainer = TrlDPOTrainer(model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tiny.load_tokenizer(tiny.model_path(seed=0)))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    states = [t for st in trainer.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "state_dtypes": sorted({str(t.dtype) for t in states})}


def main(out: str, tmp: str) -> None:
    tmp_path = Path(tmp)
    rows = synthetic.preference_pairs(4, seed=3)  # one batch: both sides see the same 4 pairs every step
    # TRL first: after a Session, accelerate's process-wide DeepSpeed settings would make TRL's
    # Trainer run under DeepSpeed (fp32 master weights) instead of plain AdamW on bf16 parameters.
    res = {"trl_bf16": trl_run(tmp_path, rows), "trl_fp32_model": trl_run(tmp_path, rows, torch.float32)}
    res.update({"bf16": posttrain_run(tmp_path, rows, "bf16"),
                "bf16_copy": posttrain_run(tmp_path, rows, "bf16", share=False),
                "fp32": posttrain_run(tmp_path, rows, "fp32"),
                "fp32_flatten_then_cast": posttrain_run(tmp_path, rows, "fp32", cast=False),
                "torch_bf16": torch_run(tmp_path, rows, "bf16"), "torch_fp32": torch_run(tmp_path, rows, "fp32")})
    # The one-process simplification against the same placements named explicitly (kept as given).
    res["fp32_simplified"] = placement_run(tmp_path, rows, "simplified")
    res["fp32_as_named"] = placement_run(tmp_path, rows, "named",
                                         role_configs={"policy": "zero2_train", "reference": "zero3_inference"})
    res["resume"] = resume_run(tmp_path, "deepspeed")
    res["resume_torch"] = resume_run(tmp_path, "torch")
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:])
