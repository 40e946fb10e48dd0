"""DPO with the policy and the frozen reference under their own DeepSpeed plugins; the loss and
metrics are ``trl.DPOTrainer``'s (TRL 1.16), formula by formula."""

from __future__ import annotations

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
from posttrain.models.lora import adapters_disabled
from posttrain.models.packing import Packing, packs
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import distinct_objects, init_kwargs, model_and_tokenizer
from posttrain.placement.ranks import sum_over_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.trainers.config import TrainConfig, check_eval_data, make_session, row_schedule
from posttrain.trainers.loop import Trainer, default_args, refuse_arguments
from posttrain.trainers.reference import ReferenceRole
from posttrain.trainers.run_log import Phases

# Every loss_type trl.DPOTrainer 1.16 accepts; none needs a model besides policy and reference.
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# The f-DPO reparameterisation only cancels log Z(x) in the chosen-rejected difference (TRL's rule).
F_DIVERGENCE_LOSS_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class DPOConfig(TrainConfig, trl.DPOConfig):
    """``trl.DPOConfig`` (its fields, names and defaults) plus posttrain's placement fields."""

    _algorithm = "DPO"
    _trl_works = ("model_init_kwargs", "trust_remote_code", "disable_dropout", "dataset_num_proc", "max_length",
                  "truncation_mode", "pad_to_multiple_of", "pad_token", "precompute_ref_log_probs",
                  "precompute_ref_batch_size", "loss_type", "loss_weights", "ld_alpha", "f_divergence_type",
                  "f_alpha_divergence_coef", "label_smoothing", "beta", "use_weighting", "discopop_tau",
                  "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "padding_free")
    # On: packed forwards are exact and skip the padding (TRL 1.16's DPOTrainer turns padding_free off and pads).
    padding_free: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        super().__post_init__()
        validate(self)


def validate(cfg: DPOConfig) -> None:
    """TRL's checks on the loss settings, raised before any model is loaded."""
    unknown = [t for t in cfg.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise ConfigError(f"unknown loss_type {unknown[0]!r}: choose from {', '.join(LOSS_TYPES)}")
    if cfg.loss_weights is not None and len(cfg.loss_weights) != len(cfg.loss_type):
        raise ConfigError(f"loss_weights has {len(cfg.loss_weights)} values for {len(cfg.loss_type)} loss types: give one "
                          "weight per loss type")
    if cfg.f_divergence_type not in F_DIVERGENCES:
        raise ConfigError(f"unknown f_divergence_type {cfg.f_divergence_type!r}: choose from {', '.join(F_DIVERGENCES)}")
    if cfg.f_divergence_type != "reverse_kl" and not set(cfg.loss_type) <= F_DIVERGENCE_LOSS_TYPES:
        raise ConfigError(f"f_divergence_type={cfg.f_divergence_type!r} supports only {sorted(F_DIVERGENCE_LOSS_TYPES)}")
    if "exo_pair" in cfg.loss_type and cfg.label_smoothing == 0.0:
        raise ConfigError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
    if cfg.use_weighting and {"aot", "aot_unpaired"} & set(cfg.loss_type):
        raise ConfigError("use_weighting does not apply to 'aot'/'aot_unpaired': they sort the pairs")
    if cfg.truncation_mode not in ("keep_start", "keep_end"):
        raise ConfigError(f"truncation_mode must be 'keep_start' or 'keep_end', got {cfg.truncation_mode!r}")
    if cfg.sync_ref_model:
        if cfg.precompute_ref_log_probs:
            raise ConfigError("sync_ref_model changes the reference during training, so precomputed reference "
                              "log-probs would go stale: drop precompute_ref_log_probs or sync_ref_model")
        if cfg.ref_model_sync_steps < 1 or not 0.0 < cfg.ref_model_mixup_alpha <= 1.0:
            raise ConfigError("sync_ref_model needs ref_model_sync_steps >= 1 and 0 < ref_model_mixup_alpha <= 1")


def sequence_logps(model: Any, batch: dict, ld_alpha: float | None, stats: bool = False,
                   padding_free: bool = False) -> dict[str, torch.Tensor]:
    """Per-token completion log-probs and their (LD-weighted) sum per sequence; with ``stats``, also
    the per-token entropy, mean logit, top-1 hit and log sum p². ``padding_free``: the forward on the
    batch's packed row, every per-token value put back in the padded layout (0 at padding)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    ids = batch["input_ids"]
    if padding_free and packs(model):
        packing = Packing.of(batch["attention_mask"])
        inputs = packing.model_inputs(ids)
        logits = model(**inputs, use_cache=False).logits[0].float()
        # Each packed token predicts the next one; across a sequence boundary the value lands on padding.
        labels = torch.roll(inputs["input_ids"][0], -1)

        def per_position(values: torch.Tensor) -> torch.Tensor:
            return packing.unpack(values)[:, :-1]
    else:
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
        logits = logits[:, :-1].float()
        labels = ids[:, 1:]

        def per_position(values: torch.Tensor) -> torch.Tensor:
            return values
    mask = batch["completion_mask"][:, 1:]
    per_token = per_position(selective_log_softmax(logits, labels)) * mask
    out = {"per_token_logps": per_token, "logps": _reduce(per_token, mask, ld_alpha)}
    if stats:
        with torch.no_grad():
            out["entropy"] = per_position(entropy_from_logits(logits))
            out["mean_logits"] = per_position(logits.mean(-1))
            out["is_top1"] = per_position(logits.argmax(-1) == labels)
            out["log_sum_sq_probs"] = per_position(torch.logsumexp(2 * logits.log_softmax(-1), dim=-1))
    return out


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    if ld_alpha is None:
        return per_token.sum(1)
    # LD-DPO: tokens past the shorter completion of the pair count with weight ld_alpha.
    pos = mask.cumsum(1)
    chosen_len, rejected_len = mask.sum(1).long().chunk(2)
    shared = torch.minimum(chosen_len, rejected_len).repeat(2).unsqueeze(1)
    return (per_token * ((pos > 0) & (pos <= shared))).sum(1) + ld_alpha * (per_token * (pos > shared)).sum(1)


def _scores(cfg: DPOConfig, logratios: torch.Tensor) -> torch.Tensor:
    kind = cfg.f_divergence_type
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(cfg.f_alpha_divergence_coef - 1.0) < 1e-6):
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    a = cfg.f_alpha_divergence_coef
    t = torch.clamp(((a - 1.0) * logratios).float(), max={torch.float16: 11.0}.get(logratios.dtype, 80.0))
    return (torch.exp(t) - 1.0).to(logratios.dtype) / (a - 1.0)


def dpo_losses(cfg: DPOConfig, policy: dict, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               completion_mask: torch.Tensor) -> torch.Tensor:
    """Per-pair loss of the weighted sum of ``cfg.loss_type``; its mean is TRL's loss."""
    beta, eps = cfg.beta, cfg.label_smoothing
    chosen, rejected = policy["logps"].chunk(2)
    per_token, shift_mask = policy["per_token_logps"], completion_mask[:, 1:]
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    chosen_s, rejected_s = _scores(cfg, chosen_lr), _scores(cfg, rejected_lr)
    delta = chosen_s - rejected_s
    n_chosen, n_rejected = completion_mask.sum(1).clamp(min=1.0).chunk(2)
    total = torch.zeros_like(chosen)
    for loss_type, weight in zip(cfg.loss_type, cfg.loss_weights or [1.0] * len(cfg.loss_type)):
        if loss_type == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":  # length-normalised, as TRL (confirmed with the IPO authors)
            loss = (chosen_s / n_chosen - rejected_s / n_rejected - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            eps_t = torch.tensor(eps, device=delta.device)
            loss = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-eps_t))
                    + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps_t)))
        elif loss_type == "nca_pair":
            loss = (-F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr)
                    - 0.5 * F.logsigmoid(-beta * rejected_lr))
        elif loss_type == "robust":
            loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif loss_type == "sppo_hard":
            loss = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                d = (torch.sort(chosen - rejected, dim=0)[0]
                     - torch.sort(ref_chosen - ref_rejected, dim=0)[0])
            else:
                d = torch.sort(chosen_lr, dim=0)[0] - torch.sort(rejected_lr, dim=0)[0]
            loss = -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
        elif loss_type == "apo_zero":
            loss = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif loss_type == "apo_down":
            loss = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif loss_type == "discopop":
            logits = beta * delta
            mix = torch.sigmoid(logits / cfg.discopop_tau)
            loss = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
        elif loss_type == "sft":  # the chosen tokens' NLL over the batch, one value for every pair
            chosen_mask = shift_mask.chunk(2)[0].bool()
            loss = (-per_token.chunk(2)[0][chosen_mask].mean()).expand(chosen.shape[0])
        elif loss_type == "sigmoid_norm":
            loss = -F.logsigmoid(beta * (chosen_s / n_chosen - rejected_s / n_rejected))
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}")
        if cfg.use_weighting:  # WPO: weight by the pair's length-normalised sequence probabilities
            with torch.no_grad():
                aligned = (per_token - policy["log_sum_sq_probs"]) * shift_mask
            w = torch.exp(aligned.sum(1) / shift_mask.sum(1).clamp_min(1))
            w_chosen, w_rejected = w.chunk(2)
            loss = loss * w_chosen * w_rejected
        total = total + weight * loss
    return total


