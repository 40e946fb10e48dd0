"""The rewards a GRPO, RLOO or PPO run scores completions with, as one component (:class:`Rewards`):
reward functions and reward models (each a frozen role), combined and reported as TRL 1.16 does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rewards.functions import (
    RewardFuncError,
    RewardWarnings,
    call_reward_funcs,
    check_columns,
    func_name,
    mean_of_logged_metrics,
    raise_on_every_rank,
    weighted_sum,
)
from posttrain.rewards.models import (
    RewardModelInput,
    RewardSpec,
    as_completions,
    check_reward_weights,
    model_name,
    resolve_reward_specs,
    score_texts,
    scorer_input,
    scores_at,
)


@dataclass
class RewardSource:
    """One reward: a function (``func``) or a reward model (path or object) under its frozen ``role``."""

    name: str
    func: Callable | None = None
    role: str | None = None
    model: Any = None
    tokenizer: Any = None
    reads: RewardModelInput | None = None

    @property
    def is_model(self) -> bool:
        return self.role is not None


class Rewards:
    """Rewards in ``weights``' order (functions, models with ``tokenizers`` at the same index, or specs).
    ``reencode`` False: a model sharing the policy's vocab reads its ids. Call plan, load, then score."""

    session: Any = None
    warnings: RewardWarnings | None = None

    def __init__(self, rewards: Sequence[Any], weights: Sequence[float] | None = None, *,
                 tokenizers: Sequence[Any] | None = None, reencode: bool = True, batch_size: int = 64,
                 chat_template_kwargs: dict | None = None, what: str = "rewards (functions and models)") -> None:
        if not rewards:
            raise ConfigError("no reward given: name a reward function or a reward model")
        tokenizers = list(tokenizers) if tokenizers is not None else [None] * len(rewards)
        self.sources: list[RewardSource] = []
        for entry, tok in zip(rewards, tokenizers, strict=True):
            if isinstance(entry, (str, Path)):
                (entry,) = resolve_reward_specs([str(entry)])
            if isinstance(entry, RewardSpec) and entry.is_model:
                self._add_model(entry.path, None)
            elif isinstance(entry, RewardSpec):
                self.sources.append(RewardSource(func_name(entry.func), func=entry.func))
            elif isinstance(entry, torch.nn.Module):
                self._add_model(entry, tok)
            elif callable(entry):
                self.sources.append(RewardSource(func_name(entry), func=entry))
            else:
                raise ConfigError(f"reward {entry!r} is not a function, a reward model or a reward's name: give "
                                  "a function, a sequence-classification model, or its path")
        self.weights = torch.tensor(check_reward_weights(weights, len(self.sources), what))
        self.reencode, self.batch_size, self.chat_template_kwargs = reencode, batch_size, chat_template_kwargs
        self.pad_token_id: int | None = None
        self._extra_columns: dict[str, list] = {}
        self._logged: dict[str, list[float]] = {}

    def _add_model(self, model: Any, tokenizer: Any) -> None:
        n = len(self.roles)
        name = Path(model_name(model) or type(model).__name__).name
        self.sources.append(RewardSource(name, role="reward" if not n else f"reward_{n}", model=model,
                                         tokenizer=tokenizer))

    @property
    def names(self) -> list[str]:
        """TRL's metric names (``rewards/<name>/mean``), in order."""
        return [src.name for src in self.sources]

    @property
    def models(self) -> list[RewardSource]:
        return [src for src in self.sources if src.is_model]

    @property
    def roles(self) -> list[str]:
        """The reward models' frozen roles."""
        return [src.role for src in self.models]

    def check_columns(self, rows: list[dict]) -> None:
        """Every reward function's required keyword arguments are columns of the prompts."""
        columns = [k for k in rows[0] if k != "prompt"] if rows else []
        for src in self.sources:
            if not src.is_model:
                check_columns(src.func, columns)

    def plan(self, policy_config: Any, tokenizer: Any) -> None:
        """Decide how each reward model reads completions, before anything loads."""
        vocab = policy_config.get_text_config().vocab_size
        self.pad_token_id = tokenizer.pad_token_id
        for src in self.models:
            src.reads = scorer_input(src.model, tokenizer, vocab, "reward model", reencode=self.reencode,
                                     tokenizer=src.tokenizer)

    def load(self, session: Any) -> None:
        """Each reward model under its own frozen role (an object is taken as it is)."""
        from transformers import AutoModelForSequenceClassification

        self.session = session
        self.warnings = RewardWarnings(self.names, session.is_main_process)
        for src in self.models:
            model = session.load(src.role, src.model, model_cls=AutoModelForSequenceClassification, num_labels=1)
            src.reads.prepare(model)  # its pad id is its tokenizer's (TRL's), for its own pooling
            session.prepare(src.role, model)

    def score(self, prompts: list, texts: list[str], completion_ids: list[list[int]], *,
              rows: list[dict] | None = None, trainer_state: Any = None, sequences: torch.Tensor | None = None,
              last: torch.Tensor | None = None, completions: list | None = None,
              extra: dict[str, Any] | None = None) -> torch.Tensor:
        """(local batch, sources) float32, NaN for None; shared-ids RMs read ``sequences`` at ``last``;
        ``completions``: what functions get instead of ``texts`` (a multi-turn conversation's messages);
        ``extra``: more keyword arguments for them (``environments``, a rollout_func's fields)."""
        s = self.session
        out = torch.zeros(len(texts), len(self.sources), dtype=torch.float32, device=s.device)
        funcs = [(j, src.func) for j, src in enumerate(self.sources) if not src.is_model]
        if funcs:
            kwargs: dict[str, Any] = {}
            if rows:
                kwargs = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
            if trainer_state is not None:
                kwargs.update(trainer_state=trainer_state, log_extra=self.log_extra, log_metric=self.log_metric)
            kwargs.update(extra or {})
            failure = per_func = None
            try:
                given = completions if completions is not None else as_completions(prompts, texts)
                per_func = call_reward_funcs([f for _, f in funcs], prompts, given,
                                             completion_ids, s.device, **kwargs)
            except RewardFuncError as err:
                failure = err
            raise_on_every_rank(s, failure)
            for col, (j, _) in enumerate(funcs):
                out[:, j] = per_func[:, col]
        for j, src in enumerate(self.sources):
            if src.is_model:
                with s.activate(src.role):
                    out[:, j] = self._model_scores(src, prompts, texts, sequences, last)
        return out

    def _model_scores(self, src: RewardSource, prompts: list, texts: list[str], sequences: torch.Tensor | None,
                      last: torch.Tensor | None) -> torch.Tensor:
        engine, bs = self.session.engines[src.role], self.batch_size
        if not src.reads.shares_policy_ids:
            return score_texts(engine, src.reads, prompts, texts, self.session.device, batch_size=bs,
                               chat_template_kwargs=self.chat_template_kwargs)
        if sequences is None or last is None:
            raise ValueError(f"reward model {src.name} reads the policy's ids: pass sequences= and last=")
        return torch.cat([scores_at(engine, sequences[i : i + bs], self.pad_token_id, last[i : i + bs])
                          for i in range(0, sequences.shape[0], bs)]).float()

    def total(self, per_func: torch.Tensor) -> torch.Tensor:
        """The weighted sum (TRL's): NaN where no reward scored the completion."""
        return weighted_sum(per_func, self.weights)

    def metrics(self, all_per_func: torch.Tensor) -> dict[str, float]:
        """TRL's reward metrics (``rewards/<name>/mean``/``std``, ``reward``, ``reward_std``) of a batch."""
        from trl.trainer.utils import nanstd

        m: dict[str, float] = {}
        for j, name in enumerate(self.names):
            m[f"rewards/{name}/mean"] = torch.nanmean(all_per_func[:, j]).item()
            m[f"rewards/{name}/std"] = nanstd(all_per_func[:, j]).item()
        total = self.total(all_per_func)
        m["reward"] = torch.nanmean(total).item()
        m["reward_std"] = nanstd(total).item()
        return m

    def warn(self, all_per_func: torch.Tensor) -> None:
        """Say once per run what TRL leaves silent (see :class:`RewardWarnings`)."""
        self.warnings.check(all_per_func)

    def log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column for the logged samples (samples.jsonl)."""
        self._extra_columns.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar averaged over every process into this generation's metrics."""
        self._logged.setdefault(name, []).append(float(value))

    def logged_metrics(self) -> dict[str, float]:
        """The metrics reward functions logged on this batch, averaged over processes; then cleared."""
        out = mean_of_logged_metrics(self.session, self._logged)
        self._logged.clear()
        return out

    def extra_columns(self) -> dict[str, list]:
        """The columns reward functions logged on this generation batch; then cleared."""
        out, self._extra_columns = self._extra_columns, {}
        return out
