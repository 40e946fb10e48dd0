"""Reward specs and sequence-classification reward models for PPO, GRPO and RLOO (TRL 1.16): how a
reward model reads completions (:func:`reward_model_input`) and scores them."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.data.prompts import padded_inputs
from posttrain.errors import ConfigError
from posttrain.models.packing import Packing, packs
from posttrain.rewards.functions import load_reward_func, spec_kind

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


@dataclass
class RewardSpec:
    """One entry of ``reward_funcs``, resolved: a function (``func``) or a reward model (``path``)."""

    spec: str
    func: Any = None
    path: str | None = None

    @property
    def is_model(self) -> bool:
        return self.path is not None


def is_function_name(name: str) -> bool:
    """Whether ``name`` spells a reward function rather than a model (nothing is looked up)."""
    return spec_kind(name) == "function"


def resolve_reward_specs(specs: Sequence[str]) -> list[RewardSpec]:
    """Every ``reward_funcs`` entry resolved and checked (functions imported, models' configs read)."""
    return [RewardSpec(spec, func=load_reward_func(spec)) if spec_kind(spec) == "function"
            else reward_model_spec(spec) for spec in specs]


def reward_model_spec(path: str) -> RewardSpec:
    """A reward model's folder or hub id, checked (:func:`check_reward_model`) before anything loads."""
    check_reward_model(path)
    return RewardSpec(path, path=path)


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _looks_local(spec: str) -> bool:
    """A path rather than a hub id (explicitly relative/absolute, deep, or under an existing folder)."""
    if spec.startswith(("/", "./", "../", "~", ".\\")) or "\\" in spec or not _HUB_ID.fullmatch(spec):
        return True
    return Path(spec.split("/")[0]).is_dir()


def check_reward_model(spec: str) -> None:
    """Refuse a reward model that cannot load as a one-score classifier (TRL's ``num_labels=1``)."""
    from transformers import PretrainedConfig

    local = Path(spec).expanduser()
    if local.exists():
        if not local.is_dir() or not (local / "config.json").exists():
            raise ConfigError(f"reward model {spec}: {'a file' if not local.is_dir() else 'a folder without config.json'}"
                              ", not a saved model: give the folder model.save_pretrained() wrote")
    elif _looks_local(spec):
        raise ConfigError(f"reward model {spec}: no such folder; check the path (or give a reward function as "
                          "'module.function')")
    try:
        raw, _ = PretrainedConfig.get_config_dict(spec)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"reward model {spec}: not a local folder and not found on the Hub ({first}); check the "
                          "name, or give a local folder") from e
    check_not_language_model(f"reward model {spec}", raw.get("architectures"))
    labels = raw.get("num_labels", len(raw["id2label"]) if "id2label" in raw else 1)
    if labels != 1:
        raise ConfigError(f"reward model {spec} has {labels} labels (num_labels in its config.json); a reward model "
                          "gives one score per completion (TRL loads it with num_labels=1): use one trained with a "
                          "single output, as TRL's RewardTrainer does")


# Heads that generate tokens: a folder saved with only these has no score head to load.
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")


def check_not_language_model(what: str, architectures: Sequence[str] | None) -> None:
    """Refuse a language model given as a reward model: loaded as a classifier, its score head would be
    freshly initialised, so every reward would be noise (TRL loads it without a word)."""
    if architectures and all(a.endswith(_GENERATIVE) for a in architectures):
        raise ConfigError(f"{what} is a language model ({', '.join(architectures)}) without a trained "
                          "score head: as a reward model it would score with a randomly initialised head, so the "
                          "rewards would be noise; give a model trained as a reward model (posttrain reward or "
                          "TRL's RewardTrainer saves one), or name a reward function")


def check_reward_weights(weights: Sequence[float] | None, n: int, what: str = "reward functions") -> list[float]:
    """One weight per reward (all 1.0 when None), as TRL's ``reward_weights``."""
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ConfigError(f"reward_weights has {len(weights)} values for {n} {what}: give one weight each "
                          "(or leave reward_weights unset for 1.0 each)")
    return [float(w) for w in weights]


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions in the prompts' format: text, or one assistant message (as TRL hands them)."""
    if prompts and _conversational(prompts[0]):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def _conversational(prompt: Any) -> bool:
    from trl.data_utils import is_conversational

    return is_conversational({"prompt": prompt})


