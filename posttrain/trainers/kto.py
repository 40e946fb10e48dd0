"""KTO with the policy and the frozen reference under their own DeepSpeed plugins; the loss, the KL
estimate from mismatched pairs and the metrics are ``trl.KTOTrainer``'s (TRL 1.16), formula by formula."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import trl

from posttrain.data import unpaired
from posttrain.data.order import seed_everything
from posttrain.data.preference import as_dataset
from posttrain.errors import ConfigError
from posttrain.models.lora import adapters_disabled, check_no_head_adapter
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import distinct_objects, init_kwargs, model_and_tokenizer
from posttrain.placement.ranks import mean_over_ranks, sum_over_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.trainers.config import TrainConfig, check_eval_data, make_session, row_schedule
from posttrain.trainers.loop import Trainer, default_args, refuse_arguments, window_mean
from posttrain.trainers.reference import ReferenceRole
from posttrain.trainers.run_log import Phases

logger = logging.getLogger(__name__)

# Every loss_type trl.KTOTrainer 1.16 accepts; "apo_zero_unpaired" has no KL term.
LOSS_TYPES = ("kto", "apo_zero_unpaired")
SAMPLING = ("sequential", "random")
# TRL's metrics, each the mean over the micro-batches that had it since the last log.
METRICS = ("kl", "entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen",
           "rewards/rejected", "logps/rejected", "rewards/margins")


@dataclass
class KTOConfig(TrainConfig, trl.KTOConfig):
    """``trl.KTOConfig`` (its fields, names and defaults) plus posttrain's placement fields."""

    _algorithm = "KTO"
    _trl_works = ("model_init_kwargs", "trust_remote_code", "disable_dropout", "dataset_num_proc", "max_length",
                  "pad_to_multiple_of", "precompute_ref_log_probs", "precompute_ref_batch_size", "loss_type", "beta",
                  "desirable_weight", "undesirable_weight", "sync_ref_model", "ref_model_mixup_alpha",
                  "ref_model_sync_steps", "train_sampling_strategy")
    _trl_refused = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        validate(self)


def validate(cfg: KTOConfig) -> None:
    """TRL's checks on the KTO settings, raised before any model is loaded."""
    if cfg.loss_type not in LOSS_TYPES:
        raise ConfigError(f"unknown loss_type {cfg.loss_type!r}: choose from {', '.join(LOSS_TYPES)}")
    if cfg.train_sampling_strategy not in SAMPLING:
        raise ConfigError(f"train_sampling_strategy {cfg.train_sampling_strategy!r} is not supported for KTO: use "
                          "'sequential' (TRL's default) or, with loss_type 'apo_zero_unpaired', 'random'")
    if uses_kl(cfg):
        if cfg.train_sampling_strategy != "sequential":
            raise ConfigError(f"loss_type {cfg.loss_type!r} estimates the KL term from each row's neighbours in the "
                              "dataset's order, so rows must come in that order: set train_sampling_strategy "
                              "'sequential' (TRL's rule)")
        if cfg.per_device_train_batch_size <= 1:
            raise ConfigError(f"loss_type {cfg.loss_type!r} estimates the KL term from the other rows of a micro-batch: "
                              "set per_device_train_batch_size to 2 or more")
    if cfg.sync_ref_model:
        if cfg.precompute_ref_log_probs:
            raise ConfigError("sync_ref_model changes the reference during training, so precomputed reference "
                              "log-probs would go stale: drop precompute_ref_log_probs or sync_ref_model")
        if cfg.ref_model_sync_steps < 1 or not 0.0 < cfg.ref_model_mixup_alpha <= 1.0:
            raise ConfigError("sync_ref_model needs ref_model_sync_steps >= 1 and 0 < ref_model_mixup_alpha <= 1")


def uses_kl(cfg: KTOConfig) -> bool:
    return cfg.loss_type != "apo_zero_unpaired"


# The per-token fields TRL's KTOTrainer asks of the policy's fused head (mean_logits feeds logits/*).
FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits")


def completion_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     completion_mask: torch.Tensor, stats: bool = False, fused: bool = False) -> dict[str, torch.Tensor]:
    """Each sequence's summed completion log-prob; with ``stats`` also per-token entropy and mean logit.
    ``fused``: the model has TRL's fused LM head (no full logits), else the logits are computed."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    if fused:
        labels = input_ids.masked_fill(completion_mask == 0, -100)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False,
                    fused_lm_head=True)
        width = input_ids.size(1) - 1  # prompt-learning adapters prepend positions: keep the real ones (TRL)
        result = {"logps": out.log_probs[:, -width:].sum(-1)}
        if stats:
            result["entropy"] = out.entropy[:, -width:].detach()
            result["mean_logits"] = out.mean_logits[:, -width:].detach()
        return result
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    mask = completion_mask[:, 1:]
    out = {"logps": (selective_log_softmax(logits, input_ids[:, 1:]) * mask).sum(1)}
    if stats:
        with torch.no_grad():
            out["entropy"] = entropy_from_logits(logits)
            out["mean_logits"] = logits.mean(-1)
    return out


def kto_losses(cfg: KTOConfig, logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor,
               kl: torch.Tensor) -> torch.Tensor:
    """The weighted per-row losses, desirable rows first (TRL's order); their nanmean is TRL's loss."""
    logratios = logps - ref_logps
    chosen, rejected = logratios[labels], logratios[~labels]
    if cfg.loss_type == "kto":  # Eqn (7) of the KTO paper
        chosen_losses = 1 - F.sigmoid(cfg.beta * (chosen - kl))
        rejected_losses = 1 - F.sigmoid(cfg.beta * (kl - rejected))
    else:  # the unpaired APO-zero loss
        chosen_losses = 1 - F.sigmoid(cfg.beta * chosen)
        rejected_losses = F.sigmoid(cfg.beta * rejected)
    return torch.cat((cfg.desirable_weight * chosen_losses, cfg.undesirable_weight * rejected_losses), 0)


# The sums one micro-batch's metrics need, reduced over processes in one call.
_SUMS = ("kl", "kl_ranks", "entropy", "tokens", "logits/chosen", "tokens/chosen", "logits/rejected",
         "tokens/rejected", "n_chosen", "n_rejected", "rewards/chosen", "logps/chosen", "rewards/rejected",
         "logps/rejected", "num_tokens")


class KTOTrainer(ReferenceRole, Trainer):
    """KTO; the reference is a frozen ``reference`` role (``ref_model=``, else the policy's weights; freed
    after one pass with ``precompute_ref_log_probs``), or with ``peft_config`` and no ``ref_model`` the
    policy's base with adapters disabled."""

    name = "kto"
    shown = ("loss", "kl", "rewards/margins", "eval/loss", "eval/rewards/margins")
    roles = TRAINER_ROLES["kto"]  # with peft_config and no ref_model, no reference role
    evaluates = True

    def __init__(self, model: Any, ref_model: Any = None, args: KTOConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 quantization_config: Any = None, peft_config: Any = None) -> None:
        refuse_arguments("KTOTrainer", data_collator=data_collator, compute_metrics=compute_metrics,
                         optimizers=optimizers, quantization_config=quantization_config)
        self.cfg = cfg = args if args is not None else default_args(KTOConfig, model, "KTO")
        check_eval_data(cfg, eval_dataset)
        if train_dataset is None:
            raise ConfigError("KTOTrainer needs train_dataset= (a datasets.Dataset or a list of rows)")
        validate(cfg)
        if peft_config is not None:
            check_no_head_adapter(peft_config)  # TRL: the fused head reads lm_head.weight, an adapter there never trains
        if cfg.sync_ref_model and peft_config is not None:  # TRL's rule
            raise ConfigError("sync_ref_model needs a reference model of its own to update, and with peft_config the "
                              "reference is the policy's base (adapters disabled): drop sync_ref_model or peft_config")
        distinct_objects(model=model, ref_model=ref_model)
        # Every row is checked before the tokenizer or any model loads.
        train_dataset = as_dataset(train_dataset, "train_dataset")
        unpaired.check_rows(train_dataset, "train_dataset")
        if eval_dataset is not None:
            eval_dataset = as_dataset(eval_dataset, "eval_dataset")
            unpaired.check_rows(eval_dataset, "eval_dataset", both_labels=False)
        seed_everything(cfg.seed)
        policy, self.tokenizer, _ = model_and_tokenizer(cfg, model, processing_class, what="policy")
        if self.tokenizer.pad_token is None:  # TRL's pad token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

        self.collate = DataCollatorForUnpairedPreference(pad_token_id=self.tokenizer.pad_token_id,
                                                         max_length=cfg.max_length,
                                                         pad_to_multiple_of=cfg.pad_to_multiple_of)
        self.peft_config = peft_config
        # TRL's rule: with adapters and no ref_model, the reference is the base model (adapters disabled).
        frozen = [] if peft_config is not None and ref_model is None else list(self.roles["frozen"])

        # TRL pairs KL completions in runs of per_device_train_batch_size rows, for eval data too.
        group = cfg.per_device_train_batch_size if uses_kl(cfg) else None
        prep = dict(tokenizer=self.tokenizer, max_length=cfg.max_length, kl_group=group, num_proc=cfg.dataset_num_proc)
        self.train_rows = unpaired.prepare_unpaired_dataset(train_dataset, name="train_dataset", **prep)
        self.eval_rows = (unpaired.prepare_unpaired_dataset(eval_dataset, name="eval_dataset", both_labels=False,
                                                            **prep) if eval_dataset is not None else None)
        _weight_advice(cfg, self.train_rows)

        self.loader, self.schedule = row_schedule(cfg, len(self.train_rows),
                                                  shuffle=cfg.train_sampling_strategy == "random")
        self.total_steps = self.schedule.max_steps
        self.session = make_session(cfg, self.roles["trained"], frozen, total_steps=self.total_steps)
        self.phases = Phases()
        self.num_tokens = 0
        # TRL loads models in float32 unless told otherwise; mixed precision then casts inside DeepSpeed.
        kwargs = init_kwargs(cfg, dtype="float32")

        self.reference = None
        if frozen:
            self._load_reference(ref_model, policy, kwargs)

        model = self.session.load("policy", policy, **kwargs)
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id  # as TRL: model and tokenizer agree
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=FUSED_OUTPUTS)  # TRL's: per-token fields without the full logits
        self.policy = self.model = prepare_trained(self.session, "policy", model, cfg, self.peft_config,
                                                   total_steps=self.total_steps)
        if not frozen and cfg.precompute_ref_log_probs:
            self._precompute_all()  # the base model, adapters disabled: saves two forwards per micro-batch
        self.setup_times = self.phases.pop()  # kept apart so every logged row has the same keys
        self._steps = None
        self._finish_init(callbacks)

    # -- reference -------------------------------------------------------------------------------
    @torch.no_grad()
    def _precompute(self, rows: list[dict], bs: int) -> None:
        """Reference log-probs of every row and of its KL sequence, stored in the rows (TRL's ``ref_logps``,
        ``ref_KL_logps``); each process computes its share, the sum over processes fills the rest."""
        rank, world = self.session.process_index, self.session.num_processes
        values = torch.zeros(len(rows), 2, dtype=torch.float64, device=self.session.device)
        mine = list(range(rank, len(rows), world))
        per_rank = math.ceil(len(rows) / world)
        for start in range(0, per_rank, bs):  # the same number of batches on every process (ZeRO-3 gathers)
            idx = mine[start : start + bs]
            valid = len(idx)
            idx = idx + [0] * (min(bs, per_rank - start) - valid)
            batch = self._to_device(self.collate([_model_inputs(rows[i]) for i in idx]))
            ref, ref_kl = self._reference_forward(batch)
            values[idx[:valid], 0] = ref[:valid].double()
            if ref_kl is not None:
                values[idx[:valid], 1] = ref_kl[:valid].double()
        values = sum_over_ranks(self.session, values)
        for row, (ref, ref_kl) in zip(rows, values.tolist()):
            row["ref_logps"] = ref
            if uses_kl(self.cfg):
                row["ref_KL_logps"] = ref_kl

    @torch.no_grad()
    def _reference_forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.reference is None:  # adapters and no reference model of its own
            with adapters_disabled(self.policy):
                return self._logps_pair(self.policy, batch, fused=True)
        # A frozen role runs its own forward (ZeRO-3's gathered layers): the logits path.
        return self._logps_pair(self.reference, batch, fused=False)

    def _logps_pair(self, model: Any, batch: dict, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        main = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                fused=fused)
        kl = None
        if "KL_input_ids" in batch:
            kl = completion_logps(model, batch["KL_input_ids"], batch["KL_attention_mask"],
                                  batch["KL_completion_mask"], fused=fused)["logps"]
        return main["logps"], kl

    def _reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        if "ref_logps" in batch:
            dtype = torch.get_default_dtype()
            return batch["ref_logps"].to(dtype), batch["ref_KL_logps"].to(dtype) if "ref_KL_logps" in batch else None
        return self._reference_forward(batch)

    # -- loss ------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict, counted: bool = True) -> tuple[torch.Tensor, dict[str, float], int]:
        """One micro-batch's loss and TRL's metrics for it (over every process's micro-batch, as TRL gathers
        them), and its rows. ``counted`` False: a process's filler batch (evaluation), left out of the metrics."""
        batch = self._to_device(batch)
        labels = batch["label"].bool()
        with self.phases("policy_forward"):
            kl_logps = None
            if "KL_input_ids" in batch:
                with torch.no_grad():
                    kl_logps = completion_logps(self.policy, batch["KL_input_ids"], batch["KL_attention_mask"],
                                                batch["KL_completion_mask"], fused=True)["logps"]
            policy = completion_logps(self.policy, batch["input_ids"], batch["attention_mask"],
                                      batch["completion_mask"], stats=True, fused=True)
        with self.phases("reference"):
            ref_logps, ref_kl_logps = self._reference_logps(batch)
        logps = policy["logps"]
        w = float(counted)
        mask = batch["completion_mask"][:, 1:].bool()
        chosen_mask, rejected_mask = mask[labels], mask[~labels]
        detached = logps.detach()
        rewards = self.cfg.beta * (detached - ref_logps)
        local = {
            "kl": (kl_logps - ref_kl_logps).mean() if kl_logps is not None else torch.zeros((), device=logps.device),
            "kl_ranks": torch.ones((), device=logps.device),
            "entropy": policy["entropy"][mask].sum(), "tokens": mask.sum(),
            "logits/chosen": policy["mean_logits"][labels][chosen_mask].sum(), "tokens/chosen": chosen_mask.sum(),
            "logits/rejected": policy["mean_logits"][~labels][rejected_mask].sum(),
            "tokens/rejected": rejected_mask.sum(), "n_chosen": labels.sum(), "n_rejected": (~labels).sum(),
            "rewards/chosen": rewards[labels].sum(), "logps/chosen": detached[labels].sum(),
            "rewards/rejected": rewards[~labels].sum(), "logps/rejected": detached[~labels].sum(),
            "num_tokens": batch["attention_mask"].sum()}
        sums = torch.stack([local[k].double() * w for k in _SUMS])
        sums = dict(zip(_SUMS, sum_over_ranks(self.session, sums).tolist()))
        # TRL: each process's mean over its rows, averaged over processes, clamped at 0; 0 without a KL term.
        kl = max(sums["kl"] / sums["kl_ranks"], 0.0) if kl_logps is not None else 0.0
        loss = kto_losses(self.cfg, logps, ref_logps, labels, torch.tensor(kl, dtype=logps.dtype,
                                                                              device=logps.device)).nanmean()
        metrics = {"kl": kl, "entropy": sums["entropy"] / sums["tokens"] if sums["tokens"] > 0 else 0.0,
                   "num_tokens": sums["num_tokens"]}
        for side in ("chosen", "rejected"):
            if sums[f"tokens/{side}"] > 0:
                metrics[f"logits/{side}"] = sums[f"logits/{side}"] / sums[f"tokens/{side}"]
            if sums[f"n_{side}"] > 0:
                metrics[f"rewards/{side}"] = sums[f"rewards/{side}"] / sums[f"n_{side}"]
                metrics[f"logps/{side}"] = sums[f"logps/{side}"] / sums[f"n_{side}"]
        if sums["n_chosen"] > 0 and sums["n_rejected"] > 0:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return loss, metrics, len(labels)

    def training_step(self, step: int) -> dict[str, Any]:
        """One optimizer step. An epoch's last step may have fewer micro-batches than
        gradient_accumulation_steps: as TRL, it averages those."""
        cfg, s = self.cfg, self.session
        if self._steps is None:
            self._steps = self.loader.steps(self.schedule, s.process_index, start_step=step - 1)
        planned = next(self._steps)
        window = len(planned.batches)
        loss_sum, metric_sums = 0.0, {}
        for k, micro in enumerate(planned.batches):
            loss, metrics, _ = self.compute_loss(self.collate([_model_inputs(self.train_rows[i]) for i in micro.rows]))
            with self.phases("backward"):
                # The engine divides by gradient_accumulation_steps; TRL by the step's micro-batches.
                s.backward("policy", loss * (cfg.gradient_accumulation_steps / window), boundary=k == window - 1)
                s.step("policy")
            loss_sum += loss.item() / window
            self.num_tokens += int(metrics.pop("num_tokens"))
            for key, v in metrics.items():
                total, count = metric_sums.get(key, (0.0, 0))
                metric_sums[key] = (total + v, count + 1)
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
            with self.phases("ref_sync"):
                s.blend("reference", "policy", cfg.ref_model_mixup_alpha)
        return {"loss": loss_sum, "_metrics": metric_sums, "num_tokens": float(self.num_tokens),
                "grad_norm": s.grad_norm("policy") or 0.0, "learning_rate": s.learning_rate("policy"),
                "epoch": planned.epoch, **self.phases.pop()}

    def log_row(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """TRL's log: the loss averaged over steps and processes; each metric the mean of the values its
        micro-batches gave since the last log (already the same on every process)."""
        totals: dict[str, tuple[float, int]] = {}
        for row in rows:
            for key, (total, count) in row.pop("_metrics").items():
                t, c = totals.get(key, (0.0, 0))
                totals[key] = (t + total, c + count)
        out = mean_over_ranks(self.session, window_mean(rows))
        out.update({k: totals[k][0] / totals[k][1] for k in METRICS if k in totals})
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.num_tokens = int(state.get("num_tokens", 0))
        super().restore(state, checkpoint)

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, rows: list[dict] | None = None, prefix: str = "eval") -> dict[str, float]:
        """TRL's evaluation: batches of per_device_eval_batch_size in order, batch b on process b % world;
        the loss weighted by each batch's rows, each metric the mean over the batches that had it."""
        rows = rows if rows is not None else self.eval_rows
        if rows is None:
            raise ValueError("no eval_dataset was given")
        bs, world, rank = self.cfg.per_device_eval_batch_size, self.session.num_processes, self.session.process_index
        batches = [list(range(i, min(i + bs, len(rows)))) for i in range(0, len(rows), bs)]
        self.policy.eval()
        loss_sum, n, metric_sums = 0.0, 0, {}
        for start in range(0, len(batches), world):
            mine = start + rank
            counted = mine < len(batches)
            idx = batches[mine] if counted else batches[0]  # a filler: ZeRO-3 needs every process's forward
            loss, metrics, size = self.compute_loss(self.collate([_model_inputs(rows[i]) for i in idx]), counted)
            weighted = torch.tensor([loss.item() * size * counted, size * counted], dtype=torch.float64,
                                    device=self.session.device)
            weighted = sum_over_ranks(self.session, weighted).tolist()
            loss_sum, n = loss_sum + weighted[0], n + int(weighted[1])
            metrics.pop("num_tokens")
            for key, v in metrics.items():
                total, count = metric_sums.get(key, (0.0, 0))
                metric_sums[key] = (total + v, count + 1)
        self.phases.pop()
        self.policy.train()
        out = {f"{prefix}/loss": loss_sum / n, f"{prefix}/num_tokens": float(self.num_tokens)}  # TRL: the train count
        out.update({f"{prefix}/{k}": metric_sums[k][0] / metric_sums[k][1] for k in METRICS if k in metric_sums})
        return out


