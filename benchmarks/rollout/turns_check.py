"""Multi-turn rollouts on a GPU, the compiled, graph-captured engine with its Triton kernels: a tiny fp32
model's conversations (tool output appended in the slot, 20 sequences through 8 slots) against the same
sequences decoded one token at a time by transformers with the tool output forced in; without and with
transformers' repetition penalty (over the whole conversation).

    python benchmarks/rollout/turns_check.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from posttrain.rollout import Rollout, SamplingParams, choose_tokens
from posttrain.rollout.sampling import seen_tokens


def reference(model, ids, mask, key, tool, stop_ids, n, temperature, penalty=1.0):
    from transformers import DynamicCache

    out = []
    for i in range(ids.shape[0]):
        prompt = ids[i][mask[i].bool()].tolist()
        comp, cache, fed = [], DynamicCache(), 0
        while len(comp) < n:
            seq = prompt + comp
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[fed:]], device=ids.device), past_key_values=cache,
                               use_cache=True).logits[:, -1]
            fed = len(seq)
            held = None
            if penalty != 1.0:
                row = torch.tensor([seq], device=ids.device)
                held = seen_tokens(row, torch.ones_like(row), logits.shape[-1])
            t, _ = choose_tokens(logits, torch.tensor([len(comp)], device=ids.device), torch.tensor(key, device=ids.device),
                                 seq=torch.tensor([i], device=ids.device), temperature=temperature, do_sample=True,
                                 stop_ids=torch.tensor(stop_ids, device=ids.device), seen=held, penalty=penalty)
            comp.append(int(t))
            if comp[-1] in stop_ids or len(comp) == n:
                new = tool(i, comp, n - len(comp))
                if new is None:
                    break
                comp += new
        out.append(comp)
    return out


class Scripted:
    """A tool appending ``length`` fixed tokens after each of a sequence's first ``calls`` turns."""

    def __init__(self, calls: int, length: int) -> None:
        self.calls, self.length, self.seen = calls, length, {}

    def __call__(self, seq, ids, room):
        turn = self.seen.get(seq, 0)
        self.seen[seq] = turn + 1
        result = [100 + (seq + k) % 200 for k in range(self.length)]
        return result if turn < self.calls and len(result) <= room else None


def correctness(dev, penalty: float = 1.0) -> dict:
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny

    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.model_config()).to(dev).eval()
    enc = tok(["the cat sat on the", "a", "hello world how are you", "we went to", "it is"] * 4, return_tensors="pt",
              padding=True, padding_side="left")
    ids, mask = enc["input_ids"].to(dev), enc["attention_mask"].to(dev)
    n, stops = 40, [tok.eos_token_id, *range(40, 80)]
    sampling = SamplingParams(max_new_tokens=n, pad_token_id=tok.pad_token_id, temperature=0.9, stop_token_ids=stops,
                              repetition_penalty=penalty)
    r = Rollout(None, "policy", sampling, max_batch=ids.shape[0], max_prompt_len=ids.shape[1], model=model, kv_slots=8)
    torch.manual_seed(5)
    key = int(torch.randint(0, 2**31 - 1, (1,)).item())
    torch.manual_seed(5)
    out = r.generate_turns(ids, mask, Scripted(3, 4))
    ref = reference(model, ids, mask, key, Scripted(3, 4), stops, n, 0.9, penalty)
    same = sum(out.completion_ids[i, : len(c)].tolist() == c and int(out.completion_mask[i].sum()) == len(c)
               for i, c in enumerate(ref))
    return {"sequences": len(ref), "equal_to_reference": same, "tool_tokens": int((out.tool_mask == 0).sum()),
            "engine": {k: r.stats.get(k) for k in ("backend", "captures", "compile_fallbacks", "capture_fallbacks",
                                                   "triton_decode")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"correctness": correctness(dev), "repetition_penalty_1.8": correctness(dev, 1.8),
              "device": torch.cuda.get_device_name()}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
