"""Separate generation ranks on 3 CPU processes over gloo: ranks 0 and 1 train, rank 2 only generates
(tests/test_generation_ranks.py launches it once and reads its JSON). One Session with generation_processes=1:
ZeRO-2, ZeRO-3 and LoRA (ZeRO-2) trained roles and a frozen ZeRO-3 reference, engines over the training ranks;
weight syncs in small buckets before and after an SGD step; the rollout channel; training-rank reductions; a
checkpoint saved and restored by the training ranks alone; then GRPO over the layout (generation_ranks_grpo.py).
fp32; every rank's results end in one JSON."""

import json
import random
import sys
import time
from pathlib import Path

import generation_ranks_grpo  # beside this script
import torch
import torch.distributed as dist

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.placement import ranks
from posttrain.placement.dsconfig import read_config
from posttrain.placement.generation_ranks import deepspeed_world_size, dp_world_size
from posttrain.placement.group_channel import GroupReceiver, GroupSender, RolloutGroup
from posttrain.placement.weight_sync import WeightReceiver, WeightSender

BUCKET = 32 << 10  # below the embedding's and each MLP matrix's bytes, above the attention projections'
LR = 0.1
SGD_OK = {"zero_allow_untested_optimizer": True}
ORDER = [3, 0, 5, 1, 7, 2, 6, 4]  # the generation rank's groups complete out of order


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def made_group(index: int) -> RolloutGroup:
    """A group whose every value follows from its index (and whose length differs by index)."""
    length = 3 + index
    ids = torch.arange(2 * length).view(2, length)
    return RolloutGroup(index, version=index // 3, prompt_ids=torch.arange(8).view(2, 4) + 100 * index,
                        completion_ids=ids + 1000 * index, completion_mask=(ids % 3 != 0),
                        sampling_logps=-ids.float() / (index + 1),
                        extras={"token_versions": torch.full((2, length), index // 3)})


def group_equal(a: RolloutGroup, b: RolloutGroup) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return (a.index, a.version) == (b.index, b.version) and ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def max_diff(copy: torch.nn.Module, ref: dict) -> float:
    return max((p.detach() - ref[n]).abs().max().item() for n, p in copy.named_parameters())


def measure_gathers(sender: WeightSender, module: torch.nn.Module) -> list[int]:
    """The bytes each of the sender's ZeRO-3 gathers makes whole beyond what already was (filled as it sends)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held, gathered = [], sender._gathered

    def whole_bytes() -> int:
        return sum(p.ds_numel * 4 for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE)

    class Measured:
        def __init__(self, params: list) -> None:
            self.ctx, self.before = gathered(params), 0

        def __enter__(self) -> None:
            self.before = whole_bytes()
            self.ctx.__enter__()
            held.append(whole_bytes() - self.before)

        def __exit__(self, *exc: object) -> None:
            self.ctx.__exit__(*exc)

    sender._gathered = Measured
    return held


def send_ref(s: Session, name: str) -> dict | None:
    """Training rank 0's gathered full weights of ``name``, handed to the generation rank (collective)."""
    sd = s.state_dict(name)
    box = [sd if s.process_index == 0 else None]
    if s.process_index == 0:
        dist.broadcast_object_list(box, src=0, group=s.groups.sync)
    return sd


def recv_ref(s: Session) -> dict:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=s.groups.sync)
    return box[0]


def trainer_side(s: Session, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    rank, res = s.process_index, {}
    path = tiny.model_path()
    tok = tiny.load_tokenizer(path)
    text = tiny.corpus()[rank * 2: rank * 2 + 2]
    batch = dict(tok(text, return_tensors="pt", padding=True))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for name in ("z2", "z3", "lora"):
        model = s.load(name, path)
        if name == "lora":
            torch.manual_seed(0)
            model = lora(model)
        engine = s.prepare(name, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR))
        sender = WeightSender(s.groups, engine.module, bucket_bytes=BUCKET)
        out = {"dp_world": dp_world_size(engine), "deepspeed_world": deepspeed_world_size()}
        if name == "z3":
            held = measure_gathers(sender, engine.module)
            out["shard_fraction"] = sum(p.ds_tensor.numel() for p in engine.module.parameters()) / sum(
                p.ds_numel for p in engine.module.parameters())
        first = sender.send(0, include_frozen=name != "lora")
        send_ref(s, name)
        loss = engine(**batch, labels=labels).loss
        s.backward(name, loss)
        stepped = s.step(name)
        second = sender.send(1)
        send_ref(s, name)
        if name == "z2":
            sender.end()
        out.update(stepped=stepped, messages=[first.messages, second.messages], sharded=sender.sharded,
                   largest_param=max(e.nbytes for e in sender.plans.entries),
                   params=len(sender.plans.entries), trained=sum(e.trained for e in sender.plans.entries))
        if name == "z3":
            out["gathered_per_bucket"] = held
        res[name] = out
    # The frozen reference: ZeRO-3 over the training ranks (posttrain's fast path takes over its gathering).
    ref = s.prepare("ref", s.load("ref", path))
    with torch.no_grad():
        logits = ref(**batch).logits
        want = AutoModelForCausalLM.from_pretrained(path)(**batch).logits
    res["ref"] = {"group_size": dist.get_world_size(next(s.unwrap("ref").parameters()).ds_process_group),
                  "diff": (logits - want).abs().max().item(), "fast": "ref" in s.fast_frozen}
    # The channel: this rank's groups, in increasing index, whatever order they completed in.
    receiver = GroupReceiver(s.groups)
    got = [receiver.receive() for _ in range(len(ORDER) // s.num_processes)]
    res["channel"] = {"indices": [g.index for g in got], "equal": [group_equal(g, made_group(g.index)) for g in got],
                      "versions": [g.version for g in got]}
    # Reductions over the training ranks only (the generation rank takes no part).
    mine = torch.tensor([float(rank + 1)])
    res["reductions"] = {"num_processes": s.num_processes, "sum": ranks.sum_over_ranks(s, mine).item(),
                         "gather": ranks.gather_ranks(s, mine).tolist(),
                         "mean": ranks.mean_over_ranks(s, {"x": rank + 1.0})["x"],
                         "objects": ranks.gather_objects(s, [rank]),
                         "padded": ranks.pad_across_ranks(s, torch.ones(rank + 1), pad_index=0.0).tolist()}
    # A checkpoint: DeepSpeed's group-less barriers in save_checkpoint run over the training ranks.
    before = {n: p.detach().clone() for n, p in s.unwrap("z2").named_parameters()}
    s.save_state(tmp / "ckpt", extra={"step": 1})
    with torch.no_grad():
        for p in s.unwrap("z2").parameters():
            p.add_(1.0)
    extra = s.load_state(tmp / "ckpt")
    res["checkpoint"] = {"extra": extra, "restored": all(torch.equal(p, before[n])
                                                         for n, p in s.unwrap("z2").named_parameters())}
    return res


def generator_side(s: Session) -> dict:
    res = {}
    path = tiny.model_path()
    for name in ("z2", "z3", "lora"):
        copy = s.load(name, path)
        if name == "lora":
            torch.manual_seed(1)  # adapters unlike the trained ones until the first sync
            copy = lora(copy)
        receiver = WeightReceiver(s.groups, copy)
        ptrs = {n: p.data_ptr() for n, p in copy.named_parameters()}
        waited = 0
        while not receiver.ready():  # the decode loop's poll, between steps
            waited += 1
            time.sleep(0.01)
        versions = [receiver.receive()]
        ref0 = recv_ref(s)
        diff0 = max_diff(copy, ref0)
        versions.append(receiver.receive())
        ref1 = recv_ref(s)
        if name == "z2":
            versions.append(receiver.receive())
        res[name] = {"versions": versions, "diff_v0": diff0, "diff_v1": max_diff(copy, ref1),
                     "moved": max((ref1[k] - ref0[k]).abs().max().item() for k in ref0),
                     "in_place": all(p.data_ptr() == ptrs[n] for n, p in copy.named_parameters()),
                     "messages": [receiver.last.messages], "polls": waited, "ended": receiver.ended,
                     "dtype": str(next(copy.parameters()).dtype), "plain": not any(
                         hasattr(p, "ds_id") for p in copy.parameters())}
        if name == "lora":  # the base weights never moved: only adapters were sent
            base = {k: v for k, v in ref1.items() if "lora_" not in k}
            res[name]["base_equal"] = all(torch.equal(dict(copy.named_parameters())[k], v) for k, v in base.items())
    sender = GroupSender(s.groups)
    res["channel"] = {"left": [sender.put(made_group(i)) for i in ORDER]}
    sender.wait()
    res["channel"]["held_after"] = len(sender.held)
    res["refused"] = {}
    for what, call in (("prepare", lambda: s.prepare("z2", copy)), ("frozen", lambda: s.load("ref", path)),
                       ("reduce", lambda: ranks.sum_over_ranks(s, torch.ones(1)))):
        try:
            call()
            res["refused"][what] = None
        except Exception as err:  # noqa: BLE001 - the message is the result
            res["refused"][what] = f"{type(err).__name__}: {err}"
    return res


def main(out: str, tmp: str) -> None:
    start = time.perf_counter()
    random.seed(0)
    roles = [Role("z2", {**read_config("zero2_train"), **SGD_OK}, trains=True, decoded=True),
             Role("z3", {**read_config("zero3_train"), **SGD_OK}, trains=True),
             Role("lora", {**read_config("zero2_train"), **SGD_OK}, trains=True),
             Role("ref", "zero3_inference")]
    s = Session(roles, micro_batch_size=2, max_grad_norm=None, generation_processes=1)
    res = {"rank": dist.get_rank(), "world": dist.get_world_size(), "generates": s.generates}
    res.update(generator_side(s) if s.generates else trainer_side(s, Path(tmp)))
    res["seconds"] = round(time.perf_counter() - start, 1)
    s.close()
    res["grpo"] = generation_ranks_grpo.main(str(Path(tmp) / "grpo"))  # the trainer over this layout
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, res)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
