"""What the online-RL trainers (PPO, GRPO, RLOO; distillation's generation) share: prompts and their
chat templates, left-padded prompt batches, the completion log-probs with one position-id
convention, the weighted reward sum, reward functions' failures and logged metrics across ranks,
and samples.jsonl."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..dsconfig import ConfigError
from ..jsonrows import dumps_row
from ..reward_funcs import RewardFuncError, weighted_sum
from .common import sum_over_ranks


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that follow the attention mask, so a left-padded prompt starts at 0 (as in
    generation): ``cumsum - 1`` at real tokens, the padding's own value never read."""
    return attention_mask.long().cumsum(1) - attention_mask.long()


def completion_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     temperature: float, compute_entropy: bool = False, batch_size: int | None = None,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the last ``logits_to_keep`` tokens at the sampling
    temperature, 0 where the attention mask is 0 (as TRL's fused LM head gives them). Runs the
    model's (engine's) own forward so ZeRO-3 gathering applies; positions follow the attention mask,
    as in generation.

    ``fused``: the model carries TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, with
    this temperature), which projects and scores the completion's positions in tiles instead of
    materialising float32 logits over the vocabulary (GBs at 8B with a 128k vocabulary); it
    gathers a ZeRO-3 head itself. Without it, the logits of the last ``logits_to_keep + 1``
    positions are computed (frozen models: posttrain.frozen gathers through module hooks only).

    Where posttrain differs from TRL: ``position_ids`` come from the attention mask, so a left-padded
    prompt starts at position 0. TRL 1.16 passes none; with learned absolute positions (GPT-2) its
    log-probs then depend on how much padding the batch's other prompts impose (and so on the number
    of ranks); rotary models are unaffected either way (tests/test_grpo_positions.py)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for i in range(0, input_ids.size(0), batch_size):
        ids, am = input_ids[i : i + batch_size], attention_mask[i : i + batch_size]
        positions = position_ids(am)
        valid = am[:, -logits_to_keep:].bool()
        if fused:
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-logits_to_keep] = -100  # only the completion is scored
            out = model(input_ids=ids, attention_mask=am, position_ids=positions, labels=labels,
                        fused_lm_head=True)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
            continue
        logits = model(input_ids=ids, attention_mask=am, position_ids=positions, use_cache=False,
                       logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1].float() / temperature
        logps.append(selective_log_softmax(logits, ids[:, -logits_to_keep:]).masked_fill(~valid, 0.0))
        if compute_entropy:
            entropies.append(entropy_from_logits(logits).masked_fill(~valid, 0.0))
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


def truncated_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor, terminal_ids: list[int]) -> torch.Tensor:
    """Completions that hit ``max_completion_length`` without ending: TRL's test, the last kept
    token is not EOS (or pad)."""
    lengths = completion_mask.sum(1)
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return ~torch.isin(last, torch.tensor(terminal_ids, device=last.device)) | (lengths == 0)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The logged reward: the weighted sum of the reward functions, NaN where none applied."""
    rewards = weighted_sum(rewards_per_func, weights.tolist())
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a left-padded batch (ids, attention mask): every prompt ends where generation starts."""
    width = max(len(p) for p in seqs)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in seqs], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in seqs], dtype=torch.long, device=device)
    return ids, mask


def raise_on_every_rank(session: Any, failure: Exception | None) -> None:
    """Re-raise a rank's reward-function failure on every rank, with the failing rank's sentence,
    so that none is left waiting in a collective."""
    if session.num_processes > 1:
        from accelerate.utils import gather_object

        said = [m for m in gather_object([str(failure) if failure else ""]) if m]
        if said and failure is None:
            raise RewardFuncError(said[0])
    if failure is not None:
        raise failure


def mean_of_logged_metrics(session: Any, logged: dict[str, list[float]]) -> dict[str, float]:
    """Metrics reward functions logged (TRL's ``log_metric``), each averaged over every process's
    calls: TRL's sorted union of names, then one (sum, count) reduction per name."""
    names = list(logged)
    if session.num_processes > 1:
        from accelerate.utils import gather_object

        names = gather_object(names)
    out = {}
    for name in sorted(set(names)):
        values = logged.get(name, [])
        t = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=session.device)
        total, count = sum_over_ranks(session, t).tolist()
        out[name] = total / count if count else math.nan
    return out


def write_samples(session: Any, output_dir: str, rows: list[dict]) -> None:
    """Append sample completions to ``samples.jsonl`` (rank 0; a NaN reward as null)."""
    if session.is_main_process:
        with open(Path(output_dir) / "samples.jsonl", "a") as f:
            f.writelines(dumps_row(r) + "\n" for r in rows)


# -- prompts -------------------------------------------------------------------------------------
def prompt_rows(train_dataset: Any, algorithm: str) -> list[dict]:
    """Rows with a "prompt" (TRL's standard text or conversational messages) and any other
    columns (passed to reward functions) from ``train_dataset``: a ``datasets.Dataset`` or a list
    of dicts, as TRL's trainers take it. Required, as in TRL: the scripts load ``--dataset_name``
    (or the tiny default's bundled prompts) and pass it."""
    if train_dataset is None:
        raise ConfigError(f"{algorithm} needs prompts: pass train_dataset= (a datasets.Dataset or a list of dicts "
                          "with a 'prompt'), as TRL's trainers take it; posttrain.scripts.data.bundled_prompts(n) "
                          "gives the tiny default's bundled ones")
    return check_prompt_rows(train_dataset, "train_dataset", algorithm)


def check_prompt_rows(ds: Any, name: str, algorithm: str) -> list[dict]:
    """``ds``'s rows, refused in one sentence naming ``name`` without a "prompt" column or with an
    empty prompt."""
    rows = list(ds) if isinstance(ds, (list, tuple)) else ds.to_list()
    columns = ds.column_names if hasattr(ds, "column_names") else list(rows[0]) if rows else []
    if "prompt" not in columns:
        raise ConfigError(f"{name}: {algorithm} needs a 'prompt' column (text or a list of messages); "
                          f"the columns are {columns}")
    for i, r in enumerate(rows):
        if not r.get("prompt"):
            raise ConfigError(f"{name}: row {i} has an empty 'prompt'")
    return rows


def tokenize_prompt(prompt: Any, tokenizer: Any, cfg: Any) -> list[int]:
    """A prompt's ids as TRL builds them: the chat template with the generation prompt for
    conversational prompts (``maybe_apply_chat_template``), the tokenizer's own special tokens for
    text; kept to the last ``max_prompt_length`` tokens."""
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    example = {"prompt": prompt}
    if is_conversational(example):
        text = maybe_apply_chat_template(example, tokenizer, **(cfg.chat_template_kwargs or {}))["prompt"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError(f"prompt {prompt!r} tokenizes to nothing")
    return ids[-cfg.max_prompt_length:] if cfg.max_prompt_length else ids


def policy_text(prompt: str | list[dict], tokenizer: Any) -> str:
    """What the policy reads: the text, or its chat template over conversational messages."""
    if isinstance(prompt, list):  # conversational: a list of {"role", "content"} messages
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt
