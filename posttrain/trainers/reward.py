"""Reward modelling with ``trl.RewardTrainer``'s data handling and loss, the model on its own plugin."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import trl

from posttrain.data import preference
from posttrain.data.order import seed_everything
from posttrain.errors import ConfigError
from posttrain.models import varlen_attention
from posttrain.models.packing import Packing, last_non_pad, packs
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import init_kwargs, model_and_tokenizer
from posttrain.models.tokenizer import check_tokenizer_fields, set_tokens
from posttrain.placement.ranks import gather_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rewards.models import head_outputs
from posttrain.trainers.config import TrainConfig, check_eval_data, make_session, row_schedule
from posttrain.trainers.loop import RowsTrainer, default_args, eval_shards, refuse_arguments
from posttrain.trainers.run_log import Phases

ROLE = "reward"


@dataclass
class RewardConfig(TrainConfig, trl.RewardConfig):
    """``trl.RewardConfig`` (its fields, names and defaults) plus posttrain's placement fields. As TRL,
    ``max_length`` drops the pairs with a side longer than it."""

    _algorithm = "reward modelling"
    _trl_works = ("model_init_kwargs", "trust_remote_code", "chat_template_path", "disable_dropout",
                  "dataset_num_proc", "eos_token", "pad_token", "max_length", "pad_to_multiple_of",
                  "center_rewards_coefficient")
    padding_free: bool = True  # the forward on packed rows (exact, no compute on padding); TRL's has no such field

    def __post_init__(self) -> None:
        super().__post_init__()
        check_tokenizer_fields(self)


def sequence_classification_adapters(peft_config: Any) -> tuple[Any, bool]:
    """``peft_config`` for a reward model: a causal-LM (or untyped) task type becomes ``SEQ_CLS``, so that peft
    trains the new score head beside the adapters (TRL 1.16 takes the task type as given: with ModelConfig's
    default ``CAUSAL_LM`` its score head stays at its random initialisation). Returns (config, changed)."""
    if peft_config is None or str(getattr(peft_config, "task_type", None) or "CAUSAL_LM") != "CAUSAL_LM":
        return peft_config, False
    changed = copy.copy(peft_config)
    changed.task_type = "SEQ_CLS"
    return changed, True


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


def sequence_rewards(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     padding_free: bool = False) -> torch.Tensor:
    """(B,) the classifier's score of each row at its last non-pad token (transformers' rule);
    ``padding_free``: the rows packed into one, the ``score`` head read at those tokens (a head of another
    name: padded)."""
    module = getattr(model, "module", model)
    if not (padding_free and packs(model)) or getattr(module, "score", None) is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.squeeze(-1)
    packing = Packing.of(attention_mask)
    pad = module.config.get_text_config().pad_token_id
    per_token = packing.unpack(head_outputs(model, **packing.model_inputs(input_ids))[0])
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return per_token[rows, last_non_pad(input_ids, pad)].squeeze(-1)


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

    def __init__(self, model: Any, args: RewardConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None) -> None:
        refuse_arguments("RewardTrainer", data_collator=data_collator, compute_metrics=compute_metrics,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config)
        self.cfg = cfg = args if args is not None else default_args(RewardConfig, model, "Reward")
        check_eval_data(cfg, eval_dataset)
        if train_dataset is None:
            raise ConfigError("RewardTrainer needs train_dataset= (a datasets.Dataset or a list of rows)")
        seed_everything(cfg.seed)
        source, self.tokenizer, path = model_and_tokenizer(cfg, model, processing_class, what="reward model")
        if isinstance(source, torch.nn.Module) and getattr(source.config, "num_labels", None) != 1:
            raise ConfigError(f"the reward model object has num_labels={source.config.num_labels}; a reward model "
                              "needs 1: build it with AutoModelForSequenceClassification(..., num_labels=1), or pass "
                              "its path to get a one-logit head")
        set_tokens(self.tokenizer, cfg)
        self.peft_config, retyped = sequence_classification_adapters(peft_config)
        self.collate = collator(self.tokenizer, cfg.pad_to_multiple_of)
        prep = dict(tokenizer=self.tokenizer, max_length=cfg.max_length, num_proc=cfg.dataset_num_proc)
        self.train_rows = prepare_reward_dataset(train_dataset, name="train_dataset", **prep)
        self.eval_rows = (prepare_reward_dataset(eval_dataset, name="eval_dataset", **prep)
                          if eval_dataset is not None else None)

        self.loader, self.schedule = row_schedule(cfg, len(self.train_rows), "pairs")  # TRL's Trainer order
        self.total_steps = self.schedule.max_steps
        self.session = make_session(cfg, [ROLE], [], total_steps=self.total_steps)
        if retyped and self.session.is_main_process:
            print("peft_config's task_type is CAUSAL_LM: trained as SEQ_CLS, so that the score head trains beside "
                  "the adapters (set --lora_task_type SEQ_CLS to say so)", flush=True)
        self.phases = Phases()
        from transformers import AutoModelForSequenceClassification

        kwargs = init_kwargs(cfg, dtype="float32", num_labels=1)
        varlen_attention.choose_for(self.session, kwargs, source, cfg.padding_free)
        model = self.session.load(ROLE, source, model_cls=AutoModelForSequenceClassification, **kwargs)
        if model.config.num_labels != 1:
            raise ConfigError(f"{path} has num_labels={model.config.num_labels}; a reward model needs 1: drop "
                              "num_labels from model_init_kwargs")
        # The classifier scores the last non-pad token: it must know the pad id.
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        model.config.pad_token_id = self.tokenizer.pad_token_id
        if cfg.eos_token is not None:  # as TRL: model and tokenizer agree on EOS
            model.config.get_text_config().eos_token_id = self.tokenizer.eos_token_id
        self.model = prepare_trained(self.session, ROLE, model, cfg, self.peft_config, total_steps=self.total_steps)
        self.setup_times = self.phases.pop()
        self.num_tokens = 0
        self._finish_init(callbacks)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = self._to_device(batch)
        with self.phases("forward"):
            rewards = sequence_rewards(self.model, batch["input_ids"], batch["attention_mask"], self.cfg.padding_free)
        return reward_loss(rewards.float(), batch.get("margin"), self.cfg.center_rewards_coefficient)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather_ranks(self.session, t)

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        """One optimizer step; loss, accuracy, margin, reward min/mean/max over ranks, as TRL logs them. An epoch's
        last step may have fewer micro-batches than gradient_accumulation_steps: as TRL, it averages those."""
        s, ga = self.session, self.cfg.gradient_accumulation_steps
        window = len(micro_batches)
        sums: dict[str, float] = {}
        tokens = 0
        for k, batch in enumerate(micro_batches):
            loss, values = self.compute_loss(batch)
            with self.phases("backward"):
                # The engine divides by gradient_accumulation_steps; TRL by the step's micro-batches.
                s.backward(ROLE, loss * (ga / window), boundary=k == window - 1)
                s.step(ROLE)
            means = torch.stack([loss.detach(), values["accuracy"].mean(), values["margin"].mean()])
            means = self._gather(means.unsqueeze(0)).mean(0)
            rewards = self._gather(values["rewards"])
            for key, v in zip(("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"),
                            (*means.tolist(), rewards.min().item(), rewards.mean().item(), rewards.max().item())):
                sums[key] = sums.get(key, 0.0) + v / window
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
            rewards = sequence_rewards(self.model, batch["input_ids"], batch["attention_mask"],
                                       cfg.padding_free).double()
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