def _model_inputs(row: dict) -> dict:
    """What TRL's collator reads off a prepared row."""
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")
    return {k: row[k] for k in keys if k in row}


def _weight_advice(cfg: KTOConfig, rows: list[dict]) -> None:
    """TRL's warning when desirable/undesirable counts differ and neither weight is in Eq. (8)'s range."""
    num_desirable = max(sum(bool(r["label"]) for r in rows), 1)
    num_undesirable = max(len(rows) - num_desirable, 1)
    if num_desirable == num_undesirable:
        return
    ratio_d, ratio_u = num_undesirable * cfg.undesirable_weight / num_desirable, \
        num_desirable * cfg.desirable_weight / num_undesirable
    d_lo, d_hi = round(ratio_d, 2), round(ratio_d * 1.33, 2)
    u_lo, u_hi = round(ratio_u / 1.33, 2), round(ratio_u, 2)
    if not (d_lo <= cfg.desirable_weight <= d_hi or u_lo <= cfg.undesirable_weight <= u_hi):
        logger.warning("train_dataset has %d desirable and %d undesirable rows: set EITHER desirable_weight in "
                       "[%s, %s] or undesirable_weight in [%s, %s] (KTO paper, Eq. 8)", num_desirable,
                       num_undesirable, d_lo, d_hi, u_lo, u_hi)
