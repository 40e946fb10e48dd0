"""PPO as TRL's last PPOTrainer (trl 0.x; TRL 1.13 removed it), each role under its own plugin. Policy and
value have separate optimizers, so each model's gradient norm is clipped on its own."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain.data.order import mix_seed, rank_batches, seed_everything
from posttrain.data.preference import check_conversation
from posttrain.data.prompts import check_prompt_rows, padded_inputs, policy_text, prompt_rows
from posttrain.errors import ConfigError
from posttrain.models import varlen_attention
from posttrain.models.lora import adapters_disabled
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import (
    distinct_objects,
    init_kwargs,
    model_config,
    policy_source,
    reference_source,
)
from posttrain.placement.ranks import gather_ranks, world_size
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rewards.functions import load_reward_funcs
from posttrain.rewards.models import (
    check_reward_weights,
    head_scores,
    model_name,
    reward_model_spec,
    scorer_input,
)
from posttrain.rewards.scoring import Rewards
from posttrain.rollout.api import RolloutFields, check_rollout_fields
from posttrain.trainers.config import TrainConfig, make_session
from posttrain.trainers.loop import Trainer, default_args, refuse_arguments
from posttrain.trainers.online import completion_logps, write_samples
from posttrain.trainers.run_log import Phases

INVALID_LOGPROB = 1.0  # TRL's fill value for log-probs past the end of a response


@dataclass
class PPOConfig(TrainConfig, RolloutFields, TrainingArguments):
    """TRL's last ``PPOConfig`` (trl 0.x; TRL 1.13 removed PPO): ``TrainingArguments`` plus PPO's fields, names and
    defaults, without its script settings (``sft_model_path``, ``reward_model_path``: the trainer's ``model=`` and
    ``reward_model=``); posttrain's placement, rollout and reward-function fields beside them."""

    # TRL's OnPolicyConfig's defaults over TrainingArguments'.
    logging_steps: float = 10
    bf16: bool | None = None
    # Loading a model given by name (TRL 1.16's names; TRL's PPOTrainer took built models only).
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    reward_weights: list[float] | None = None  # one per reward function; the reward model's weight is 1
    max_prompt_length: int = 64  # prompts are truncated from the left (TRL's PPO took pre-tokenized prompts)
    # TRL's OnPolicyConfig
    num_mini_batches: int = 1
    total_episodes: int | None = None
    local_rollout_forward_batch_size: int = 64
    num_sample_generations: int = 10  # times over the run that sample completions are logged
    response_length: int = 53
    stop_token: str | None = None  # "eos"
    stop_token_id: int | None = None
    temperature: float = 0.7
    missing_eos_penalty: float | None = None
    # TRL's PPOConfig
    num_ppo_epochs: int = 4
    whiten_rewards: bool = False
    kl_coef: float = 0.05
    kl_estimator: str = "k1"  # "k1" | "k3"
    cliprange: float = 0.2
    vf_coef: float = 0.1
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ds3_gather_for_generation: bool = True  # gather a ZeRO-3 policy whole to generate; False: per-layer hooks
    # Policy and value forwards on packed rows; off: TRL's policy/entropy_avg also averages the padding's entropies.
    padding_free: bool = False

    _algorithm = "PPO"
    _evaluates = False
    _epochs = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rollout_fields(self)
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")
        if self.stop_token not in (None, "eos"):
            raise ConfigError(f"stop_token must be None or 'eos', got {self.stop_token!r}; use stop_token_id")
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ConfigError("stop_token and stop_token_id are both set: keep one of them (TRL's rule)")
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length", "local_rollout_forward_batch_size",
                     "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}: set --{name} 1 or more")


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row, or the row length if there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(stop_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Pad everything after the first stop token (the stop token itself stays)."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.size(1), device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask is empty")
        if n == 1:
            raise ValueError("masked_var: one element has no unbiased variance; raise the batch size")
        variance = variance * n / (n - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference: k1 = log p - log q; k3 = (r - 1) - log r."""
    logr = ref_logprobs - logprobs
    return -logr if estimator == "k1" else (logr.exp() - 1) - logr


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens; returns (advantages, returns)."""
    lastgaelam = 0.0
    advantages_reversed = []
    length = rewards.shape[1]
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate: mean over valid tokens of max(-A r, -A clip(r, 1 +- eps))."""
    logprobs_diff = new_logprobs - old_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((pg_losses2 > pg_losses).float(), mask),
                 "approxkl": 0.5 * (logprobs_diff**2).mean(), "ratio": ratio.mean()}
    return loss, stats


def value_loss(vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped value loss: 0.5 * mean over valid tokens of max((v - R)^2, (clip(v) - R)^2)."""
    vpredclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask).detach()
    return loss, clipfrac


