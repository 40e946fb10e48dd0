"""Two-process checks of posttrain.placement.frozen (the fast frozen ZeRO-3 forward); rank 0 writes JSON for
tests/test_frozen.py. fp32 on CPU, so outputs must agree to float rounding."""

import json
import sys
from pathlib import Path

import torch

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.errors import ConfigError


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def process_state() -> dict:
    """What a ZeRO-3 model could leave patched for the whole process (and so slow the policy's
    generation and training): functions that zero.Init wraps while it is active, nn.Module's
    methods, and the global module hooks."""
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.modules import module as m

    names = ["empty", "zeros", "ones", "full", "arange", "randn", "rand", "tensor", "empty_like", "zeros_like",
             "matmul", "cat"]
    state = {f"torch.{n}": getattr(torch, n) for n in names}
    state.update({f"F.{n}": getattr(F, n) for n in ("linear", "embedding", "scaled_dot_product_attention")})
    state.update({f"Module.{n}": getattr(nn.Module, n) for n in ("__call__", "_call_impl", "__init__", "_apply",
                                                                  "__getattr__", "__setattr__", "register_parameter")})
    state["Linear.forward"] = nn.Linear.forward
    state["Embedding.forward"] = nn.Embedding.forward
    for hooks in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                  "_global_backward_hooks", "_global_module_registration_hooks",
                  "_global_parameter_registration_hooks", "_global_buffer_registration_hooks"):
        state[hooks] = tuple(getattr(m, hooks).values())
    return state


