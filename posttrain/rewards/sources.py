"""GRPO/RLOO's rewards: which sources a run scores with (reward functions and sequence-classification
reward models, each model a frozen role of its own), resolved and checked before anything loads,
and the scoring of a generation batch as TRL 1.16's ``_calculate_rewards`` does it (TRL's keyword
arguments, ``log_extra``/``log_metric``, reward models reading the decoded text re-encoded with
their own tokenizer). :class:`GRPOTrainer` mixes it in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rewards.functions import (
    RewardFuncError,
    mean_of_logged_metrics,
    raise_on_every_rank,
    weighted_rewards,
)


class RewardSources:
    """The reward side of a GRPO trainer: ``sources`` (``("func", fn, name)`` or
    ``("model", role, path or object)``, in the order ``reward_weights`` follows), ``reward_names`` (TRL's
    metric names), ``reward_inputs`` (how each reward model reads completions)."""

    cfg: Any
    session: Any
    trainer_state: Any
    sources: list[tuple[str, Any, Any]]
    reward_weights: torch.Tensor
    reward_names: list[str]
    reward_inputs: dict[str, Any]
    reward_tokenizers: dict[str, Any]  # role -> the tokenizer given with a reward-model object
    _extra_columns: dict[str, list]
    _pending_metrics: dict[str, list[float]]

    def resolve_rewards(self, reward_funcs: list | None, tiny_default: bool = True,
                        processing_classes: Any = None) -> None:
        """Rewards in the order given: functions and reward-model objects passed in code (TRL's
        ``reward_funcs``, an object with its tokenizer from ``processing_classes``, TRL's
        ``reward_processing_classes``), the reward model flag, then the config's ``reward_funcs``
        (names, "module.function" or reward-model paths), every spec resolved and checked before
        anything loads or the output dir is touched; ``tiny_default``: the policy is the tiny
        default, whose bundled reward applies when none is given."""
        from posttrain.rewards import models as rewards

        cfg = self.cfg
        names = ([cfg.reward_model_name_or_path] if cfg.reward_model_name_or_path else []) + list(cfg.reward_funcs or [])
        if not names:
            if not tiny_default and not reward_funcs:  # the bundled reward is the tiny default's only
                raise ConfigError("GRPO needs a reward: set reward_funcs (one of TRL's reward names, "
                                  "\"module.function\", or a reward model's path)")
            names = [] if reward_funcs else ["posttrain.demo.synthetic:sentiment_reward"]
        given = list(reward_funcs or [])
        if processing_classes is not None and not isinstance(processing_classes, list):
            processing_classes = [processing_classes]
        if processing_classes is not None and len(processing_classes) != len(given):
            raise ConfigError(f"reward_processing_classes has {len(processing_classes)} entries for {len(given)} "
                              "reward_funcs: give one per entry (None for a function)")
        self.sources, self.reward_tokenizers = [], {}
        n_models = 0
        for f, tok in zip(given, processing_classes or [None] * len(given)):
            if isinstance(f, torch.nn.Module):  # a reward model object, a frozen role of its own
                role = "reward" if not n_models else f"reward_{n_models}"
                self.sources.append(("model", role, f))
                self.reward_tokenizers[role] = tok
                n_models += 1
            else:
                self.sources.append(("func", f, rewards.func_name(f)))
        for spec in rewards.resolve_reward_specs(names):
            if spec.is_model:
                self.sources.append(("model", "reward" if not n_models else f"reward_{n_models}", spec.path))
                n_models += 1
            else:
                self.sources.append(("func", spec.func, rewards.func_name(spec.func)))
        if not self.sources:
            raise ConfigError("GRPO needs a reward: set reward_funcs")
        self.reward_weights = torch.tensor(rewards.check_reward_weights(cfg.reward_weights, len(self.sources),
                                                                        "rewards (functions and models)"))
        self.reward_names = [n if kind == "func" else Path(rewards.model_name(n) or type(n).__name__).name
                             for kind, _, n in self.sources]
        self._extra_columns, self._pending_metrics = {}, {}

    def check_reward_columns(self, rows: list[dict]) -> None:
        """Every reward function's required keyword arguments are columns of the prompts."""
        from posttrain.rewards import models as rewards

        columns = [k for k in rows[0] if k != "prompt"] if rows else []
        for kind, fn, _ in self.sources:
            if kind == "func":
                rewards.check_columns(fn, columns)

    @property
    def reward_roles(self) -> list[str]:
        return [role for kind, role, _ in self.sources if kind == "model"]

    def plan_reward_models(self, policy: Any, tokenizer: Any) -> None:
        """How each reward model reads completions (TRL's way: decoded and re-encoded with its own
        tokenizer), decided from its files (or an object's given tokenizer) before anything loads;
        ``policy`` is the policy's path or config."""
        from transformers import AutoConfig

        from posttrain.rewards import models as rewards

        config = AutoConfig.from_pretrained(policy) if isinstance(policy, (str, Path)) else policy
        policy_vocab = config.get_text_config().vocab_size
        self.reward_inputs = {role: rewards.scorer_input(source, tokenizer, policy_vocab, "reward model", reencode=True,
                                                         tokenizer=self.reward_tokenizers.get(role))
                              for kind, role, source in self.sources if kind == "model"}

    def load_reward_models(self) -> None:
        """Each reward model under its own frozen role."""
        from transformers import AutoModelForSequenceClassification

        s = self.session
        for kind, role, source in self.sources:
            if kind == "model":  # an object is taken as it is
                model = s.load(role, source, model_cls=AutoModelForSequenceClassification, num_labels=1)
                self.reward_inputs[role].prepare(model)  # its pad id is its tokenizer's (TRL's), for its own pooling
                s.prepare(role, model)

    def weighted(self, per_func: torch.Tensor) -> torch.Tensor:
        return weighted_rewards(per_func, self.reward_weights.to(per_func.device))

    def score(self, rows: list[dict], prompts: list, texts: list[str], completion_ids: list[list[int]]) -> torch.Tensor:
        """``(local batch, n_rewards)``, as TRL's ``_calculate_rewards``: the reward functions with
        TRL's keyword arguments (``completion_ids``: the generated ids, unmasked; the dataset's other
        columns; ``trainer_state``, ``log_extra``, ``log_metric``), and each reward model on
        prompt + decoded completion re-encoded with its own tokenizer and chat template."""
        from posttrain.rewards import models as rewards

        s, cfg = self.session, self.cfg
        out = torch.zeros(len(texts), len(self.sources), dtype=torch.float32, device=s.device)
        completions = rewards.as_completions(prompts, texts)
        kwargs = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        kwargs.update(trainer_state=self.trainer_state, log_extra=self._log_extra, log_metric=self._log_metric)
        funcs = [(j, what) for j, (kind, what, _) in enumerate(self.sources) if kind == "func"]
        if funcs:
            failure = None
            try:
                per_func = rewards.call_reward_funcs([f for _, f in funcs], prompts, completions, completion_ids,
                                                     s.device, **kwargs)
            except RewardFuncError as err:
                failure = err
            raise_on_every_rank(s, failure)
            for col, (j, _) in enumerate(funcs):
                out[:, j] = per_func[:, col]
        for j, (kind, role, _) in enumerate(self.sources):
            if kind == "model":
                with s.activate(role):
                    out[:, j] = rewards.score_texts(s.engines[role], self.reward_inputs[role], prompts, texts,
                                                    s.device, batch_size=cfg.per_device_train_batch_size,
                                                    chat_template_kwargs=cfg.chat_template_kwargs)
        return out

    def _log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column for the logged samples (samples.jsonl)."""
        self._extra_columns.setdefault(column, []).extend(values)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar averaged over every process into this generation's metrics."""
        self._pending_metrics.setdefault(name, []).append(float(value))

    def _flush_logged_metrics(self) -> dict[str, float]:
        """The metrics reward functions logged on this generation batch, averaged over every
        process's calls (TRL's sorted union of names, then a (sum, count) reduction)."""
        out = mean_of_logged_metrics(self.session, self._pending_metrics)
        self._pending_metrics.clear()
        return out
