"""Checks at any world size (tests/test_world_sizes.py runs them at 3 ranks, where every shard is
uneven, and at 4): frozen ZeRO-3 outputs (posttrain's fast path and DeepSpeed's own, with and
without ``stage3_module_granularity_threshold``, untied and tied embeddings) against the unsharded
model; one ZeRO-3 training step against ZeRO-2 and a plain model; DPO and PPO losses across the
mixes. One launch, one Session for the model checks; rank 0 writes JSON. fp32 on CPU."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# tests/dist is this script's directory: the 2-rank scripts' runs are reused, not copied.
from dpo_train import run as dpo_run
from kto_train import run as kto_run
from ppo_run import BASE as PPO_BASE
from ppo_run import prompts as ppo_prompts

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.placement.dsconfig import read_config
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

MIXES = ["zero2-zero3", "zero2-replicated", "zero3", "zero2-zero3-stock"]
PPO_COMPARED = ["objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "loss/value_avg",
                "policy/approxkl_avg", "val/clipfrac_avg"]
LR = 0.1


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def with_keys(preset: str, **zero: object) -> dict:
    cfg = read_config(preset)
    cfg["zero_optimization"].update(zero)
    return cfg


def rank_batch(tok, rank: int, rows: int = 4) -> dict:
    """This rank's rows of the corpus (ranks differ, as in data-parallel training), padded."""
    text = tiny.corpus()[rank * rows: (rank + 1) * rows]
    return dict(tok(text, return_tensors="pt", padding=True))


def model_checks(tmp: Path) -> dict:
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoConfig, AutoModelForCausalLM

    path, tied_path = tiny.model_path(), tmp / "tied"
    # ZeRO refuses optimizers other than Adam(W)/Lion unless told: SGD keeps the updated weights an
    # exact function of the gradient (Adam's first step is about lr * sign(g), so noise-level
    # gradients would decide it).
    sgd_ok = {"zero_allow_untested_optimizer": True}
    threshold = with_keys("zero3_inference", stage3_module_granularity_threshold=int(1e8))
    roles = [Role("z2", {**read_config("zero2_train"), **sgd_ok}, trains=True),
             Role("z3", {**read_config("zero3_train"), **sgd_ok}, trains=True)]
    for suffix in ("", "_tied"):
        roles += [Role(f"fast{suffix}", "zero3_inference", fast_frozen=True),
                  Role(f"stock{suffix}", "zero3_inference", fast_frozen=False),
                  Role(f"stock_threshold{suffix}", threshold, fast_frozen=False)]
    s = Session(roles, micro_batch_size=4, max_grad_norm=1.0)
    rank, world = s.process_index, s.num_processes
    if rank == 0:  # a tied-embedding variant of the tiny model (lm_head.weight is embed_tokens.weight)
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, tie_word_embeddings=True)).save_pretrained(tied_path)
    s.accelerator.wait_for_everyone()
    tok = tiny.load_tokenizer(path)
    res: dict = {"world": world}
    b = rank_batch(tok, rank)
    diffs: dict[str, float] = {}

    # -- frozen: every placement's logits against the unsharded model, twice (the second forward
    # prefetches along the first one's order, in both DeepSpeed's path and posttrain's)
    for suffix, src in (("", path), ("_tied", tied_path)):
        plain = AutoModelForCausalLM.from_pretrained(src).eval()
        with torch.no_grad():
            want = plain(**b).logits
            for kind in ("fast", "stock", "stock_threshold"):
                engine = s.prepare(f"{kind}{suffix}", s.load(f"{kind}{suffix}", src))
                for i in range(2):
                    diffs[f"{kind}{suffix}_{i}"] = max_diff(engine(**b).logits, want)
        if suffix == "_tied":
            res["tied_is_tied"] = plain.lm_head.weight is plain.model.embed_tokens.weight
    # The layouts really are uneven: DeepSpeed pads per-parameter partitions whose size the world
    # does not divide, and the fast path's slices cut through parameters, which then come from
    # two or more ranks.
    from deepspeed.utils import z3_leaf_module

    # The threshold took effect: DeepSpeed made modules leaves (gathered whole, its
    # fast_sharding_for_leaf_module path); without the key none are.
    res["leaf_modules"] = {k: sum(map(z3_leaf_module, s.engines[k].module.modules()))
                           for k in ("stock", "stock_threshold", "stock_threshold_tied")}
    stock = s.engines["stock"].module
    res["stock_uneven_params"] = sum(int(p.ds_numel % world != 0) for p in stock.parameters())
    ff = s.fast_frozen["fast"]
    res["fast_straddling_params"] = sum(
        int(any(o < r * g.shard_numel < o + n for r in range(1, world)))
        for g in ff.groups for o, n in zip(g.offsets, g.numels))
    res["fast_groups"] = len(ff.groups)

    # -- trained: one ZeRO-3 step against ZeRO-2 and a plain model (loss, full gradient, weights)
    plain = AutoModelForCausalLM.from_pretrained(path)
    engines = {}
    for name in ("z2", "z3"):
        model = s.load(name, path)
        engines[name] = s.prepare(name, model, torch.optim.SGD(model.parameters(), lr=LR))
    labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    grads, losses = {}, {}
    for name, engine in engines.items():
        loss = engine(**b, labels=labels).loss
        s.backward(name, loss)
        losses[name] = loss.item()
        grads[name] = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        s.step(name)
    # The plain model: DeepSpeed averages the ranks' gradients, so its loss is the mean of every
    # rank's loss on that rank's rows; gradient clipping and SGD as the engines do them.
    loss_here = plain(**b, labels=labels).loss
    total = sum(plain(**rb, labels=rb["input_ids"].masked_fill(rb["attention_mask"] == 0, -100)).loss
                for rb in (rank_batch(tok, r) for r in range(world))) / world
    total.backward()
    want_grads = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(p.grad, alpha=-LR)
    diffs["loss_z3_vs_z2"] = abs(losses["z3"] - losses["z2"])
    diffs["loss_z2_vs_plain"] = abs(losses["z2"] - loss_here.item())
    for name in ("z2", "z3"):
        diffs[f"grad_{name}_vs_plain"] = max(max_diff(grads[name][n], g) for n, g in want_grads.items())
    diffs["grad_z3_vs_z2"] = max(max_diff(grads["z3"][n], g) for n, g in grads["z2"].items())
    res["grad_scale"] = max(g.abs().max().item() for g in want_grads.values())
    res["grad_names_equal"] = set(grads["z2"]) == set(grads["z3"]) == set(want_grads)
    stepped = {name: s.state_dict(name) for name in ("z2", "z3")}  # the z3 one on rank 0 only
    want_sd = plain.state_dict()
    if rank == 0:
        for name, sd in stepped.items():
            diffs[f"weights_{name}_vs_plain"] = max(max_diff(sd[k], v) for k, v in want_sd.items())
        res["weights_moved"] = max(max_diff(want_sd[k], v) for k, v in
                                   AutoModelForCausalLM.from_pretrained(path).state_dict().items())
    # Every rank's differences: a wrong gather may show on one rank only.
    every: list = [None] * world
    dist.all_gather_object(every, diffs)
    res["diffs"] = {k: max(d.get(k, 0.0) for d in every) for k in every[0]}
    res["diffs"].update({k: v for k, v in diffs.items() if k.startswith("weights_")})
    for name in list(s.engines):
        if not s.role(name).trains:
            s.release(name)
    return res


