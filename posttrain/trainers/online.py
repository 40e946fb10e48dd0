"""What the online-RL trainers (PPO, GRPO, RLOO) share: completion log-probs, truncation, samples.jsonl and
the trackers' completions table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.data.prompts import position_ids
from posttrain.models.chunked_head import head_logps, output_layer
from posttrain.models.packing import Packing, packs
from posttrain.rollout.sampling import SamplingParams, generation_overrides
from posttrain.run.jsonrows import dumps_row


def completion_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     temperature: float, *, compute_entropy: bool = False, batch_size: int | None = None,
                     fused: bool = False, float32: bool = True,
                     fill_padding: bool = True, padding_free: bool = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and detached entropies of the last ``logits_to_keep`` tokens, 0 at padding unless
    ``fill_padding=False``. ``fused``: model has TRL's fused LM head; else ``float32`` computes them through the
    output layer in chunks of tokens (:mod:`posttrain.models.chunked_head`), and ``float32=False`` from the
    logits in the model's dtype (TRL's PPO). Positions follow the mask. ``padding_free``: each chunk's attended
    tokens packed into one row (0 at padding whatever ``fill_padding``). ``entropy_grad``: the entropies keep
    their graph (GRPO's entropy bonus; the fused head only)."""
    if entropy_grad and not fused:
        raise ValueError("entropies with grad come from TRL's fused LM head: pass fused=True")
    batch_size = batch_size or input_ids.size(0)
    padding_free = padding_free and packs(model)
    logps, entropies = [], []
    for i in range(0, input_ids.size(0), batch_size):
        ids, am = input_ids[i : i + batch_size], attention_mask[i : i + batch_size]
        if padding_free:
            lp, ent = packed_completion_logps(model, ids, am, logits_to_keep, temperature, compute_entropy,
                                              fused, float32, entropy_grad)
            logps.append(lp)
            entropies.append(ent)
            continue
        positions = position_ids(am)
        if fused:
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-logits_to_keep] = -100  # only the completion is scored
            out = model(input_ids=ids, attention_mask=am, position_ids=positions, labels=labels,
                        fused_lm_head=True)
            lp = out.log_probs[:, -logits_to_keep:]
            ent = out.entropy[:, -logits_to_keep:] if compute_entropy else None
            ent = ent if ent is None or entropy_grad else ent.detach()
        else:
            lp, ent = unfused_logps(model, ids[:, -logits_to_keep:], temperature, compute_entropy, float32, True,
                                    input_ids=ids, attention_mask=am, position_ids=positions, use_cache=False,
                                    logits_to_keep=logits_to_keep + 1)
            if fill_padding:
                valid = am[:, -logits_to_keep:].bool()
                lp = lp.masked_fill(~valid, 0.0)
                ent = ent.masked_fill(~valid, 0.0) if ent is not None else None
        logps.append(lp)
        if compute_entropy:
            entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