def pair_metrics(cfg: DPOConfig, policy: dict, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                 completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair values behind TRL's metrics (``rewards/*``, ``logps/*``), detached."""
    chosen, rejected = policy["logps"].detach().chunk(2)
    rc, rr = cfg.beta * (chosen - ref_chosen), cfg.beta * (rejected - ref_rejected)
    return {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/accuracies": (rc > rr).float(),
            "rewards/margins": rc - rr, "logps/chosen": chosen, "logps/rejected": rejected}


def token_metrics(policy: dict, completion_mask: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(sum, count) over completion tokens for TRL's token-level metrics."""
    mask = completion_mask[:, 1:].bool()
    chosen_mask, rejected_mask = mask.chunk(2)
    mean_chosen, mean_rejected = policy["mean_logits"].chunk(2)
    top1 = policy["is_top1"].chunk(2)[0]
    return {"entropy": (policy["entropy"][mask].sum().item(), mask.sum().item()),
            "logits/chosen": (mean_chosen[chosen_mask].sum().item(), chosen_mask.sum().item()),
            "logits/rejected": (mean_rejected[rejected_mask].sum().item(), rejected_mask.sum().item()),
            "mean_token_accuracy": ((top1 & chosen_mask).sum().item(), chosen_mask.sum().item())}


class DPOTrainer(ReferenceRole, Trainer):
    """DPO; the reference is a frozen ``reference`` role (``ref_model=``, else the policy's weights; freed
    after one pass with ``precompute_ref_log_probs``), or with ``peft_config`` and no ``ref_model`` the
    policy's base with adapters disabled."""

    name = "dpo"
    shown = ("loss", "rewards/accuracies", "rewards/margins", "eval/loss", "eval/rewards/accuracies")
    roles = TRAINER_ROLES["dpo"]  # with peft_config and no ref_model, no reference role
    evaluates = True

    def __init__(self, model: Any, ref_model: Any = None, args: DPOConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 quantization_config: Any = None, peft_config: Any = None) -> None:
        refuse_arguments("DPOTrainer", data_collator=data_collator, compute_metrics=compute_metrics,
                         optimizers=optimizers, quantization_config=quantization_config)
        self.cfg = cfg = args if args is not None else default_args(DPOConfig, model, "DPO")
        check_eval_data(cfg, eval_dataset)
        if train_dataset is None:
            raise ConfigError("DPOTrainer needs train_dataset= (a datasets.Dataset or a list of rows)")
        validate(cfg)
        if cfg.sync_ref_model and peft_config is not None:  # TRL's rule
            raise ConfigError("sync_ref_model needs a reference model of its own to update, and with peft_config the "
                              "reference is the policy's base (adapters disabled): drop sync_ref_model or peft_config")
        distinct_objects(model=model, ref_model=ref_model)
        seed_everything(cfg.seed)
        policy, self.tokenizer, _ = model_and_tokenizer(cfg, model, processing_class, what="policy")
        pad = cfg.pad_token or self.tokenizer.pad_token or self.tokenizer.eos_token  # TRL's pad token
        if pad not in self.tokenizer.get_vocab():
            raise ConfigError(f"pad_token {pad!r} is not in the tokenizer's vocabulary: give one of its tokens")
        self.tokenizer.pad_token = pad
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        self.collate = DataCollatorForPreference(pad_token_id=self.tokenizer.pad_token_id, max_length=cfg.max_length,
                                                 truncation_mode=cfg.truncation_mode,
                                                 pad_to_multiple_of=cfg.pad_to_multiple_of)
        self.peft_config = peft_config
        # TRL's rule: with adapters and no ref_model, the reference is the base model (adapters disabled).
        frozen = [] if peft_config is not None and ref_model is None else list(self.roles["frozen"])

        prep = dict(tokenizer=self.tokenizer, max_length=cfg.max_length, truncation_mode=cfg.truncation_mode,
                    num_proc=cfg.dataset_num_proc)
        self.train_rows = preference.prepare_preference_dataset(train_dataset, name="train_dataset", **prep)
        self.eval_rows = (preference.prepare_preference_dataset(eval_dataset, name="eval_dataset", **prep)
                          if eval_dataset is not None else None)

        self.loader, self.schedule = row_schedule(cfg, len(self.train_rows))  # TRL's Trainer order and steps
        self.total_steps = self.schedule.max_steps
        self.session = make_session(cfg, self.roles["trained"], frozen, total_steps=self.total_steps)
        self.phases = Phases()
        # TRL loads models in float32 unless told otherwise; mixed precision then casts inside DeepSpeed.
        kwargs = init_kwargs(cfg, dtype="float32")
        varlen_attention.choose_for(self.session, kwargs, policy, cfg.padding_free)

        self.reference = None
        if frozen:
            self._load_reference(ref_model, policy, kwargs)

        model = self.session.load("policy", policy, **kwargs)
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id  # as TRL: model and tokenizer agree
        self.policy = self.model = prepare_trained(self.session, "policy", model, cfg, self.peft_config,
                                                   total_steps=self.total_steps)
        if not frozen and cfg.precompute_ref_log_probs:
            self._precompute_all()  # the base model, adapters disabled: saves a forward per step
        self.setup_times = self.phases.pop()  # kept apart so every logged row has the same keys
        self._steps = None
        self._finish_init(callbacks)

    def _shard(self, n: int, batch_size: int) -> list[tuple[list[int], int]]:
        """This rank's ``range(n)`` as (indices, valid count) batches, equal count per rank, 0-padded."""
        rank, world = self.session.process_index, self.session.num_processes
        mine = list(range(rank, n, world))
        per_rank = math.ceil(n / world)
        out = []
        for start in range(0, per_rank, batch_size):
            idx = mine[start : start + batch_size]
            valid = len(idx)
            out.append((idx + [0] * (min(batch_size, per_rank - start) - valid), valid))
        return out

    @torch.no_grad()
    def _precompute(self, rows: list[dict], bs: int) -> None:
        """Reference log-probs of every pair, stored in the rows (``ref_chosen_logps``/``ref_rejected_logps``)."""
        values = torch.zeros(len(rows), 2, dtype=torch.float64, device=self.session.device)
        for idx, valid in self._shard(len(rows), bs):
            pairs = [{k: rows[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in idx]
            batch = self._to_device(self.collate(pairs))
            chosen, rejected = self._reference_forward(batch)
            values[idx[:valid]] = torch.stack([chosen, rejected], 1)[:valid].double()
        values = sum_over_ranks(self.session, values)  # each row was computed on exactly one rank
        for row, (c, r) in zip(rows, values.tolist()):
            row["ref_chosen_logps"], row["ref_rejected_logps"] = c, r

    def _reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen_logps" in batch:
            dtype = torch.get_default_dtype()
            return batch["ref_chosen_logps"].to(dtype), batch["ref_rejected_logps"].to(dtype)
        return self._reference_forward(batch)

    @torch.no_grad()
    def _reference_forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference is None:  # adapters and no reference model of its own
            with adapters_disabled(self.policy):
                out = sequence_logps(self.policy, batch, self.cfg.ld_alpha, padding_free=self.cfg.padding_free)
        else:
            out = sequence_logps(self.reference, batch, self.cfg.ld_alpha, padding_free=self.cfg.padding_free)
        return out["logps"].chunk(2)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
        """The loss of one [chosen; rejected] batch, its per-pair metrics and (sum, count) token metrics."""
        batch = self._to_device(batch)
        with self.phases("reference"):
            ref_chosen, ref_rejected = self._reference_logps(batch)
        with self.phases("policy_forward"):
            policy = sequence_logps(self.policy, batch, self.cfg.ld_alpha, stats=True,
                                    padding_free=self.cfg.padding_free)
            loss = dpo_losses(self.cfg, policy, ref_chosen, ref_rejected, batch["completion_mask"])
        pairs = pair_metrics(self.cfg, policy, ref_chosen, ref_rejected, batch["completion_mask"])
        pairs["loss"] = loss.detach()
        return loss.mean(), pairs, token_metrics(policy, batch["completion_mask"])

    def training_step(self, step: int) -> dict[str, float]:
        """One optimizer step: mean loss and pair metrics, token metrics over the step's tokens. An epoch's
        last step may have fewer micro-batches than gradient_accumulation_steps: as TRL, it averages those."""
        cfg, s = self.cfg, self.session
        if self._steps is None:
            self._steps = self.loader.steps(self.schedule, s.process_index, start_step=step - 1)
        planned = next(self._steps)
        window = len(planned.batches)
        sums: dict[str, float] = {}
        tokens: dict[str, list[float]] = {}
        for k, micro in enumerate(planned.batches):
            loss, pairs, tok = self.compute_loss(self.collate([self.train_rows[i] for i in micro.rows]))
            with self.phases("backward"):
                # The engine divides by gradient_accumulation_steps; TRL by the step's micro-batches.
                s.backward("policy", loss * (cfg.gradient_accumulation_steps / window), boundary=k == window - 1)
                s.step("policy")
            for key, v in pairs.items():
                sums[key] = sums.get(key, 0.0) + (loss.item() if key == "loss" else v.mean().item()) / window
            for key, (a, b) in tok.items():
                tokens.setdefault(key, [0.0, 0.0])
                tokens[key][0] += a
                tokens[key][1] += b
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
            with self.phases("ref_sync"):
                s.blend("reference", "policy", cfg.ref_model_mixup_alpha)
        return {**sums, **{k: a / max(b, 1) for k, (a, b) in tokens.items()},
                "grad_norm": s.grad_norm("policy") or 0.0, "learning_rate": s.learning_rate("policy"),
                "epoch": planned.epoch, **self.phases.pop()}

    @torch.no_grad()
    def evaluate(self, rows: list[dict] | None = None, prefix: str = "eval") -> dict[str, float]:
        """TRL's metrics as exact means over every eval pair, whatever the world size."""
        rows = rows if rows is not None else self.eval_rows
        if rows is None:
            raise ValueError("no eval_dataset was given")
        self.policy.eval()
        keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
        tok_keys = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")
        sums = torch.zeros(len(keys) + 1 + 2 * len(tok_keys), dtype=torch.float64, device=self.session.device)
        for idx, valid in self._shard(len(rows), self.cfg.per_device_eval_batch_size):
            _, pairs, tok = self.compute_loss(self.collate([rows[i] for i in idx]))
            for j, k in enumerate(keys):
                sums[j] += pairs[k][:valid].double().sum()
            sums[len(keys)] += valid
            if valid == len(idx):  # token metrics from full batches only, so padding repeats don't count
                for j, k in enumerate(tok_keys):
                    sums[len(keys) + 1 + 2 * j] += tok[k][0]
                    sums[len(keys) + 2 + 2 * j] += tok[k][1]
        sums = sum_over_ranks(self.session, sums)
        self.phases.pop()
        self.policy.train()
        out = {f"{prefix}/{k}": (sums[j] / sums[len(keys)]).item() for j, k in enumerate(keys)}
        for j, k in enumerate(tok_keys):
            out[f"{prefix}/{k}"] = (sums[len(keys) + 1 + 2 * j] / sums[len(keys) + 2 + 2 * j].clamp(min=1)).item()
        return out
