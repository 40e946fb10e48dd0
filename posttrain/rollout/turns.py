"""Multi-turn rollouts: a sequence whose turn ends (a stop token) keeps its slot; the host's ``on_turn_end``
returns the tokens to append (a tool's rendered result) or None, and the engine prefills only those tokens
into the slot and decodes on. Sampled tokens are never re-tokenized; appended tokens get log-prob 0 and
``tool_mask`` 0. Each token is drawn with the key of its index in the completion, so a multi-turn sample
equals the single sequence decoded with the appended tokens forced in at the same places."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor

from posttrain.errors import ConfigError
from posttrain.rollout import decoder
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.hf import own_generation_config
from posttrain.rollout.sampling import (
    SamplingParams,
    choose_tokens,
    filter_logits,
    gumbel_noise,
    token_logprobs,
)

# (sequence index, its completion so far, tokens of room left) -> tokens to append, or None: the sequence ends.
TurnEnd = Callable[[int, list[int], int], "list[int] | None"]


@dataclass
class TurnOutput:
    """A multi-turn rollout: completions [B, N] with every turn and appended tool output."""

    completion_ids: torch.Tensor  # pad after each sequence's end
    completion_mask: torch.Tensor  # 1 up to each sequence's last token (model's and appended)
    tool_mask: torch.Tensor  # 0 on appended (tool) tokens, 1 elsewhere (padding too, as TRL pads it)
    logprobs: torch.Tensor  # float32 log-probs of the model's tokens; 0 on appended tokens and padding


@dataclass
class Turns:
    """The host side of a multi-turn rollout: calls ``on_turn_end`` and records where tokens were appended."""

    on_turn_end: TurnEnd
    max_new_tokens: int
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # seq -> [(start, end)] appended
    lengths: dict[int, int] = field(default_factory=dict)  # seq -> completion length at its end
    pending: dict[int, list[int]] = field(default_factory=dict)  # seq -> completion so far, its turn ended
    ended: set[int] = field(default_factory=set)  # sequences whose last turn is done (harvested next)

    def ask(self, seq: int, ids: list[int]) -> list[int] | None:
        """The tokens to append after ``ids`` (None: the sequence ends), checked against the room left."""
        room = self.max_new_tokens - len(ids)
        new = self.on_turn_end(seq, ids, room)
        if not new:
            self.lengths[seq] = len(ids)
            return None
        new = [int(t) for t in new]
        if len(new) > room:
            raise ConfigError(f"on_turn_end appended {len(new)} tokens to sequence {seq} with {room} left: return "
                              "None when the tool output does not fit")
        self.spans.setdefault(seq, []).append((len(ids), len(ids) + len(new)))
        return new

    def collect(self, engine: DecodeEngine, finished: list[int], slot_seq: dict[int, int]) -> list[int]:
        """Of the slots whose turn ended, those to harvest (their sequence ended); the others' turns wait for
        :meth:`resolve` in their slots, so their tools run while the other rows' decode steps run."""
        st, harvest, ask = engine.slots, [], []
        for s in finished:
            seq = slot_seq[s]
            if seq in self.ended:
                harvest.append(s)
            elif seq not in self.pending:
                ask.append(s)
        if ask:  # one read of their tokens, not one per slot
            rows = torch.tensor(ask, device=st.step.device)
            steps, tokens = st.step[rows].tolist(), st.out_tokens[rows].tolist()
            for s, step, ids in zip(ask, steps, tokens):
                self.pending[slot_seq[s]] = ids[:step]
        return harvest

    def resolve(self, engine: DecodeEngine, slot_seq: dict[int, int], age: dict[int, int]) -> None:
        """Ask for each waiting turn's appended tokens and extend the slots together, one batched prefill (or
        mark the sequences ended); a turn that ends at its first token after them is asked again."""
        st = engine.slots
        slot_of = {seq: s for s, seq in slot_seq.items()}
        waiting = dict(self.pending)
        while waiting:
            slots, news = [], []
            for seq, ids in waiting.items():
                new = self.ask(seq, ids)
                if new is None:
                    self.ended.add(seq)
                else:
                    slots.append(slot_of[seq])
                    news.append(new)
            waiting = {}
            if not slots:
                break
            extend(engine, slots, news)
            steps, done = st.step[slots].tolist(), st.done[slots].tolist()
            for s, step, ended in zip(slots, steps, done):
                seq = slot_seq[s]
                age[s] = step - 1  # a done row's age ran on while it waited
                if not ended:
                    continue
                if step >= self.max_new_tokens:  # the appended tokens filled the budget
                    self.lengths[seq] = step
                    self.ended.add(seq)
                else:  # the first token after them ended the turn
                    waiting[seq] = st.out_tokens[s, :step].tolist()
        self.pending.clear()

    def output(self, tokens: torch.Tensor, logprobs: torch.Tensor, pad: int) -> TurnOutput:
        """The rollout's results with the completion and tool masks."""
        n, width = tokens.shape
        lengths = torch.tensor([self.lengths.get(i, width) for i in range(n)], device=tokens.device)
        mask = torch.arange(width, device=tokens.device).unsqueeze(0) < lengths.unsqueeze(1)
        tool = torch.ones(n, width, dtype=torch.long, device=tokens.device)
        for seq, spans in self.spans.items():
            for a, b in spans:
                tool[seq, a:b] = 0
        logprobs = logprobs.float().masked_fill(~mask | (tool == 0), 0.0)
        return TurnOutput(tokens.masked_fill(~mask, pad), mask.long(), tool, logprobs)