@dataclass
class RewardModelInput:
    """How a reward model reads completions: the policy's ids, or text re-encoded with ``tokenizer``."""

    path: str
    shares_policy_ids: bool
    tokenizer: Any = None  # the reward model's tokenizer (None when it saved none)
    vocab_size: int = 0  # rows of its input embedding

    def prepare(self, model: torch.nn.Module) -> None:
        """Point the model's pad id at its tokenizer's (as TRL), so its pooling skips padding."""
        if not self.shares_policy_ids and self.tokenizer is not None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
            if hasattr(model.config, "get_text_config"):
                model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id


def load_reward_tokenizer(path: str) -> Any | None:
    """The tokenizer saved with a reward model (EOS as pad when it has none), or None."""
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


def reward_model_input(path: str, policy_tokenizer: Any, policy_vocab_size: int | None = None,
                       reencode: bool = False) -> RewardModelInput:
    """How the reward model at ``path`` reads completions (policy ids iff same vocab, not ``reencode``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    vocab_size = int(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                             "vocab_size", 0) or 0)
    tokenizer = load_reward_tokenizer(path)
    policy_ids = len(policy_tokenizer)  # ids the policy's tokenizer can produce: 0 .. len - 1
    policy_vocab_size = policy_vocab_size or policy_ids
    if tokenizer is None:
        if vocab_size == policy_vocab_size and reencode:
            logger.warning("reward model %s has no tokenizer saved; its vocabulary has the policy's size (%d), so "
                           "completions are re-encoded with the policy's tokenizer. Save its tokenizer beside it to "
                           "be sure.", path, vocab_size)
            return RewardModelInput(path, shares_policy_ids=False, tokenizer=policy_tokenizer, vocab_size=vocab_size)
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
    if not reencode and tokenizer.get_vocab() == policy_tokenizer.get_vocab():  # len(tokenizer) == policy_ids
        return RewardModelInput(path, shares_policy_ids=True, tokenizer=tokenizer, vocab_size=vocab_size)
    logger.info("reward model %s has its own tokenizer: completions are decoded and re-encoded with it", path)
    return RewardModelInput(path, shares_policy_ids=False, tokenizer=tokenizer, vocab_size=vocab_size)


def scorer_input(source: Any, policy_tokenizer: Any, policy_vocab: int, what: str, reencode: bool = False,
                 tokenizer: Any = None) -> RewardModelInput:
    """As :func:`reward_model_input`, for a path or a model (read with ``tokenizer``, else its folder)."""
    if not isinstance(source, torch.nn.Module):
        return reward_model_input(source, policy_tokenizer, policy_vocab, reencode)
    labels = getattr(source.config, "num_labels", None)
    if labels != 1:
        raise ConfigError(f"the {what} object has num_labels={labels}; it must give one score: build it with "
                          "AutoModelForSequenceClassification(..., num_labels=1)")
    check_not_language_model(f"the {what} object", [type(source).__name__])  # one label, but no score head
    name = model_name(source)
    vocab = int(source.config.get_text_config().vocab_size)
    if tokenizer is not None:
        if len(tokenizer) > vocab:
            raise ConfigError(f"the {what} object's tokenizer has {len(tokenizer)} tokens but its embedding only "
                              f"{vocab} rows: give the tokenizer it was trained with")
        if tokenizer.pad_token_id is None:  # TRL's default
            tokenizer.pad_token = tokenizer.eos_token
        return RewardModelInput(name, shares_policy_ids=False, tokenizer=tokenizer, vocab_size=vocab)
    if name and Path(name).is_dir():
        return reward_model_input(name, policy_tokenizer, policy_vocab, reencode)
    if vocab != policy_vocab:
        raise ConfigError(f"the {what} object has a vocabulary of {vocab} tokens and the policy {policy_vocab}: "
                          + ("pass the tokenizer it reads with in reward_processing_classes" if reencode else
                             "it reads the policy's token ids, so give one built on the policy's tokenizer"))
    if reencode:
        logger.warning("the %s object %s has no tokenizer given and no folder of its own; its vocabulary has the "
                       "policy's size (%d), so completions are re-encoded with the policy's tokenizer. Pass its "
                       "tokenizer in reward_processing_classes to be sure.", what, name or type(source).__name__, vocab)
        return RewardModelInput(name, shares_policy_ids=False, tokenizer=policy_tokenizer, vocab_size=vocab)
    return RewardModelInput(name, shares_policy_ids=True, vocab_size=vocab)


def model_name(source: Any) -> str:
    """A model's path, or the folder an object was loaded from ("" when none)."""
    return str(getattr(source, "name_or_path", "") or "") if isinstance(source, torch.nn.Module) else str(source)


