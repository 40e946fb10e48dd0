"""Multi-turn rollouts (posttrain/rollout/turns.py) on CPU, fp32: a conversation generated across turns in
a slot (tool output appended by a prefill of only its tokens) equals the single sequence decoded token by
token with the tool output forced in at the same places: same tokens, same log-probs."""

import pytest
import torch

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rollout import Rollout, SamplingParams, choose_tokens
from posttrain.rollout.sampling import seen_tokens

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

N = 40  # the completion budget: every turn and appended tool output
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tok():
    return tiny.load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny.model_config()).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    enc = tok(["the cat sat on the", "a", "hello world how are you", "we went to", "it is"], return_tensors="pt",
              padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def stops(tok):
    # EOS and a band of common ids, so turns end every dozen tokens or so on a random model.
    return [tok.eos_token_id, *range(40, 80)]


class Tool:
    """A scripted tool: after each of a sequence's first ``calls`` turns, appends a fixed result whose
    length depends on the sequence; refuses (None) when it does not fit."""

    def __init__(self, calls: int = 3) -> None:
        self.calls, self.seen, self.rollout, self.live_others = calls, {}, None, []

    def __call__(self, seq: int, ids: list[int], room: int) -> list[int] | None:
        if self.rollout is not None:  # rows still decoding (not done) when this turn's tool runs
            self.live_others.append(int((~self.rollout.engine.slots.done).sum()))
        turn = self.seen.get(seq, 0)
        self.seen[seq] = turn + 1
        result = [100 + seq, 200 + turn, *range(300, 300 + seq % 3 + turn)]
        if turn >= self.calls or len(result) > room:
            return None
        return result


def reference(model, ids, mask, key, tool, stop_ids, penalty=1.0):
    """Each sequence alone through transformers' forward and its own cache, one token at a time, the tool
    output forced in where its turn ends; the repetition ``penalty`` over every token of the conversation."""
    from transformers import DynamicCache

    out = []
    for i in range(ids.shape[0]):
        prompt = ids[i][mask[i].bool()].tolist()
        comp, lps = [], []
        cache, fed = DynamicCache(), 0
        while len(comp) < N:
            seq = prompt + comp
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[fed:]]), past_key_values=cache, use_cache=True).logits[:, -1]
            fed = len(seq)
            held = seen_tokens(torch.tensor([seq]), torch.ones(1, len(seq)), logits.shape[-1]) if penalty != 1 else None
            t, lp = choose_tokens(logits, torch.tensor([len(comp)]), torch.tensor(key), seq=torch.tensor([i]),
                                  temperature=TEMPERATURE, do_sample=True, stop_ids=torch.tensor(stop_ids),
                                  seen=held, penalty=penalty)
            comp.append(int(t)), lps.append(float(lp))
            if comp[-1] in stop_ids or len(comp) == N:
                new = tool(i, comp, N - len(comp))
                if new is None:
                    break
                comp += new
                lps += [0.0] * len(new)
        out.append((comp, lps))
    return out


def run(model, tok, ids, mask, backend, seed, kv_slots=None, tool=None, penalty=1.0):
    sampling = SamplingParams(max_new_tokens=N, pad_token_id=tok.pad_token_id, temperature=TEMPERATURE,
                              stop_token_ids=stops(tok), repetition_penalty=penalty)
    r = Rollout(None, "policy", sampling, max_batch=ids.shape[0], max_prompt_len=ids.shape[1], backend=backend,
                model=model, kv_slots=kv_slots)
    torch.manual_seed(seed)
    key = int(torch.randint(0, 2**31 - 1, (1,)).item())  # the draw Rollout makes for a bare model
    torch.manual_seed(seed)
    r.tool = tool or Tool()
    if isinstance(r.tool, Tool) and backend == "posttrain":
        r.tool.rollout = r
    return r.generate_turns(ids, mask, r.tool), key, r


@pytest.fixture(scope="module", params=[1.0, 1.8], ids=["no-penalty", "repetition-penalty"])
def expected(model, tok, prompts, request):
    torch.manual_seed(5)
    key = int(torch.randint(0, 2**31 - 1, (1,)).item())
    return key, reference(model, *prompts, key, Tool(), stops(tok), request.param), request.param


@pytest.mark.parametrize("backend,kv_slots", [("posttrain", None), ("posttrain", 2), ("hf", None)])
def test_turns_equal_the_sequence_with_tool_output_forced_in(model, tok, prompts, expected, backend, kv_slots):
    """kv_slots 2: sequences stream through two slots, extended rows compacted and moved with the others. With
    transformers' repetition penalty: every token of the conversation (prompt, samples, tool output) penalized."""
    ids, mask = prompts
    out, key, r = run(model, tok, ids, mask, backend, seed=5, kv_slots=kv_slots, penalty=expected[2])
    assert r.backend == backend and key == expected[0]
    ref = expected[1]
    turns = 0
    for i, (comp, lps) in enumerate(ref):
        n = int(out.completion_mask[i].sum())
        assert out.completion_ids[i, :n].tolist() == comp
        assert (out.completion_ids[i, n:] == tok.pad_token_id).all()
        # The model's own log-probs as a whole-sequence forward gives them; tool tokens 0 and masked.
        assert (out.logprobs[i, :n] - torch.tensor(lps)).abs().max().item() < 1e-5
        forced = [k for k in range(n) if out.tool_mask[i, k] == 0]
        assert all(lps[k] == 0.0 for k in forced) and (out.logprobs[i, forced] == 0).all()
        turns += len(forced) > 0
    assert turns >= 3  # most sequences made tool calls
    assert (out.tool_mask[:, :] == 0).any() and out.tool_mask[out.completion_mask == 0].eq(1).all()
    if backend == "posttrain":
        # The appended output is a prefill of its own tokens, not of the conversation.
        assert r.engine.stats()["prefill_sequences"] == ids.shape[0]
        # Tools run after the other rows' decode steps are queued, while those rows keep their slots going
        # (with two slots both may be waiting on tools at once).
        if kv_slots is None:
            assert max(r.tool.live_others) > 0


def test_budget_filled_by_tool_output_and_overlong_result_refused(model, tok, prompts):
    ids, mask = prompts

    def fill(seq, comp, room):  # the first turn's result takes the whole budget left
        return [7] * room if room and len(comp) < N else None

    out, _, _ = run(model, tok, ids, mask, "posttrain", seed=1, tool=fill)
    full = out.completion_mask.sum(1) == N
    assert full.any()
    assert (out.tool_mask[full, -1] == 0).all()

    with pytest.raises(ConfigError, match="on_turn_end appended"):
        run(model, tok, ids, mask, "posttrain", seed=1, tool=lambda seq, comp, room: [7] * (room + 1))
