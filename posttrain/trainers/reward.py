"""Reward modelling with ``trl.RewardTrainer``'s data handling and loss, the model on its own plugin."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.data import preference
from posttrain.data.order import seed_everything
from posttrain.errors import ConfigError
from posttrain.models.lora import LoraFields, lora_config
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import ModelFields, model_and_tokenizer
from posttrain.models.tokenizer import TokenizerFields, set_tokens
from posttrain.placement.ranks import gather_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.trainers.config import TrainConfig, make_session, steps_for_rows
from posttrain.trainers.loop import RowsTrainer, eval_shards
from posttrain.trainers.run_log import Phases

ROLE = "reward"


@dataclass
class RewardConfig(TrainConfig, LoraFields, ModelFields, TokenizerFields):
    """Reward-model settings; names and defaults follow ``trl.RewardConfig`` where the concept is the same."""

    output_dir: str = "runs/reward"
    learning_rate: float = 1e-4
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024  # pairs with a side longer than this are dropped (TRL's rule)
    pad_to_multiple_of: int | None = None
    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_tokenizer_fields()


def prepare_reward_dataset(dataset: Any, tokenizer: Any, max_length: int | None, name: str = "dataset",
                           num_proc: int | None = None) -> list[dict]:
    """``chosen_ids``/``rejected_ids`` (and ``margin``) per pair, as ``trl.RewardTrainer._prepare_dataset``."""
    from trl.data_utils import is_conversational

    if isinstance(dataset, (list, tuple)):
        from datasets import Dataset

        dataset = Dataset.from_list(list(dataset))
    preference.check_rows(dataset, name)
    if is_conversational(dataset[0]) and tokenizer.chat_template is None:
        raise ConfigError(f"{name} is conversational but the tokenizer has no chat template: give one with "
                          "--chat_template_path FILE.jinja (or use a tokenizer that has one)")
    margins = None
    if "margin" in dataset.column_names:
        margins = dataset["margin"]
        bad = next((i for i, m in enumerate(margins) if not isinstance(m, (int, float)) or not math.isfinite(m)), None)
        if bad is not None:
            raise ConfigError(f"{name}: row {bad} has margin {margins[bad]!r}, not a finite number: fix or drop the row")
    # DPO's tokenization: prompt_ids + chosen_ids is the whole sequence, as TRL's reward trainer's.
    rows = preference.prepare_preference_dataset(dataset, tokenizer, max_length=None, name=name, num_proc=num_proc)
    out = []
    for i, row in enumerate(rows):
        pair = {"chosen_ids": row["prompt_ids"] + row["chosen_ids"], "rejected_ids": row["prompt_ids"] + row["rejected_ids"]}
        if margins is not None:
            pair["margin"] = float(margins[i])
        if max_length is None or (len(pair["chosen_ids"]) <= max_length and len(pair["rejected_ids"]) <= max_length):
            out.append(pair)
    if not out:
        raise ConfigError(f"{name}: every pair has a side longer than max_length={max_length}: raise --max_length")
    return out


def collator(tokenizer: Any, pad_to_multiple_of: int | None = None) -> Any:
    """TRL's reward ``DataCollatorForPreference``: [chosen; rejected] rows right-padded (and ``margin``)."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    return DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