def packed_completion_logps(model: Any, ids: torch.Tensor, am: torch.Tensor, logits_to_keep: int,
                            temperature: float, compute_entropy: bool, fused: bool,
                            float32: bool, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``completion_logps`` of one chunk on its packed row: each attended token predicts the next attended
    token of its sequence; the values land at that token's column of the last ``logits_to_keep``."""
    packing = Packing.of(am)
    batch, length = ids.shape
    inputs = packing.model_inputs(ids)
    packed_ids = inputs["input_ids"][0]
    columns = packing.columns
    # Scored: the packed tokens whose next token is of the same sequence and in the completion columns.
    scored = packing.same_sequence_next()
    scored[:-1] &= columns[1:] >= length - logits_to_keep
    where = scored.nonzero().squeeze(1)
    targets = packed_ids[where + 1]
    # Each scored value's place in the (batch, logits_to_keep) output: its target token's row and column.
    dest = packing.rows[where + 1] * logits_to_keep + columns[where + 1] - (length - logits_to_keep)
    if fused:
        shift_labels = torch.full_like(packed_ids, -100).index_copy(0, where, targets)
        out = model(**inputs, shift_labels=shift_labels.unsqueeze(0), fused_lm_head=True)
        lp = out.log_probs[0, where]
        ent = out.entropy[0, where] if compute_entropy else None
        ent = ent if ent is None or entropy_grad else ent.detach()
    else:  # a row: no scored token is fine
        lp, ent = unfused_logps(model, targets[None], temperature, compute_entropy, float32, False, **inputs,
                                use_cache=False, logits_to_keep=where)
        lp, ent = lp[0], (ent[0] if ent is not None else None)

    def place(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(batch * logits_to_keep).index_copy(0, dest, values).view(batch, logits_to_keep)

    return place(lp), (place(ent) if ent is not None else None)


def unfused_logps(model: Any, targets: torch.Tensor, temperature: float, compute_entropy: bool, float32: bool,
                  drop_last: bool, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [B, S] (and detached entropies) from ``model(**inputs)``'s output layer given
    [B, S (+1 with ``drop_last``)] hidden states: in float32 through the layer in chunks (never the whole
    logits) where it is a plain linear layer, else from the logits (in float32 or the model's dtype)."""
    from trl.trainer.utils import selective_log_softmax

    head = output_layer(model) if float32 else None
    if head is not None:
        lp, ent, out = head_logps(model, head, targets, temperature, compute_entropy, drop_last, **inputs)
        if lp is not None:
            return lp, ent
    else:
        out = model(**inputs)
    logits = out.logits[:, :-1] if drop_last else out.logits
    logits = (logits.float() if float32 else logits) / temperature
    lp, ent = selective_log_softmax(logits, targets), None
    if compute_entropy:
        with torch.no_grad():
            ent = torch.logsumexp(logits, dim=-1) - torch.sum(torch.softmax(logits, dim=-1) * logits, dim=-1)
    return lp, ent


def declared_eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """TRL's end-of-completion ids (GRPO, RLOO, distillation): every id the model's generation config declares (an
    end-of-turn token, a base model's end of text), the tokenizer's EOS first if it is not among them."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [declared] if isinstance(declared, int) else list(declared or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def config_sampling(cfg: Any, model: Any, tokenizer: Any) -> SamplingParams:
    """The sampler of GRPO, RLOO and distillation: the config's sampling fields and TRL's end-of-completion ids
    (:func:`declared_eos_ids`), with ``generation_kwargs`` over them as TRL applies it."""
    eos_ids = declared_eos_ids(model, tokenizer)
    return SamplingParams(**{
        "max_new_tokens": cfg.max_completion_length, "pad_token_id": tokenizer.pad_token_id,
        "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p,
        "repetition_penalty": cfg.repetition_penalty, "stop_token_ids": eos_ids,
        **generation_overrides(cfg.generation_kwargs, eos_ids, cfg.temperature)})


def truncated_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor, terminal_ids: list[int]) -> torch.Tensor:
    """Completions that hit ``max_completion_length`` without ending (last kept token not EOS/pad)."""
    lengths = completion_mask.sum(1)
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return ~torch.isin(last, torch.tensor(terminal_ids, device=last.device)) | (lengths == 0)


def write_samples(session: Any, output_dir: str, rows: list[dict], step: int | None = None,
                  unique_prompts: bool = False) -> None:
    """Append sample completions to ``samples.jsonl`` (rank 0; a NaN reward as null) and log them as a
    ``completions`` table at ``step`` to each tracker that takes tables (accelerate's ``log_table``: W&B, ClearML),
    as TRL's ``log_completions`` does; ``unique_prompts`` (TRL's ``log_unique_prompts``): the table keeps each
    prompt's first row, the file every row."""
    if not session.is_main_process:
        return
    with open(Path(output_dir) / "samples.jsonl", "a") as f:
        f.writelines(dumps_row(r) + "\n" for r in rows)
    tables = [t for t in session.accelerator.trackers if hasattr(t, "log_table")]
    if not (tables and rows):
        return
    if unique_prompts:
        first = {str(r.get("prompt")): r for r in reversed(rows)}  # reversed: each prompt's first row wins
        rows = [r for r in rows if first[str(r.get("prompt"))] is r]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    data = [[r.get(c) for c in columns] for r in rows]
    for tracker in tables:
        tracker.log_table("completions", columns=columns, data=data, step=step)