def reward_texts(prompts: list, completions: list[str], tokenizer: Any,
                 chat_template_kwargs: dict | None = None) -> list[str]:
    """Prompt + completion as the reward model reads them (its chat template when conversational)."""
    from trl.data_utils import apply_chat_template

    if prompts and _conversational(prompts[0]):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("the reward model's tokenizer has no chat template, needed for conversational "
                              "prompts: set tokenizer.chat_template and save it with the reward model")
        return [apply_chat_template({"messages": p + [{"role": "assistant", "content": c}]}, tokenizer,
                                    **(chat_template_kwargs or {}))["text"]
                for p, c in zip(prompts, completions, strict=True)]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def encode_for_reward(prompts: list, completions: list[str], tokenizer: Any, device: torch.device | str = "cpu",
                      max_length: int | None = None, chat_template_kwargs: dict | None = None) -> dict[str, torch.Tensor]:
    """Re-encode with the reward model's tokenizer as TRL does (right padding, no special tokens)."""
    enc = tokenizer(text=reward_texts(prompts, completions, tokenizer, chat_template_kwargs), return_tensors="pt", padding=True,
                    padding_side="right", add_special_tokens=False, truncation=max_length is not None,
                    max_length=max_length)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def head_outputs(model: Any, **inputs: torch.Tensor) -> torch.Tensor:
    """A decoder classifier's ``score`` head at every position, hooked in the engine's forward (ZeRO-3)."""
    module = getattr(model, "module", model)
    captured: list[torch.Tensor] = []
    handle = module.score.register_forward_hook(lambda _m, _inp, out: captured.append(out))
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return captured[0]


def head_scores(model: Any, sequences: torch.Tensor, pad_token_id: int, padding_free: bool = False) -> torch.Tensor:
    """A classifier's head at every position of the policy's sequences (TRL's ``get_reward``);
    ``padding_free``: on the packed row of the attended tokens, 0 at padding."""
    inputs = padded_inputs(sequences, pad_token_id)
    if not (padding_free and packs(model)):
        return head_outputs(model, **inputs, return_dict=True)
    packing = Packing.of(inputs["attention_mask"])
    return packing.unpack(head_outputs(model, **packing.model_inputs(inputs["input_ids"]), return_dict=True)[0])


def scores_at(model: Any, sequences: torch.Tensor, pad_token_id: int, last: torch.Tensor) -> torch.Tensor:
    """A reward model's head at each row's position ``last`` of the policy's sequences."""
    logits = head_scores(model, sequences, pad_token_id)
    return logits[torch.arange(logits.size(0), device=logits.device), last].squeeze(-1)


@torch.no_grad()
def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    vocab_size: int | None = None) -> torch.Tensor:
    """A classifier's first logit at each row's last attended token (any padding side or pad id)."""
    if vocab_size and int(input_ids.max()) >= vocab_size:
        raise ConfigError(f"token id {int(input_ids.max())} is beyond the reward model's {vocab_size} embedding "
                          "rows: its tokenizer and weights do not match")
    if getattr(getattr(model, "module", model), "score", None) is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = head_outputs(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(dim=1)
    return logits[torch.arange(logits.shape[0], device=logits.device), last, 0]


def score_texts(model: Any, rin: RewardModelInput, prompts: list, completions: list[str],
                device: torch.device | str, batch_size: int = 64, max_length: int | None = None,
                chat_template_kwargs: dict | None = None) -> torch.Tensor:
    """Float32 ``(batch,)`` scores from a reward model that reads text, ``batch_size`` rows at a time."""
    out = []
    for i in range(0, len(prompts), batch_size):
        enc = encode_for_reward(prompts[i : i + batch_size], completions[i : i + batch_size], rin.tokenizer,
                                device, max_length, chat_template_kwargs)
        out.append(sequence_scores(model, enc["input_ids"], enc["attention_mask"], rin.vocab_size).float())
    return torch.cat(out) if out else torch.zeros(0, device=device)