def lm_logprobs(model: Any, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                temperature: float, compute_entropy: bool = False,
                padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The response tokens' log-probs (and entropies) as TRL's PPOTrainer took them: logits in the
    model's dtype over ``temperature + 1e-7``, values at padding kept (PPO masks what it reads; 0 with
    ``padding_free``)."""
    inputs = padded_inputs(query_responses, pad_token_id)
    return completion_logps(model, inputs["input_ids"], inputs["attention_mask"],
                            query_responses.shape[1] - context_length, temperature + 1e-7,
                            compute_entropy=compute_entropy, float32=False, fill_padding=False,
                            padding_free=padding_free)


def rollout_metrics(batch: dict[str, torch.Tensor], eos_token_id: int | None) -> dict[str, float]:
    """TRL's per-rollout metrics on this rank's batch (the entropy skips padding's INVALID_LOGPROB)."""
    valid = ~batch["padding_mask"]
    return {"objective/kl": batch["kl"].sum(1).mean().item(),
            "objective/entropy": (-batch["logprobs"] * valid).sum(1).mean().item(),
            "objective/non_score_reward": batch["non_score_reward"].sum(1).mean().item(),
            "objective/rlhf_reward": (batch["scores"] + batch["non_score_reward"].sum(1)).mean().item(),
            "objective/scores": batch["scores"].mean().item(),
            "val/num_eos_tokens": (batch["responses"] == eos_token_id).sum().item()}


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(model)
    return model


class PPOTrainer(Trainer):
    """PPO with TRL's last ``PPOTrainer`` constructor (trl 0.x), every argument by name. Each model is a hub
    name, a local path or an object (TRL took objects); ``ref_model`` defaults to a copy of the policy (with
    ``peft_config``, the policy's base with adapters disabled), ``value_model`` to the reward model if it reads
    the policy's ids, else the policy (saved in ``value/``). ``reward_funcs`` (posttrain's): functions or
    "module.function" names scored beside or instead of ``reward_model``. ``eval_dataset`` is checked and kept
    (TRL only printed sample completions of it); PPO does not evaluate."""

    name = "ppo"
    shown = ("objective/scores", "objective/kl", "loss/policy_avg")
    roles = TRAINER_ROLES["ppo"]

    def __init__(self, args: PPOConfig | None = None, processing_class: Any = None, model: Any = None,
                 ref_model: Any = None, reward_model: Any = None, train_dataset: Any = None, value_model: Any = None,
                 data_collator: Any = None, eval_dataset: Any = None, optimizers: tuple = (None, None),
                 callbacks: list | None = None, peft_config: Any = None,
                 reward_funcs: list[Callable | str] | None = None) -> None:
        from transformers import AutoModelForSequenceClassification

        from posttrain.rollout import Rollout, SamplingParams

        refuse_arguments("PPOTrainer", data_collator=data_collator, optimizers=optimizers)
        self.cfg = cfg = args if args is not None else default_args(PPOConfig, model, "PPO")
        seed_everything(cfg.seed)
        distinct_objects(model=model, ref_model=ref_model, reward_model=reward_model, value_model=value_model)
        if ref_model is not None and peft_config is not None:
            raise ConfigError("with peft_config the reference is the policy's base model (adapters disabled): drop "
                              "ref_model=, or drop peft_config to use a reference model of its own")
        policy_given, self.tokenizer, policy_name = policy_source(cfg, model, processing_class)
        reward_given = reward_model
        funcs = [f for f in reward_funcs or [] if not isinstance(f, str)]
        funcs += load_reward_funcs([f for f in reward_funcs or [] if isinstance(f, str)])
        if reward_given is None and not funcs:
            raise ConfigError("PPO needs a reward: pass reward_model= (a sequence-classification model: a hub name, a "
                              "local path or an object) and/or reward_funcs= (functions or \"module.function\" names)")
        # The reward model first, with weight 1; reward_weights are the functions'.
        weights = check_reward_weights(cfg.reward_weights, len(funcs))
        reward_models = [] if reward_given is None else [
            reward_given if isinstance(reward_given, torch.nn.Module) else reward_model_spec(str(reward_given))]
        self.rewards = Rewards(reward_models + funcs, [1.0] * len(reward_models) + weights, reencode=False,
                               batch_size=cfg.local_rollout_forward_batch_size)

        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"{policy_name}: the tokenizer has no pad token; set one (e.g. a new '<pad>')")
        self.stop_token_id = self.tokenizer.eos_token_id if cfg.stop_token == "eos" else cfg.stop_token_id
        policy_config = model_config(policy_given)
        self.rewards.plan(policy_config, self.tokenizer)
        reads = self.rewards.models[0].reads if self.rewards.models else None
        # The value model scores the policy's token ids, so it needs the policy's vocabulary.
        value_given = value_model
        if value_given is None:
            value_given = reward_given if reads is not None and reads.shares_policy_ids else policy_given
            if isinstance(value_given, torch.nn.Module):
                if value_given is policy_given:
                    raise ConfigError("a policy object needs its value model: pass value_model= (a sequence-"
                                      "classification model with num_labels=1, as TRL's PPOTrainer takes it), a hub "
                                      "name or a local path")
                # A copy: the reward object stays frozen.
                value_given = copy.deepcopy(value_given).requires_grad_(True)
        elif not scorer_input(value_given, self.tokenizer, policy_config.get_text_config().vocab_size,
                              "value model").shares_policy_ids:
            raise ConfigError(f"value model {model_name(value_given)} has another vocabulary than the policy's, but it "
                              "reads the policy's token ids: give value_model= a model with the policy's tokenizer "
                              "(or leave it unset to start from the policy)")
        self.raw_prompts = [row["prompt"] for row in prompt_rows(train_dataset, cfg._algorithm)]
        check_conversation([{"prompt": p} for p in self.raw_prompts], ("prompt",), self.tokenizer,
                           "train_dataset")  # before any model loads
        self.prompts = [policy_text(p, self.tokenizer) for p in self.raw_prompts]
        self.eval_dataset = (check_prompt_rows(eval_dataset, "eval_dataset", cfg._algorithm)
                             if eval_dataset is not None else None)

        world = world_size()
        # TRL's batch arithmetic: one update uses local_batch_size rollouts per process.
        self.local_batch_size = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches
        self.batch_size = self.local_batch_size * world
        self.local_mini_batch_size = self.local_batch_size // cfg.num_mini_batches
        total_episodes = cfg.total_episodes or int(cfg.num_train_epochs * len(self.prompts))
        self.num_updates = math.ceil(total_episodes / self.batch_size)
        if cfg.max_steps > 0:
            self.num_updates = min(self.num_updates, cfg.max_steps)
        optimizer_steps = self.num_updates * cfg.num_ppo_epochs * cfg.num_mini_batches

        self.peft_config = peft_config
        frozen = ([] if self.peft_config is not None else ["reference"]) + self.rewards.roles
        self.session = s = make_session(cfg, self.roles["trained"], frozen, total_steps=optimizer_steps,
                                        decoded=self.roles["decoded"])
        if self.peft_config is None:  # taken before the policy trains or takes adapters
            reference = reference_source(ref_model, policy_given)
        kwargs = init_kwargs(cfg)
        varlen_attention.choose_for(s, kwargs, policy_given, cfg.padding_free)
        torch.manual_seed(cfg.seed)
        policy = s.load("policy", policy_given, **kwargs)
        policy.generation_config.pad_token_id = self.tokenizer.pad_token_id
        # TRL's PPOTrainer: dropout off so that rollout and update agree.
        self.policy = self.model = prepare_trained(s, "policy", policy, cfg, self.peft_config,
                                                   total_steps=optimizer_steps, disable_dropout=True)
        value = s.load("value", value_given, model_cls=AutoModelForSequenceClassification, num_labels=1, **kwargs)
        value.config.pad_token_id = self.tokenizer.pad_token_id
        self.value_model = prepare_trained(s, "value", value, cfg, None, total_steps=optimizer_steps,
                                           disable_dropout=True)
        if self.peft_config is None:
            s.prepare("reference", _no_dropout(s.load("reference", reference, **kwargs)))
        self.rewards.load(s)
        self.phases = Phases()
        # Responses are not cut while sampling: truncate_response applies the stop token afterwards.
        sampling = SamplingParams(max_new_tokens=cfg.response_length, pad_token_id=self.tokenizer.pad_token_id,
                                  temperature=cfg.temperature + 1e-7, top_k=0, top_p=1.0)
        self.rollout_engine = Rollout.from_config(cfg, s, "policy", sampling, max_prompt_len=cfg.max_prompt_length,
                                                  max_batch=min(cfg.local_rollout_forward_batch_size,
                                                                self.local_batch_size))
        self.total_steps = self.num_updates
        self._batches = None  # the prompt order, from the update the run starts at
        self.sample_every = max(1, self.num_updates // max(1, cfg.num_sample_generations))
        self._finish_init(callbacks)

    def _queries(self, indices: list[int]) -> torch.Tensor:
        enc = self.tokenizer([self.prompts[i] for i in indices], return_tensors="pt", padding=True,
                             padding_side="left", truncation=True, max_length=self.cfg.max_prompt_length)
        return enc["input_ids"].to(self.session.device)

    @torch.no_grad()
    def generate(self, queries: torch.Tensor) -> torch.Tensor:
        """Sample full-length responses with posttrain.rollout, chunk by chunk."""
        cfg, pad = self.cfg, self.tokenizer.pad_token_id
        out = []
        for i in range(0, queries.shape[0], cfg.local_rollout_forward_batch_size):
            q = queries[i : i + cfg.local_rollout_forward_batch_size]
            out.append(self.rollout_engine.generate(q, (q != pad).long()).sequences)
        return torch.cat(out)

    @torch.no_grad()
    def rollout(self, queries: torch.Tensor, prompts: list | None = None) -> dict[str, torch.Tensor]:
        """Generate and score (logprobs, values, rewards, advantages); ``prompts`` go to reward functions."""
        cfg, s = self.cfg, self.session
        pad, ctx = self.tokenizer.pad_token_id, queries.shape[1]
        with self.phases("generate"):
            query_responses = self.generate(queries)
        responses = query_responses[:, ctx:]
        chunks = range(0, queries.shape[0], cfg.local_rollout_forward_batch_size)
        bs = cfg.local_rollout_forward_batch_size

        def by_chunk(fn):
            return torch.cat([fn(query_responses[i : i + bs]) for i in chunks])

        with self.phases("policy_forward"):
            logprobs = by_chunk(lambda qr: lm_logprobs(s.engines["policy"], qr, ctx, pad, cfg.temperature,
                                                      padding_free=cfg.padding_free)[0])
            full_values = by_chunk(lambda qr: head_scores(s.engines["value"], qr, pad, cfg.padding_free))
            values = full_values[:, ctx - 1 : -1].squeeze(-1)
        post = responses
        if self.stop_token_id is not None:
            post = truncate_response(self.stop_token_id, pad, responses)
        post_qr = torch.cat((queries, post), 1)
        sequence_lengths = first_true_indices(post == pad) - 1
        with self.phases("score"):
            ref_logprobs = by_chunk(lambda qr: self.reference_logprobs(qr, ctx))
            texts = self.tokenizer.batch_decode(post, skip_special_tokens=True)
            if prompts is None:
                prompts = self.tokenizer.batch_decode(queries, skip_special_tokens=True)
            completion_ids = [row[row != pad].tolist() for row in post]
            per_func = self.rewards.score(prompts, texts, completion_ids, sequences=post_qr,
                                          last=sequence_lengths + ctx)
            # A completion no reward scored scores 0: PPO has no group to leave it out of.
            scores = torch.where(per_func.isnan().all(dim=1), 0.0, self.rewards.total(per_func))
        return self.advantages(responses, post, logprobs, ref_logprobs, values, scores, sequence_lengths,
                               query_responses=query_responses, texts=texts)

    @torch.no_grad()
    def reference_logprobs(self, query_responses: torch.Tensor, context_length: int) -> torch.Tensor:
        """The reference's log-probs: its own role, or with adapters the policy's base."""
        cfg, s, pad = self.cfg, self.session, self.tokenizer.pad_token_id
        if self.peft_config is not None:
            with adapters_disabled(s.engines["policy"]):
                return lm_logprobs(s.engines["policy"], query_responses, context_length, pad, cfg.temperature,
                                   padding_free=cfg.padding_free)[0]
        with s.activate("reference"):
            return lm_logprobs(s.engines["reference"], query_responses, context_length, pad, cfg.temperature,
                               padding_free=cfg.padding_free)[0]

    def advantages(self, responses: torch.Tensor, post: torch.Tensor, logprobs: torch.Tensor,
                   ref_logprobs: torch.Tensor, values: torch.Tensor, scores: torch.Tensor,
                   sequence_lengths: torch.Tensor, **extra: Any) -> dict[str, torch.Tensor]:
        """TRL's reward shaping (KL penalty, score at the last token, optional whitening) and GAE."""
        cfg = self.cfg
        if cfg.missing_eos_penalty is not None:
            contain_eos = torch.any(post == self.tokenizer.eos_token_id, dim=-1)
            scores = torch.where(contain_eos, scores, scores - cfg.missing_eos_penalty)
        idxs = torch.arange(responses.shape[1], device=responses.device).repeat(responses.shape[0], 1)
        padding_mask = idxs > sequence_lengths.unsqueeze(1)
        logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
        ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
        sequence_lengths_p1 = sequence_lengths + 1
        padding_mask_p1 = idxs > sequence_lengths_p1.unsqueeze(1)
        values = torch.masked_fill(values, padding_mask_p1, 0)

        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        non_score_reward = -cfg.kl_coef * kl
        rewards = non_score_reward.clone()
        rows = torch.arange(rewards.size(0), device=rewards.device)
        ends = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
        rewards[rows, ends] += scores
        if cfg.whiten_rewards:
            rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
            rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
        advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam)
        advantages = masked_whiten(advantages, ~padding_mask)
        advantages = torch.masked_fill(advantages, padding_mask, 0)
        return dict(responses=responses, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
                    scores=scores, kl=kl, non_score_reward=non_score_reward, advantages=advantages,
                    returns=returns, padding_mask=padding_mask, padding_mask_p1=padding_mask_p1, **extra)

    def train_on(self, batch: dict[str, torch.Tensor], update: int) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the rollouts; returns the averaged statistics (TRL's names)."""
        cfg, s = self.cfg, self.session
        pad = self.tokenizer.pad_token_id
        qr = batch["query_responses"]
        ctx = qr.shape[1] - batch["responses"].shape[1]
        names = ("policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                 "val/clipfrac_avg", "policy/entropy_avg", "ratio")
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        mb = cfg.per_device_train_batch_size
        for epoch in range(cfg.num_ppo_epochs):
            # Depends only on (seed, update, epoch, rank): resumable.
            g = torch.Generator().manual_seed(mix_seed(cfg.seed, "minibatches", update, epoch, s.process_index))
            order = torch.randperm(self.local_batch_size, generator=g).to(qr.device)
            for start in range(0, self.local_batch_size, self.local_mini_batch_size):
                mini = order[start : start + self.local_mini_batch_size]
                for m in range(0, self.local_mini_batch_size, mb):
                    idx = mini[m : m + mb]
                    mask, mask_p1 = ~batch["padding_mask"][idx], ~batch["padding_mask_p1"][idx]
                    new_logprobs, entropy = lm_logprobs(s.engines["policy"], qr[idx], ctx, pad, cfg.temperature,
                                                        compute_entropy=True, padding_free=cfg.padding_free)
                    new_logprobs = torch.masked_fill(new_logprobs, ~mask, INVALID_LOGPROB)
                    pg_loss, pg = policy_loss(new_logprobs, batch["logprobs"][idx], batch["advantages"][idx],
                                              mask, cfg.cliprange)
                    s.backward("policy", pg_loss)
                    s.step("policy")
                    vpred = head_scores(s.engines["value"], qr[idx], pad, cfg.padding_free)[:, ctx - 1 : -1].squeeze(-1)
                    vpred = torch.masked_fill(vpred, ~mask_p1, 0)
                    vf_loss, vf_clipfrac = value_loss(vpred, batch["values"][idx], batch["returns"][idx], mask_p1,
                                                      cfg.cliprange_value)
                    s.backward("value", cfg.vf_coef * vf_loss)
                    s.step("value")
                    for k, v in zip(names, (pg["approxkl"], pg["clipfrac"], pg_loss, vf_loss, vf_clipfrac,
                                            entropy.mean(), pg["ratio"])):
                        stats[k].append(v.detach().float())
        # TRL's val/ratio_var: the variance over every rank's values, not a mean of per-rank variances.
        ratios = gather_ranks(s, torch.stack(stats.pop("ratio")))
        means = {k: torch.stack(v).mean().item() for k, v in stats.items()}
        var = ratios.var().item() if ratios.numel() > 1 else 0.0
        return {**means, "val/ratio": ratios.mean().item(), "val/ratio_var": var}

    def training_step(self, update: int) -> dict[str, float]:
        """One PPO update: a rollout batch, then num_ppo_epochs passes over it."""
        cfg, s = self.cfg, self.session
        tick = time.perf_counter()
        if self._batches is None:
            self._batches = rank_batches(len(self.prompts), self.local_batch_size, cfg.seed, s.process_index,
                                         s.num_processes, start=update - 1)
        indices = next(self._batches)
        queries = self._queries(indices)
        batch = self.rollout(queries, prompts=[self.raw_prompts[i] for i in indices])
        with self.phases("train"):
            train_stats = self.train_on(batch, update)
        metrics = {**rollout_metrics(batch, self.tokenizer.eos_token_id), **train_stats}
        metrics.update(self.phases.pop())
        metrics.update(self.rollout_engine.metrics())
        metrics["time/update"] = time.perf_counter() - tick
        metrics["lr"] = s.learning_rate("policy")
        metrics["episode"] = update * self.batch_size
        metrics["epoch"] = metrics["episode"] / len(self.prompts)  # TRL's: episodes over the dataset's rows
        if update % self.sample_every == 0 or update == self.num_updates:
            self._log_samples(update, queries, batch["texts"], batch["scores"])
        return metrics

    def _log_samples(self, update: int, queries: torch.Tensor, texts: list[str], scores: torch.Tensor) -> None:
        prompts = self.tokenizer.batch_decode(queries[:4], skip_special_tokens=True)
        rows = [{"update": update, "prompt": p, "completion": c, "score": round(float(sc), 4)}
                for p, c, sc in zip(prompts, texts[:4], scores[:4].tolist())]
        write_samples(self.session, self.cfg.output_dir, rows, step=update)
        if self.session.is_main_process:
            self.run_log.write("\n".join(f"  [{update}] {r['prompt']!r} -> {r['completion']!r} ({r['score']:+.2f})" for r in rows))
