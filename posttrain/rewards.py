"""Reward sources shared by the RL trainers (PPO, GRPO, RLOO): Python reward functions and
sequence-classification reward models, following TRL 1.16's GRPOTrainer.

- Reward functions are named ``"pkg.module:function"`` and called TRL's way:
  ``fn(prompts=..., completions=..., completion_ids=..., **columns)`` returning one float (or
  None) per completion. :func:`load_reward_funcs` imports them; :func:`call_reward_funcs` runs
  them into a ``(batch, n_funcs)`` tensor; :func:`weighted_sum` combines columns as TRL does.
- A reward model reads the policy's output one of two ways, decided once by
  :func:`reward_model_input` from the files saved with it:

  * ``shares_policy_ids``: its tokenizer has the policy's vocabulary (or it has none and its
    embedding has the policy's size), so the policy's token ids are scored directly;
  * otherwise TRL's way: completions are decoded and prompt + completion re-encoded with the
    reward model's tokenizer (its chat template for conversational prompts),
    :func:`encode_for_reward` then :func:`sequence_scores`.

  A combination that cannot be scored (no tokenizer and another vocabulary size, ids beyond the
  reward model's embedding) is refused with the fix, instead of scoring the wrong tokens or
  failing inside ``F.embedding``.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .dsconfig import ConfigError

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list]
# Files any saved Hugging Face tokenizer leaves in its folder.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


# -- reward functions --------------------------------------------------------------------------
def is_function_name(name: str) -> bool:
    """True for ``"pkg.module:function"``; False for a model (hub name or existing local path),
    so one ``reward_funcs`` list can mix both as in TRL (where strings are model names)."""
    return ":" in name and not Path(name).exists()


def load_reward_funcs(names: Sequence[str]) -> list[RewardFunc]:
    """Import each ``"pkg.module:function"``; a failure names the reward function and the
    import's own error."""
    funcs = []
    for name in names:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"reward function {name!r}: write it as 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # the module's own import error (a missing dependency, a syntax error...)
            raise ConfigError(
                f"reward function {name!r}: importing {module_name!r} failed with {type(e).__name__}: {e}. "
                "Install what it needs, or put the folder holding it on PYTHONPATH."
            ) from e
        fn = getattr(module, attr, None)
        if fn is None:
            public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise ConfigError(f"reward function {name!r}: {module_name} has no {attr!r}; "
                              f"its callables are {public[:20]}")
        if not callable(fn):
            raise ConfigError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
        funcs.append(fn)
    return funcs


def func_name(fn: Callable) -> str:
    """The display name TRL logs a reward function under (``rewards/<name>/mean``)."""
    from trl.trainer.utils import get_callable_name

    return get_callable_name(fn)


def check_reward_weights(weights: Sequence[float] | None, n: int, what: str = "reward functions") -> list[float]:
    """One weight per reward (all 1.0 when None), as TRL's ``reward_weights``."""
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ConfigError(f"reward_weights has {len(weights)} values for {n} {what}: give one weight each "
                          "(or leave reward_weights unset for 1.0 each)")
    return [float(w) for w in weights]


def call_reward_funcs(
    funcs: Sequence[RewardFunc], prompts: list, completions: list, completion_ids: list[list[int]] | None = None,
    device: torch.device | str = "cpu", **columns: Any,
) -> torch.Tensor:
    """Run each function on the batch (TRL's keyword arguments: ``prompts``, ``completions``,
    ``completion_ids`` and the dataset's other columns); returns float32 ``(batch, len(funcs))``,
    None as NaN."""
    out = torch.zeros(len(prompts), len(funcs), dtype=torch.float32, device=device)
    for i, fn in enumerate(funcs):
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        values = [math.nan if v is None else float(v) for v in values]
        if len(values) != len(prompts):
            raise ValueError(f"reward function {func_name(fn)!r} returned {len(values)} rewards for "
                             f"{len(prompts)} completions: return one per completion")
        out[:, i] = torch.tensor(values, dtype=torch.float32, device=device)
    return out