def reward_loss(rewards: torch.Tensor, margin: torch.Tensor | None,
                center_rewards_coefficient: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss of [chosen; rejected] rewards and the detached per-pair metric values."""
    chosen, rejected = rewards.chunk(2)
    diff = chosen - rejected
    loss = -F.logsigmoid(diff - margin if margin is not None else diff).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    d = diff.detach()
    return loss, {"accuracy": (d > 0).float(), "margin": d, "rewards": rewards.detach()}


class RewardTrainer(RowsTrainer):
    """A Bradley-Terry reward model: the config's path (one-logit head) or ``model=`` (``num_labels=1``)."""

    name = "reward"
    shown = ("loss", "accuracy", "eval/accuracy")
    roles = TRAINER_ROLES["reward"]
    evaluates = True

    def __init__(self, args: RewardConfig, train_dataset: Any, eval_dataset: Any = None, peft_config: Any = None,
                 *, model: Any = None, processing_class: Any = None) -> None:
        self.cfg = cfg = args
        seed_everything(cfg.seed)
        source, self.tokenizer, path = model_and_tokenizer(cfg, model, processing_class, what="reward model")
        if isinstance(source, torch.nn.Module) and getattr(source.config, "num_labels", None) != 1:
            raise ConfigError(f"the reward model object has num_labels={source.config.num_labels}; a reward model "
                              "needs 1: build it with AutoModelForSequenceClassification(..., num_labels=1), or pass "
                              "its path to get a one-logit head")
        set_tokens(self.tokenizer, cfg)
        self.peft_config = peft_config if peft_config is not None else lora_config(cfg, "SEQ_CLS")
        self.collate = collator(self.tokenizer, cfg.pad_to_multiple_of)
        prep = dict(tokenizer=self.tokenizer, max_length=cfg.max_length, num_proc=cfg.dataset_num_proc)
        self.train_rows = prepare_reward_dataset(train_dataset, name="train_dataset", **prep)
        self.eval_rows = (prepare_reward_dataset(eval_dataset, name="eval_dataset", **prep)
                          if eval_dataset is not None else None)

        self.total_steps = steps_for_rows(cfg, len(self.train_rows), "pairs")
        self.session = make_session(cfg, [ROLE], [], total_steps=self.total_steps)
        self.phases = Phases()
        from transformers import AutoModelForSequenceClassification

        kwargs = {"dtype": "float32", "num_labels": 1, **(cfg.model_init_kwargs or {})}
        model = self.session.load(ROLE, source, model_cls=AutoModelForSequenceClassification, **kwargs)
        if model.config.num_labels != 1:
            raise ConfigError(f"{path} has num_labels={model.config.num_labels}; a reward model needs 1: drop "
                              "num_labels from model_init_kwargs")
        # The classifier scores the last non-pad token: it must know the pad id.
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = prepare_trained(self.session, ROLE, model, cfg, self.peft_config, total_steps=self.total_steps)
        self.setup_times = self.phases.pop()
        self.num_tokens = 0

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = self._to_device(batch)
        with self.phases("forward"):
            rewards = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 use_cache=False).logits.squeeze(-1)
        return reward_loss(rewards.float(), batch.get("margin"), self.cfg.center_rewards_coefficient)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather_ranks(self.session, t)

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        """One optimizer step; loss, accuracy, margin, reward min/mean/max over ranks, as TRL logs them."""
        s, ga = self.session, self.cfg.gradient_accumulation_steps
        sums: dict[str, float] = {}
        tokens = 0
        for batch in micro_batches:
            loss, values = self.compute_loss(batch)
            with self.phases("backward"):
                s.backward(ROLE, loss)
                s.step(ROLE)
            means = torch.stack([loss.detach(), values["accuracy"].mean(), values["margin"].mean()])
            means = self._gather(means.unsqueeze(0)).mean(0)
            rewards = self._gather(values["rewards"])
            for k, v in zip(("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"),
                            (*means.tolist(), rewards.min().item(), rewards.mean().item(), rewards.max().item())):
                sums[k] = sums.get(k, 0.0) + v / ga
            tokens += int(batch["attention_mask"].sum())
        n = torch.tensor([tokens], device=s.device)
        self.num_tokens += int(self._gather(n).sum())
        return {**sums, "num_tokens": float(self.num_tokens)}

    @torch.no_grad()
    def evaluate(self, rows: list[dict] | None = None, prefix: str = "eval") -> dict[str, float]:
        """Loss, accuracy, margin and rewards' min/mean/max over every eval pair, whatever the world size."""
        rows = rows if rows is not None else self.eval_rows
        if rows is None:
            raise ValueError("no eval_dataset was given")
        s, bs = self.session, self.cfg.per_device_eval_batch_size
        self.model.eval()
        sums = torch.zeros(5, dtype=torch.float64, device=s.device)  # loss, accuracy, margin, pairs, reward sum
        lo = torch.full((1,), math.inf, dtype=torch.float64, device=s.device)
        hi = torch.full((1,), -math.inf, dtype=torch.float64, device=s.device)
        cfg = self.cfg
        for idx in eval_shards(s, len(rows), bs):
            loss_rows = idx or [0]  # a rank out of pairs still joins the collective forward
            batch = self._to_device(self.collate([rows[i] for i in loss_rows]))
            rewards = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 use_cache=False).logits.squeeze(-1).double()
            if not idx:
                continue
            chosen, rejected = rewards.chunk(2)
            diff = chosen - rejected
            m = batch["margin"].double() if "margin" in batch else 0.0
            per_pair = -F.logsigmoid(diff - m)
            if cfg.center_rewards_coefficient is not None:
                per_pair = per_pair + cfg.center_rewards_coefficient * (chosen + rejected) ** 2
            sums += torch.stack([per_pair.sum(), (diff > 0).double().sum(), diff.sum(),
                                 torch.tensor(float(len(idx)), dtype=torch.float64, device=s.device), rewards.sum()])
            lo = torch.minimum(lo, rewards.min().reshape(1))
            hi = torch.maximum(hi, rewards.max().reshape(1))
        if s.num_processes > 1:
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        self.phases.pop()
        self.model.train()
        n = sums[3].item()
        return {f"{prefix}/loss": sums[0].item() / n, f"{prefix}/accuracy": sums[1].item() / n,
                f"{prefix}/margin": sums[2].item() / n, f"{prefix}/min_reward": lo.item(),
                f"{prefix}/mean_reward": sums[4].item() / (2 * n), f"{prefix}/max_reward": hi.item()}