def jit_checkpoint_check(tmp: Path) -> dict:
    """enable_jit_checkpoint when SIGTERM reaches rank 1 alone, during step 2: every rank saves checkpoint-2 and
    stops; resumed, the run logs what the uninterrupted one does."""
    import os
    import signal

    from transformers import TrainerCallback

    class Sigterm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    try:
        kto_run(tmp / "kto", "jit", callbacks=[Sigterm()], enable_jit_checkpoint=True)
        stopped = False
    except KeyboardInterrupt:
        stopped = True
    saved = sorted(p.name for p in (tmp / "kto" / "jit").glob("checkpoint-*"))
    return {"stopped": stopped, "checkpoints": saved, "resumed": kto_run(tmp / "kto", "jit", resume_from_checkpoint="latest")}


def main(out: str, tmp: str) -> None:
    tmp, start = Path(tmp), time.perf_counter()
    res = model_checks(tmp)
    world, seconds = res["world"], {"models": time.perf_counter() - start}
    # DPO: the 2-rank test's run (tests/dist/dpo_train.py), fewer steps.
    res["dpo"] = {mix: dpo_run(tmp / "dpo", mix, mix=mix, max_steps=3)[1]["losses"] for mix in MIXES}
    seconds["dpo"] = time.perf_counter() - start - sum(seconds.values())
    # PPO: the 2-rank test's settings (tests/dist/ppo_run.py), two updates of 16 rollouts per rank; at 3 ranks
    # only (every shard uneven), which keeps the suite's time: 4 ranks run issue 15's gathering checks and DPO.
    res["ppo"] = {}
    for mix in MIXES if world == 3 else ():
        cfg = PPOConfig(**{**PPO_BASE, "mix": mix, "total_episodes": 2 * 16 * world,
                           "output_dir": str(tmp / "ppo" / mix)})
        trainer = PPOTrainer(args=cfg, model=str(tiny.sft_model_path()), reward_model=str(tiny.reward_model_path()),
                             train_dataset=ppo_prompts(cfg))
        trainer.train()
        res["ppo"][mix] = [{k: row[k] for k in PPO_COMPARED} for row in trainer.state.log_history]
    seconds["ppo"] = time.perf_counter() - start - sum(seconds.values())
    # KTO at 3 ranks: its KL estimate is averaged over the ranks' micro-batches each step.
    res["kto"] = {mix: kto_run(tmp / "kto", mix, mix=mix) for mix in (MIXES if world == 3 else ())}
    if world == 3:
        res["jit"] = jit_checkpoint_check(tmp)
    seconds["kto"] = time.perf_counter() - start - sum(seconds.values())
    res["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