def weighted_sum(per_func: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """TRL's combination: sum over columns of weight * reward, NaN (a None) counted as absent."""
    w = torch.tensor(list(weights), dtype=per_func.dtype, device=per_func.device)
    return (per_func * w.unsqueeze(0)).nansum(dim=1)


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions in the prompts' format: text, or one assistant message for conversational
    prompts (what TRL hands reward functions)."""
    if prompts and _conversational(prompts[0]):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def _conversational(prompt: Any) -> bool:
    from trl.data_utils import is_conversational

    return is_conversational({"prompt": prompt})


# -- reward models -----------------------------------------------------------------------------
@dataclass
class RewardModelInput:
    """How a reward model reads completions: the policy's ids (``shares_policy_ids``) or text
    re-encoded with ``tokenizer``, the reward model's own."""

    path: str
    shares_policy_ids: bool
    tokenizer: Any = None  # the reward model's tokenizer (None when it saved none)
    vocab_size: int = 0  # rows of its input embedding

    def prepare(self, model: torch.nn.Module) -> None:
        """Point the model's pad id at the tokenizer it will read (TRL does the same), so its own
        last-token pooling skips padding."""
        if not self.shares_policy_ids and self.tokenizer is not None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
            if hasattr(model.config, "get_text_config"):
                model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id


def load_reward_tokenizer(path: str) -> Any | None:
    """The tokenizer saved with a reward model, or None when it has none. A pad token is added
    as TRL does (the eos token) when the tokenizer lacks one."""
    from transformers import AutoTokenizer

    local = Path(path)
    if local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if local.is_dir():
            raise  # tokenizer files are there but do not load: the user needs that error
        return None  # a hub repo without a tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def reward_model_input(path: str, policy_tokenizer: Any, policy_vocab_size: int | None = None) -> RewardModelInput:
    """Decide how the reward model at ``path`` scores the policy's completions (see the module
    docstring); refuses a combination that cannot work, naming the fix.

    ``policy_vocab_size`` is the policy's embedding size (default ``len(policy_tokenizer)``).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    vocab_size = int(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                             "vocab_size", 0) or 0)
    tokenizer = load_reward_tokenizer(path)
    policy_ids = len(policy_tokenizer)  # ids the policy's tokenizer can produce: 0 .. len - 1
    policy_vocab_size = policy_vocab_size or policy_ids
    if tokenizer is None:
        if vocab_size == policy_vocab_size:
            logger.warning("reward model %s has no tokenizer saved; its vocabulary has the policy's size (%d), so "
                           "it reads the policy's token ids. Save its tokenizer beside it to be checked.",
                           path, vocab_size)
            return RewardModelInput(path, shares_policy_ids=True, vocab_size=vocab_size)
        raise ConfigError(
            f"reward model {path} has no tokenizer saved and a vocabulary of {vocab_size} tokens, the policy's has "
            f"{policy_vocab_size}: its scores of the policy's token ids would be meaningless. Save the tokenizer it was "
            f"trained with into that folder (tokenizer.save_pretrained('{path}')) so completions are re-encoded with it."
        )
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"reward model {path}: its tokenizer has {len(tokenizer)} tokens but its embedding only {vocab_size} rows; "
            "resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save both."
        )
    if tokenizer.get_vocab() == policy_tokenizer.get_vocab():  # so len(tokenizer) == policy_ids <= vocab_size
        return RewardModelInput(path, shares_policy_ids=True, tokenizer=tokenizer, vocab_size=vocab_size)
    logger.info("reward model %s has its own tokenizer: completions are decoded and re-encoded with it", path)
    return RewardModelInput(path, shares_policy_ids=False, tokenizer=tokenizer, vocab_size=vocab_size)


def reward_texts(prompts: list, completions: list[str], tokenizer: Any) -> list[str]:
    """Prompt + completion as the reward model reads them: its chat template over the messages
    for conversational prompts (the completion as the assistant's turn), else plain
    concatenation (TRL's GRPOTrainer)."""
    from trl.data_utils import apply_chat_template

    if prompts and _conversational(prompts[0]):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("the reward model's tokenizer has no chat template, needed for conversational "
                              "prompts: set tokenizer.chat_template and save it with the reward model")
        return [apply_chat_template({"messages": p + [{"role": "assistant", "content": c}]}, tokenizer)["text"]
                for p, c in zip(prompts, completions, strict=True)]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def encode_for_reward(prompts: list, completions: list[str], tokenizer: Any, device: torch.device | str = "cpu",
                      max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Re-encode with the reward model's tokenizer: right padding, no added special tokens
    (the chat template already has them), as TRL does."""
    enc = tokenizer(text=reward_texts(prompts, completions, tokenizer), return_tensors="pt", padding=True,
                    padding_side="right", add_special_tokens=False, truncation=max_length is not None,
                    max_length=max_length)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


@torch.no_grad()
def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    vocab_size: int | None = None) -> torch.Tensor:
    """A sequence-classification model's first logit at each row's last attended token.

    Decoder classifiers (a ``score`` head) are read through a hook on the head, with positions
    and the last token taken from ``attention_mask``: that works for any padding side or pad id,
    and through a (ZeRO-3) engine's own forward. Other classifiers pool themselves.
    """
    if vocab_size and int(input_ids.max()) >= vocab_size:
        raise ConfigError(f"token id {int(input_ids.max())} is beyond the reward model's {vocab_size} embedding "
                          "rows: its tokenizer and weights do not match")
    module = getattr(model, "module", model)
    head = getattr(module, "score", None)
    if head is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _inp, out: captured.append(out))
    try:
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    logits = captured[0]
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(dim=1)
    return logits[torch.arange(logits.shape[0], device=logits.device), last, 0]


def score_texts(model: Any, rin: RewardModelInput, prompts: list, completions: list[str],
                device: torch.device | str, batch_size: int = 64, max_length: int | None = None) -> torch.Tensor:
    """Scores from a reward model that reads text (``not rin.shares_policy_ids``): re-encode,
    then :func:`sequence_scores`, ``batch_size`` rows at a time. Returns float32 ``(batch,)``."""
    out = []
    for i in range(0, len(prompts), batch_size):
        enc = encode_for_reward(prompts[i : i + batch_size], completions[i : i + batch_size], rin.tokenizer,
                                device, max_length)
        out.append(sequence_scores(model, enc["input_ids"], enc["attention_mask"], rin.vocab_size).float())
    return torch.cat(out) if out else torch.zeros(0, device=device)
