"""Two-process checks of posttrain.rollout under DeepSpeed (one launch); rank 0 writes JSON for
tests/test_rollout.py.

- ZeRO-2: do the policy's parameters keep their storage (data_ptr) across ``engine.step()``, in
  fp32 and bf16? The engine's graphs read that storage, so an optimizer step must write in place.
- ZeRO-3: a trained ZeRO-3 policy and a frozen fast ZeRO-3 role, gathered once per rollout into
  the shadow buffer, sample exactly what the same weights sample under ZeRO-2.
- LoRA: a peft policy (random non-zero adapters) under ZeRO-2 and ZeRO-3 samples the same tokens,
  with log-probs equal to the adapted model's forward, before and after an optimizer step of the
  adapters (the shadow gathers them with the base).
"""

import json
import sys

import torch

from posttrain import Role, Session
from posttrain.demo import tiny
from posttrain.rollout import Rollout, SamplingParams


def step(s: Session, name: str, ids: torch.Tensor) -> None:
    loss = s.engines[name](input_ids=ids).logits.float().pow(2).mean()
    s.backward(name, loss)
    s.step(name)


def ptrs(module: torch.nn.Module) -> list[int]:
    return [p.data_ptr() for p in module.parameters()]


def zero2_storage(precision: str, ids: torch.Tensor) -> dict:
    s = Session([Role("policy", "zero2_train", trains=True)], micro_batch_size=2, mixed_precision=precision)
    model = s.load("policy", tiny.model_path())
    s.prepare("policy", model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    module = s.engines["policy"].module
    before, values = ptrs(module), [p.detach().clone() for p in module.parameters()]
    for _ in range(2):
        step(s, "policy", ids)
    return {"dtype": str(next(module.parameters()).dtype), "ptrs_unchanged": ptrs(module) == before,
            "changed": any(not torch.equal(v, p) for v, p in zip(values, module.parameters()))}


def lora_policies(ids: torch.Tensor, mask: torch.Tensor, tok) -> dict:
    from peft import LoraConfig, get_peft_model

    s = Session([Role("l2", "zero2_train", trains=True), Role("l3", "zero3_train", trains=True)], micro_batch_size=2)
    for name in ("l2", "l3"):
        model = get_peft_model(s.load(name, tiny.model_path()),
                               LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        g = torch.Generator().manual_seed(0)  # the same adapters on both roles and ranks
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        s.prepare(name, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5))
    sampling = SamplingParams(max_new_tokens=8, pad_token_id=tok.pad_token_id, temperature=0.8)
    rollouts = {name: Rollout(s, name, sampling, max_batch=4, max_prompt_len=16) for name in ("l2", "l3")}
    rollouts["l3live"] = Rollout(s, "l3", sampling, max_batch=4, max_prompt_len=16,
                                 engine_options={"lora_mode": "live"})
    # Grouped under ZeRO-2: the frozen base re-pointed into the appended buffers, DeepSpeed training on.
    rollouts["l2grouped"] = Rollout(s, "l2", sampling, max_batch=4, max_prompt_len=16,
                                    engine_options={"lora_mode": "grouped"})
    res: dict = {"equal": [], "logprob_diff": 0.0, "backends": [r.stats["backend"] for r in rollouts.values()]}
    firsts = []
    for round_ in range(2):
        outs = {}
        for name, r in rollouts.items():
            torch.manual_seed(21)
            outs[name] = r.generate(ids, mask)
        res["equal"].append(all(torch.equal(outs["l2"].sequences, o.sequences) for o in outs.values()))
        o = outs["l2"]
        full = torch.cat([mask, o.completion_mask], 1)
        with torch.no_grad():
            logits = s.engines["l2"](input_ids=o.sequences, attention_mask=full,
                                     position_ids=(full.cumsum(1) - 1).clamp(min=0)).logits[:, ids.shape[1] - 1 : -1]
        lp = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, o.completion_ids.unsqueeze(-1))[..., 0]
        lp = lp.masked_fill(o.completion_mask == 0, 0)
        res["logprob_diff"] = max([res["logprob_diff"], *((lp - x.logprobs).abs().max().item() for x in outs.values())])
        firsts.append(o.logprobs)
        if round_ == 0:
            for name in ("l2", "l3"):
                step(s, name, o.sequences)
    res["changed"] = not torch.allclose(firsts[0], firsts[1])
    res["lora_mode"] = [r.stats.get("lora_mode") for r in rollouts.values()]
    res["appended_groups"] = rollouts["l2grouped"].stats["lora_appended_groups"]
    res["appended_groups_zero3"] = rollouts["l3"].stats["lora_appended_groups"]
    # Two engines on one model share its appended buffers: neither takes the base back from the other.
    res["repointed"] = [rollouts[n].stats["lora_repointed"] for n in ("l2", "l2grouped")]
    res["shared_buffers"] = (list(rollouts["l2"].engine.adapters.appended.values())[0]
                             is list(rollouts["l2grouped"].engine.adapters.appended.values())[0])
    return res