def greedy(model, ids, mask):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def main(out: str, tmp: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    path = tiny.model_path()
    tok = tiny.load_tokenizer(path)
    # A tied-embedding variant of the tiny model (lm_head.weight is embed_tokens.weight), written
    # once so that every role and the plain copy load the same weights.
    tied_path = Path(tmp) / "tied"
    roles = [Role("policy", "zero2_train", trains=True),
             Role("stock", "zero3_inference", fast_frozen=False),
             Role("fast", "zero3_inference", fast_frozen=True),
             Role("tied", "zero3_inference", fast_frozen=True),
             Role("reward", "zero3_inference", fast_frozen=True),
             Role("bad", "replicated_inference", fast_frozen=True)]
    s = Session(roles, micro_batch_size=4, max_grad_norm=1.0)
    rank, world = s.process_index, s.num_processes
    if rank == 0:
        cfg = AutoConfig.from_pretrained(path, tie_word_embeddings=True)
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tied_path)
    s.accelerator.wait_for_everyone()
    res: dict = {"world": world}

    torch.manual_seed(0)
    policy = s.load("policy", path)
    policy = s.prepare("policy", policy, torch.optim.AdamW(policy.parameters(), lr=3e-3))
    before = process_state()
    stock = s.prepare("stock", s.load("stock", path))
    fast = s.prepare("fast", s.load("fast", path))
    tied = s.prepare("tied", s.load("tied", tied_path))
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    plain_tied = AutoModelForCausalLM.from_pretrained(tied_path).eval()
    res["tied_is_tied"] = plain_tied.lm_head.weight is plain_tied.model.embed_tokens.weight
    try:
        s.prepare("bad", AutoModelForCausalLM.from_pretrained(path))
        res["bad_error"] = None
    except ConfigError as err:
        res["bad_error"] = str(err)

    # Memory at rest: only the local flat slices; no parameter holds other memory (each is a view
    # of this rank's slice or of a freed buffer); DeepSpeed's partitions freed.
    ff = s.fast_frozen["fast"]
    res["fast_local"], res["fast_full"] = ff.local_numel(), ff.full_numel()
    res["plain_numel"] = sum(p.numel() for p in plain.parameters())
    res["tied_local"], res["tied_full"] = s.fast_frozen["tied"].local_numel(), s.fast_frozen["tied"].full_numel()
    res["tied_plain_numel"] = sum(p.numel() for p in plain_tied.parameters())
    res["units"], res["groups"] = len(ff.units), len(ff.groups)
    tf = s.fast_frozen["tied"]
    # The tied head owns no parameter of its own: it gathers the embeddings' group.
    res["tied_groups"], res["tied_head_uses_embedding"] = len(tf.groups), tf.units[-1].groups == [tf.groups[0]]

    def at_rest(engine) -> bool:
        name = next(k for k, v in s.engines.items() if v is engine)
        return s.fast_frozen[name].at_rest() and all(p.ds_tensor.numel() == 0 for p in engine.module.parameters())

    res["rest_before"] = at_rest(fast) and at_rest(tied)
    # While it runs: how many groups are gathered at once (the running unit and one prefetched).
    live = {"max": 0, "max_bytes": 0}

    def count(*_):
        live["max"] = max(live["max"], sum(g.live for g in ff.groups))
        live["max_bytes"] = max(live["max_bytes"], sum(g.nbytes for g in ff.groups if g.live))

    # Pre-hooks registered after take_over's run after its gather: they see the running unit's
    # group and the one prefetched for the next unit.
    handles = [u.module.register_forward_pre_hook(count) for u in ff.units]

    text = tiny.corpus()[:8]
    enc = tok(text, return_tensors="pt", padding=True)
    b = {k: v.to(s.device) for k, v in enc.items()}
    diffs = {}
    with torch.no_grad():
        want = plain(**b).logits
        got_stock = stock(**b).logits
        for i in range(2):  # the first forward records the order, the second prefetches along it
            got = fast(**b).logits
            diffs[f"fast_vs_plain_{i}"] = max_diff(got, want)
            diffs[f"fast_vs_stock_{i}"] = max_diff(got, got_stock)
        diffs["tied_vs_plain"] = max_diff(tied(**b).logits, plain_tied(**b).logits)
    for h in handles:
        h.remove()
    res["max_live_groups"], res["max_live_bytes"] = live["max"], live["max_bytes"]
    # Loading, preparing and running ZeRO-3 models (stock and fast) left nothing process-wide.
    after = process_state()
    res["process_state_changed"] = sorted(k for k in before if before[k] is not after[k] and before[k] != after[k])
    res["largest_unit_bytes"], res["lookahead_bytes"] = max(u.nbytes for u in ff.units), ff.lookahead_bytes
    res["params"] = sum(len(g.params) for g in ff.groups)
    res["prefetched"] = ff.trace == list(range(len(ff.units)))
    res["rest_after"] = at_rest(fast) and at_rest(tied)

    # Greedy generation through the engine's module, as a trainer would call it.
    prompt = tok(tiny.corpus()[:4], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = prompt["input_ids"][:, :12].to(s.device), prompt["attention_mask"][:, :12].to(s.device)
    with torch.no_grad():
        seq_plain, sc_plain = greedy(plain, ids, mask)
        seq_stock, sc_stock = greedy(stock.module, ids, mask)
        seq_fast, sc_fast = greedy(fast.module, ids, mask)
        seq_tied, sc_tied = greedy(tied.module, ids, mask)
        seq_ptied, sc_ptied = greedy(plain_tied, ids, mask)
    res["gen_equal"] = bool(torch.equal(seq_fast, seq_plain) and torch.equal(seq_fast, seq_stock))
    res["gen_tied_equal"] = bool(torch.equal(seq_tied, seq_ptied))
    diffs["gen_scores_fast_vs_plain"] = max_diff(sc_fast, sc_plain)
    diffs["gen_scores_fast_vs_stock"] = max_diff(sc_fast, sc_stock)
    diffs["gen_scores_tied_vs_plain"] = max_diff(sc_tied, sc_ptied)
    res["rest_after_generate"] = at_rest(fast) and at_rest(tied)

    # The ZeRO-2 policy trains beside it, and the frozen forward still matches afterwards.
    labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    losses = []
    for _ in range(4):
        with torch.no_grad():
            ref_logits = fast(**b).logits
        loss = policy(**b, labels=labels).loss + 0.0 * ref_logits.sum()
        s.backward("policy", loss)
        s.step("policy")
        losses.append(loss.item())
    res["policy_losses"] = losses
    with torch.no_grad():
        diffs["fast_vs_plain_after_training"] = max_diff(fast(**b).logits, want)

    # A sequence-classification model (PPO's reward role): its score head is a unit of its own.
    rm_path = tiny.model_path("reward")
    rm = s.prepare("reward", s.load("reward", rm_path, model_cls=AutoModelForSequenceClassification))
    plain_rm = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        diffs["reward_vs_plain"] = max_diff(rm(**b).logits, plain_rm(**b).logits)
    # Releasing a fast role removes its hooks and drops the engine.
    module = rm.module
    s.release("reward")
    res["released"] = "reward" not in s.fast_frozen and "reward" not in s.engines
    res["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())

    # A state dict taken at rest, outside gathered(), is refused with the fix (its values are not there).
    try:
        fast.module.state_dict()
        res["rest_state_dict_error"] = None
    except RuntimeError as err:
        res["rest_state_dict_error"] = str(err)
    # Full weights (save_pretrained's path) come back whole and equal.
    sd = s.state_dict("fast")
    diffs["state_dict_vs_plain"] = max(max_diff(sd[k], v) for k, v in plain.state_dict().items())
    res["state_dict_keys_equal"] = set(sd) == set(plain.state_dict())
    res["rest_after_state_dict"] = at_rest(fast)
    res["diffs"] = diffs
    if rank == 0:
        Path(out).write_text(json.dumps(res, indent=1))
    s.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