@torch.no_grad()
def extend(engine: DecodeEngine, slots: list[int], news: list[list[int]]) -> None:
    """Append ``news[i]`` to the sequence in ``slots[i]``, all rows in one prefill: each row's pending token (its
    turn's last, not yet cached) and its new tokens are written into its slot's cache and attend to what the slot
    holds; then each row's next token is chosen unless its budget is full. Rows are right-padded to the longest;
    padded positions are neither written nor read."""
    if engine.prompts is not None:
        raise ConfigError("multi-turn generation does not run with generation_shared_prompt_kv: set it false")
    st, spec, w, dev = engine.slots, engine.spec, engine.weights, engine.device
    n = len(slots)
    slots, news = map(list, zip(*sorted(zip(slots, news))))  # rows are independent: slot order
    # A run of adjacent slots (the usual case: turns ending together) reads its cache as a view, not a gather.
    rows = torch.tensor(slots, dtype=torch.long, device=dev)
    read = slice(slots[0], slots[0] + n) if slots[-1] - slots[0] == n - 1 else rows
    col0_t, pos0_t, step0_t = st.col[rows], st.pos[rows], st.step[rows]
    col0 = col0_t.tolist()  # the host checks room and sizes the read
    lens = [len(new) + 1 for new in news]
    width = max(lens)
    for s, c, t in zip(slots, col0, lens):
        if c + t > st.length:
            raise ConfigError(f"sequence in slot {s} outgrows its cache ({c + t} > {st.length} columns)")
    pending = st.out_tokens[rows, step0_t - 1]
    new_ids = torch.tensor([new + [0] * (width - t) for new, t in zip(news, lens)], dtype=torch.long, device=dev)
    ids = torch.cat([pending.unsqueeze(1), new_ids[:, : width - 1]], 1)  # [n, width]
    here = torch.arange(width, device=dev)
    lens_t = torch.tensor(lens, device=dev)
    real = here.unsqueeze(0) < lens_t.unsqueeze(1)  # [n, width]: not padding
    cols = (col0_t.unsqueeze(1) + here).clamp(max=st.length - 1)
    pair_row, pair_pos = real.nonzero(as_tuple=True)
    pair_slot, pair_col = rows[pair_row], cols[pair_row, pair_pos]
    length = max(c + t for c, t in zip(col0, lens))
    cos, sin = decoder.rotary(pos0_t.unsqueeze(1) + here, w["inv_freq"], spec.rope_scaling, engine.dtype)
    allowed = st.key_valid[rows, :length].unsqueeze(1) & (st.cols[:length].view(1, 1, -1) <= cols.unsqueeze(2))
    x = F.embedding(ids, w["embed"])
    bias = decoder.stacked_bias(spec, allowed.unsqueeze(1), x.dtype)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st.keys[i][pair_slot, :, pair_col] = k[pair_row, :, pair_pos]
        st.values[i][pair_slot, :, pair_col] = v[pair_row, :, pair_pos]
        keys, values = st.keys[i][read, :, :length], st.values[i][read, :, :length]
        return decoder.query_attention(spec, q, keys, values, bias)

    x = decoder.layers(spec, w, x, cos, sin, attend)
    last = x[torch.arange(n, device=dev), lens_t - 1].unsqueeze(1)  # each row's last real position
    logits = decoder.head(spec, w, last)
    nxt = step0_t + lens_t - 1  # the index of each row's next completion token
    new_row, new_pos = real[:, 1:].nonzero(as_tuple=True)  # the appended tokens, at step0 onwards
    st.out_tokens[rows[new_row], step0_t[new_row] + new_pos] = new_ids[new_row, new_pos]
    st.out_logprobs[rows[new_row], step0_t[new_row] + new_pos] = 0.0
    seen = None
    if st.seen is not None:  # the repetition penalty sees the appended tokens, as generate would
        seen = st.seen[rows]
        seen[new_row, new_ids[new_row, new_pos]] = True
    token, logprob = choose_tokens(
        logits, nxt, st.sample_key[rows], seq=st.seq[rows], temperature=engine.temperature,
        do_sample=engine.do_sample, top_k=engine.top_k, top_p=engine.top_p, use_top_p=engine.use_top_p,
        min_new_tokens=engine.min_new, stop_ids=engine.stop_ids, min_p=engine.min_p, use_min_p=engine.use_min_p,
        seen=seen, penalty=engine.penalty)
    full = (nxt >= engine.max_new) | (nxt >= engine.limit)  # no room for a token: the row ends here
    keep = ~full
    at = nxt.clamp(max=st.out_tokens.shape[1] - 1)
    st.out_tokens[rows, at] = torch.where(keep, token, st.out_tokens[rows, at])
    st.out_logprobs[rows, at] = torch.where(keep, logprob.to(st.out_logprobs.dtype), st.out_logprobs[rows, at])
    done = full | (nxt >= engine.limit - 1)
    if engine.stop_mask is not None:
        done = done | (keep & engine.stop_mask[token])
    if seen is not None:
        seen[torch.arange(n, device=dev), token] |= keep
        st.seen[rows] = seen
    st.last[rows] = torch.where(keep, token, st.last[rows])
    st.pos[rows] = pos0_t + lens_t
    st.col[rows] = col0_t + lens_t
    st.step[rows] = torch.where(keep, nxt + 1, nxt)
    st.done[rows] = done