def main(out: str) -> None:
    tok = tiny.load_tokenizer()
    enc = tok(["the cat sat on the", "a", "hello world how are you"], return_tensors="pt", padding=True,
              padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    res: dict = {}

    # fp32 session: a ZeRO-2 and a ZeRO-3 policy with the same weights and optimizer, and a fast
    # frozen ZeRO-3 role.
    s = Session([Role("p2", "zero2_train", trains=True), Role("p3", "zero3_train", trains=True),
                 Role("frozen3", "zero3_inference")], micro_batch_size=2)
    res["world"] = s.num_processes
    for name in ("p2", "p3"):
        model = s.load(name, tiny.model_path())
        s.prepare(name, model, torch.optim.SGD(model.parameters(), lr=0.5))
    s.prepare("frozen3", s.load("frozen3", tiny.model_path()))
    assert "frozen3" in s.fast_frozen
    sampling = SamplingParams(max_new_tokens=8, pad_token_id=tok.pad_token_id, temperature=0.8,
                              stop_token_ids=[tok.eos_token_id])
    rollouts = {name: Rollout(s, name, sampling, max_batch=4, max_prompt_len=16) for name in ("p2", "p3", "frozen3")}
    hf3 = Rollout(s, "p3", sampling, max_batch=4, max_prompt_len=16, backend="hf")
    module2 = s.engines["p2"].module
    before = ptrs(module2)

    def sample(r: Rollout, seed: int):
        torch.manual_seed(seed)  # the same key on both ranks' policies; prompts identical
        return r.generate(ids, mask)

    res["zero3_equal"], shadow_ptrs = [], []
    for round_ in range(2):
        outs = {name: sample(r, 11 + round_) for name, r in rollouts.items()}
        equal = torch.equal(outs["p2"].sequences, outs["p3"].sequences)
        if round_ == 0:  # the frozen role has the initial weights
            equal = equal and torch.equal(outs["p2"].sequences, outs["frozen3"].sequences)
            res["zero3_hf_equal"] = torch.equal(sample(hf3, 11).sequences, outs["p3"].sequences)
        res["zero3_equal"].append(equal)
        shadow_ptrs.append(rollouts["p3"].shadow.flat.data_ptr())
        # The sampled tokens' log-probs against a forward of the ZeRO-2 policy.
        o = outs["p2"]
        full = torch.cat([mask, o.completion_mask], 1)
        with torch.no_grad():
            logits = module2(input_ids=o.sequences, attention_mask=full,
                             position_ids=(full.cumsum(1) - 1).clamp(min=0)).logits[:, ids.shape[1] - 1 : -1]
        lp = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, o.completion_ids.unsqueeze(-1))[..., 0]
        res["zero3_logprob_diff"] = max(res.get("zero3_logprob_diff", 0.0),
                                        (lp.masked_fill(o.completion_mask == 0, 0) - o.logprobs).abs().max().item())
        if round_ == 0:
            values = [p.detach().clone() for p in module2.parameters()]
            for name in ("p2", "p3"):
                step(s, name, o.sequences)
    res["zero2_ptrs_unchanged"] = ptrs(module2) == before
    res["zero2_weights_changed"] = any(not torch.equal(v, p) for v, p in zip(values, module2.parameters()))
    res["zero2_storage_moves"] = rollouts["p2"].stats["storage_moves"]
    shadow_params = {v.untyped_storage().data_ptr() for v in rollouts["p3"].shadow.views.values()}
    res["zero3_shadow_ptr_stable"] = (shadow_ptrs[0] == shadow_ptrs[1]
                                      and shadow_params == {rollouts["p3"].shadow.flat.untyped_storage().data_ptr()})
    res["stats"] = {name: r.stats for name, r in rollouts.items()}

    res["lora"] = lora_policies(ids, mask, tok)

    # bf16: DeepSpeed keeps bf16 parameters as views of its flat buffer, updated in place.
    res["bf16"] = zero2_storage("bf16", ids)
    if s.is_main_process:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
