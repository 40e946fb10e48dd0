"""One process: trained roles without a DeepSpeed engine (posttrain.placement.plain) against the DeepSpeed
ZeRO-2 path, in fp32 with gradient accumulation and clipping that engages (DPO and GRPO on the
tiny default; DPO's torch side and GRPO's DeepSpeed side are what single_process_engine auto
picks at fp32 master weights); checkpoint + resume on the torch path; resuming across the two engines refused;
writes JSON for tests/test_plain.py."""

import json
import shutil
import sys
from pathlib import Path

from posttrain.demo import synthetic, tiny
from posttrain.errors import ConfigError
from posttrain.scripts.data import bundled_prompts
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def weights(session, role: str) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in session.state_dict(role).items()}


def dpo(tmp: Path, name: str, engine: str, **kw) -> tuple[DPOTrainer, list[dict]]:
    fields = dict(output_dir=str(tmp / name), overwrite_output_dir=True, max_steps=3, learning_rate=1e-3,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.05, logging_steps=1,
                  save_strategy="no", disable_tqdm=True, seed=0, single_process_engine=engine)
    trainer = DPOTrainer(str(tiny.model_path(seed=0)), ref_model=str(tiny.model_path(seed=1)),
                         args=DPOConfig(**{**fields, "save_strategy": "steps" if "save_steps" in kw else "no", **kw}),
                         train_dataset=synthetic.preference_pairs(16, seed=3))
    trainer.train()
    return trainer, trainer.state.log_history


def grpo(tmp: Path, engine: str) -> tuple[GRPOTrainer, list[dict]]:
    cfg = GRPOConfig(output_dir=str(tmp / f"grpo-{engine}"), overwrite_output_dir=True, learning_rate=3e-3,
                     per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                     gradient_accumulation_steps=2, max_steps=2, beta=0.04, max_grad_norm=0.05, logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=7, single_process_engine=engine)
    trainer = GRPOTrainer(str(tiny.sft_model_path()), reward_funcs="posttrain.demo.synthetic.sentiment_reward",
                          args=cfg, train_dataset=bundled_prompts(2048, cfg.seed))  # `posttrain grpo`'s prompts
    trainer.train()
    return trainer, trainer.state.log_history


def compare(runs: dict, role: str) -> dict:
    (ta, ha), (tb, hb) = runs["torch"], runs["deepspeed"]
    wa, wb = weights(ta.session, role), weights(tb.session, role)
    return {"kinds": [ta.session.engine_kind(role), tb.session.engine_kind(role)],
            "losses": [[h["loss"] for h in ha if "loss" in h], [h["loss"] for h in hb if "loss" in h]],
            "grad_norms": [[h["grad_norm"] for h in ha if "grad_norm" in h], [h["grad_norm"] for h in hb if "grad_norm" in h]],
            "weights_max_diff": max((wa[k] - wb[k]).abs().max().item() for k in wa),
            "weights_moved": max((wa[k] - weights_before[role][k]).abs().max().item() for k in wa)}


weights_before: dict = {}


def main(out: str, tmp: str) -> None:
    tmp = Path(tmp)
    res: dict = {}
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0))
    weights_before["policy"] = {k: v.float().clone() for k, v in base.state_dict().items()}
    # fp32 master weights under auto: the torch path for DPO (no rollouts), DeepSpeed for GRPO (its
    # rollouts decode the policy); the other side of each pair is forced.
    res["dpo"] = compare({"torch": dpo(tmp, "dpo-torch", "auto"), "deepspeed": dpo(tmp, "dpo-deepspeed", "deepspeed")},
                         "policy")
    card = (tmp / "dpo-torch" / "README.md").read_text()
    res["card_says_torch"] = "no DeepSpeed engine" in card

    runs = {"torch": grpo(tmp, "torch"), "deepspeed": grpo(tmp, "auto")}
    base = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path())
    weights_before["policy"] = {k: v.float().clone() for k, v in base.state_dict().items()}
    res["grpo"] = compare(runs, "policy")

    # Resume on the torch path: 4 steps saved at 2, and a run resumed from that checkpoint.
    _, full = dpo(tmp, "resume-full", "torch", max_steps=4, save_steps=2)
    (tmp / "resume-part").mkdir()
    shutil.copytree(tmp / "resume-full" / "checkpoint-2", tmp / "resume-part" / "checkpoint-2")
    _, resumed = dpo(tmp, "resume-part", "torch", max_steps=4, save_steps=2, overwrite_output_dir=False,
                     resume_from_checkpoint="latest")
    res["resume"] = {"full": [(h["loss"], h["grad_norm"]) for h in full if "loss" in h][2:],
                     "resumed": [(h["loss"], h["grad_norm"]) for h in resumed if "loss" in h]}
    # A checkpoint of one engine resumed by the other: one sentence, before training.
    res["cross"] = {}
    for saved, engine in (("resume-full", "deepspeed"), ("dpo-deepspeed", "torch")):
        if saved == "dpo-deepspeed":
            dpo(tmp, "ds-ckpt", "deepspeed", max_steps=2, save_steps=2)
            saved = "ds-ckpt"
        try:
            dpo(tmp, saved, engine, max_steps=4, overwrite_output_dir=False, resume_from_checkpoint="latest")
            res["cross"][engine] = None
        except ConfigError as err:
            res["cross"][engine] = str(err)
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:])