class TurnSampling(LogitsProcessor):
    """The engine's keyed sampler in ``generate`` over rows that resume at completion index ``offsets``."""

    def __init__(self, sampling: SamplingParams, key: int, width: int, offsets: list[int], seqs: list[int]) -> None:
        self.sampling, self.key, self.width = sampling, key, width
        self.offsets, self.seqs = torch.tensor(offsets), torch.tensor(seqs)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        dev, s = scores.device, self.sampling
        step = self.offsets.to(dev) + (input_ids.shape[1] - self.width)
        pick = scores.float() / s.temperature
        if s.stop_token_ids and s.min_new_tokens:
            early = (step < s.min_new_tokens).unsqueeze(1)
            barred = torch.zeros(scores.shape[1], dtype=torch.bool, device=dev)
            barred[torch.tensor(s.stop_token_ids, device=dev)] = True
            pick = pick.masked_fill(early & barred, float("-inf"))
        if not s.do_sample:
            return pick
        pick = filter_logits(pick, s.top_k, s.top_p, min_p=s.min_p)
        return pick + gumbel_noise(torch.tensor(self.key, device=dev), step, self.seqs.to(dev), scores.shape[1])


def hf_turns(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
             key: int, turns: Turns) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"hf"`` backend's multi-turn loop: one ``generate`` per turn over the sequences still going (each
    re-prefilled whole: slow, but any model works); tokens and log-probs [B, max_new_tokens]."""
    from transformers import GenerationConfig

    n, max_new, pad = prompt_ids.shape[0], turns.max_new_tokens, sampling.pad_token_id
    stops = set(sampling.stop_token_ids)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    done: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    active = list(range(n))
    dev = prompt_ids.device
    while active:
        rows = [prompts[i] + done[i] for i in active]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=dev)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=dev)
        budget = max(max_new - len(done[i]) for i in active)
        gen = GenerationConfig(max_new_tokens=budget, do_sample=False, pad_token_id=pad,
                               eos_token_id=sampling.stop_token_ids or None,
                               repetition_penalty=sampling.repetition_penalty, return_dict_in_generate=True,
                               output_logits=True)
        processor = TurnSampling(sampling, key, width, [len(done[i]) for i in active], active)
        with torch.no_grad(), own_generation_config(model):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen,
                                 logits_processor=[processor])
        new = out.sequences[:, width:]
        lp = token_logprobs(torch.stack(out.logits, 1), new, sampling.temperature)
        still = []
        for r, i in enumerate(active):
            tokens, room = new[r].tolist(), max_new - len(done[i])
            cut = next((k + 1 for k, t in enumerate(tokens) if t in stops), len(tokens))
            cut = min(cut, room)
            done[i] += tokens[:cut]
            logps[i] += lp[r, :cut].tolist()
            appended = turns.ask(i, done[i])
            if appended is None:
                continue
            done[i] += appended
            logps[i] += [0.0] * len(appended)
            if len(done[i]) < max_new:
                still.append(i)
            else:
                turns.lengths[i] = len(done[i])
        active = still
    tokens = torch.full((n, max_new), pad, dtype=torch.long, device=dev)
    logprobs = torch.zeros(n, max_new, dtype=torch.float32, device=dev)
    for i in range(n):
        tokens[i, : len(done[i])] = torch.tensor(done[i], dtype=torch.long)
        logprobs[i, : len(logps[i])] = torch.tensor(logps[i])
    return tokens, logprobs
