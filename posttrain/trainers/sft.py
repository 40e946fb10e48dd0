"""Supervised fine-tuning with the ``policy`` role under its own plugin, as ``trl.SFTTrainer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import trl

from posttrain.data import sft as sft_data
from posttrain.data.order import seed_everything
from posttrain.errors import ConfigError
from posttrain.models import varlen_attention
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import init_kwargs, model_and_tokenizer
from posttrain.models.tokenizer import check_tokenizer_fields, set_tokens
from posttrain.placement.ranks import sum_over_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.trainers.config import TrainConfig, check_eval_data, make_session, row_schedule
from posttrain.trainers.loop import RowsTrainer, default_args, eval_shards, refuse_arguments
from posttrain.trainers.run_log import Phases

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
LOSS_TYPES = ("nll", "dft")
# Collated keys that are model inputs (padding-free adds the varlen kernels' boundaries).
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
               "max_length_k", "seq_idx")


@dataclass
class SFTConfig(TrainConfig, trl.SFTConfig):
    """``trl.SFTConfig`` (its fields, names and defaults) plus posttrain's placement fields."""

    _algorithm = "SFT"
    _trl_works = ("model_init_kwargs", "trust_remote_code", "chat_template_path", "dataset_text_field",
                  "dataset_num_proc", "eos_token", "pad_token", "max_length", "truncation_mode", "shuffle_dataset",
                  "packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "eval_packing",
                  "completion_only_loss", "assistant_only_loss", "loss_type", "neftune_noise_alpha")

    def __post_init__(self) -> None:
        super().__post_init__()
        validate(self)


def validate(cfg: SFTConfig) -> None:
    """TRL's checks on the SFT settings, before any model loads."""
    if cfg.packing_strategy not in PACKING_STRATEGIES:
        raise ConfigError(f"unknown packing_strategy {cfg.packing_strategy!r}: choose from {', '.join(PACKING_STRATEGIES)}")
    if cfg.loss_type not in LOSS_TYPES:
        raise ConfigError(f"unknown loss_type {cfg.loss_type!r}: choose from {', '.join(LOSS_TYPES)}")
    if cfg.truncation_mode not in sft_data.TRUNCATION_MODES:
        raise ConfigError(f"truncation_mode must be one of {', '.join(sft_data.TRUNCATION_MODES)}, "
                          f"got {cfg.truncation_mode!r}")
    if cfg.packing and cfg.max_length is None:
        raise ConfigError("packing needs max_length (the packed row length): set --max_length")
    if cfg.padding_free and not cfg.packing and cfg.max_length is not None and cfg.truncation_mode != "none":
        # TRL's rule: padding-free rows are concatenated, so max_length would bound nothing.
        raise ConfigError("padding_free without packing does not enforce max_length: add --packing true, set "
                          "--max_length none, or set --truncation_mode none (rows longer than max_length refused)")
    if cfg.neftune_noise_alpha is not None and not cfg.neftune_noise_alpha > 0:
        raise ConfigError(f"neftune_noise_alpha must be > 0 (NEFTune's noise scale; unset for none), got "
                          f"{cfg.neftune_noise_alpha}")
    check_tokenizer_fields(cfg)


def model_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in _MODEL_KEYS if k in batch}


# The per-token fields TRL's SFTTrainer asks of its fused head (is_top1 feeds mean_token_accuracy).
FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")


def add_fused_head(model: Any) -> Any:
    """Give ``model`` TRL's fused LM head in place, as TRL's SFTTrainer does before PEFT; returns it."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=FUSED_OUTPUTS)
    return model


def token_terms(model: Any, batch: dict, loss_type: str = "nll") -> dict[str, torch.Tensor]:
    """Summed token loss (with grad), trained-token count, summed entropy, top-1 hits, via the fused head."""
    out = model(**model_inputs(batch), labels=batch["labels"], fused_lm_head=True)
    mask = out.label_mask
    per_token = -out.log_probs  # zero where the label is -100
    if loss_type == "dft":  # DFT (arXiv 2508.05629): each token weighted by its probability
        per_token = per_token * out.log_probs.exp().detach()
    return {"loss_sum": per_token.sum(), "tokens": mask.sum(), "entropy_sum": out.entropy.detach().sum(),
            "correct": out.is_top1.sum()}


def input_tokens(batch: dict) -> int:
    """Tokens a batch feeds the model, as TRL's ``num_tokens`` counts them."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["position_ids"].size(1))


class SFTTrainer(RowsTrainer):
    """Supervised fine-tuning of ``model`` (a hub name, a local path or a model object), as ``trl.SFTTrainer``."""

    name = "sft"
    shown = ("loss", "mean_token_accuracy", "eval/loss")
    roles = TRAINER_ROLES["sft"]
    evaluates = True

    def __init__(self, model: Any, args: SFTConfig | None = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None, formatting_func: Any = None) -> None:
        refuse_arguments("SFTTrainer", data_collator=data_collator, compute_loss_func=compute_loss_func,
                         compute_metrics=compute_metrics, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config, formatting_func=formatting_func)
        self.cfg = cfg = args if args is not None else default_args(SFTConfig, model, "SFT")
        check_eval_data(cfg, eval_dataset)
        if train_dataset is None:
            raise ConfigError("SFTTrainer needs train_dataset= (a datasets.Dataset or a list of rows)")
        validate(cfg)
        seed_everything(cfg.seed)
        source, self.tokenizer, _ = model_and_tokenizer(cfg, model, processing_class)
        set_tokens(self.tokenizer, cfg)
        self.peft_config = peft_config
        self.padding_free = cfg.padding_free or (cfg.packing and cfg.packing_strategy in ("bfd", "bfd_split"))
        self.collate = sft_data.collator(self.tokenizer, self.padding_free, cfg.pad_to_multiple_of)
        chat_template = sft_data.training_chat_template(self.tokenizer) if cfg.assistant_only_loss else None
        prep = dict(tokenizer=self.tokenizer, max_length=cfg.max_length, packing_strategy=cfg.packing_strategy,
                    completion_only_loss=cfg.completion_only_loss, assistant_only_loss=cfg.assistant_only_loss,
                    text_field=cfg.dataset_text_field, truncation_mode=cfg.truncation_mode,
                    chat_template=chat_template, num_proc=cfg.dataset_num_proc)
        self.train_rows = self._prepare(train_dataset, "train_dataset", cfg.packing, prep)
        eval_packing = cfg.packing if cfg.eval_packing is None else cfg.eval_packing
        self.eval_rows = (self._prepare(eval_dataset, "eval_dataset", eval_packing, prep)
                          if eval_dataset is not None else None)

        self.loader, self.schedule = row_schedule(cfg, len(self.train_rows))
        self.total_steps = self.schedule.max_steps
        self.session = make_session(cfg, ["policy"], [], total_steps=self.total_steps)
        self.phases = Phases()
        kwargs = init_kwargs(cfg, dtype="float32")  # TRL loads float32 unless told
        if not isinstance(source, torch.nn.Module):  # an object keeps the attention it was built with
            # Padding-free rows on CUDA: torch's varlen kernel, unless an attention is asked for.
            chosen = varlen_attention.choose(kwargs, source, self.padding_free, self.session.device)
            if chosen and self.session.is_main_process:
                print(chosen, flush=True)
        model = self.session.load("policy", source, **kwargs)  # an object is taken as it is (TRL)
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        if self.tokenizer.eos_token_id is not None and cfg.eos_token is not None:
            model.config.get_text_config().eos_token_id = self.tokenizer.eos_token_id
        add_fused_head(model)  # before the adapters, as TRL
        self.policy = self.model = prepare_trained(self.session, "policy", model, cfg, self.peft_config,
                                                   total_steps=self.total_steps)
        self.setup_times = self.phases.pop()
        self.num_tokens = 0
        self._finish_init(callbacks)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """The loop, with NEFTune's embedding noise while it trains when ``neftune_noise_alpha`` is set:
        transformers' own hook, put on and taken off as its Trainer does (TRL's SFTTrainer inherits it)."""
        alpha = self.cfg.neftune_noise_alpha
        if alpha is None:
            return super().train(resume_from_checkpoint)
        from transformers.integrations.neftune import activate_neftune, deactivate_neftune

        model = self.session.unwrap("policy")
        handle = activate_neftune(model, alpha)
        try:
            return super().train(resume_from_checkpoint)
        finally:
            deactivate_neftune(model, handle)

    def _prepare(self, dataset: Any, name: str, packing: bool, prep: dict) -> list[dict]:
        # TRL shuffles with seed before packing and again after.
        seed = self.cfg.seed if self.cfg.shuffle_dataset else None
        rows = sft_data.prepare_sft_dataset(dataset, packing=packing, name=name, shuffle_seed=seed, **prep)
        if self.cfg.shuffle_dataset:
            rows = rows.shuffle(seed=self.cfg.seed)
        return rows.to_list()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        return sum_over_ranks(self.session, torch.tensor(values, dtype=torch.float64, device=self.session.device)).tolist()

    def optimizer_step(self, micro_batches: list[dict]) -> dict[str, float]:
        """One optimizer step; loss (global token mean), token accuracy, entropy, input tokens so far."""
        s, ga = self.session, self.cfg.gradient_accumulation_steps
        batches = [self._to_device(b) for b in micro_batches]
        window = len(batches)  # ga, or fewer at an epoch's end
        # TRL's num_items_in_batch: the trained tokens of the whole step, all processes.
        local = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        items = max(self._sum_over_ranks([local])[0], 1.0)
        loss_sum, acc, ent, n_input = 0.0, 0.0, 0.0, 0
        for k, batch in enumerate(batches):
            with self.phases("forward"):
                terms = token_terms(self.policy, batch, self.cfg.loss_type)
            # Undo the engine's division by accumulation steps and processes: the gradient is TRL's.
            loss = terms["loss_sum"] * (s.num_processes * ga / items)
            with self.phases("backward"):
                s.backward("policy", loss, boundary=k == window - 1)
                s.step("policy")
            correct, tokens, entropy, lsum = self._sum_over_ranks(
                [terms["correct"].item(), terms["tokens"].item(), terms["entropy_sum"].item(), terms["loss_sum"].item()])
            loss_sum += lsum
            acc += correct / tokens / window if tokens else 0.0
            ent += entropy / tokens / window if tokens else 0.0
            n_input += input_tokens(batch)
        self.num_tokens += int(self._sum_over_ranks([n_input])[0])
        return {"loss": loss_sum / items, "mean_token_accuracy": acc, "entropy": ent,
                "num_tokens": float(self.num_tokens)}

    @torch.no_grad()
    def evaluate(self, rows: list[dict] | None = None, prefix: str = "eval") -> dict[str, float]:
        """Loss, token accuracy and entropy over every eval token, whatever the world size."""
        rows = rows if rows is not None else self.eval_rows
        if rows is None:
            raise ValueError("no eval_dataset was given")
        s, bs = self.session, self.cfg.per_device_eval_batch_size
        self.policy.eval()
        sums = [0.0, 0.0, 0.0, 0.0]
        for idx in eval_shards(s, len(rows), bs):
            weight = 1.0 if idx else 0.0  # a rank out of rows still joins the collective forward
            terms = token_terms(self.policy, self._to_device(self.collate([rows[i] for i in idx or [0]])),
                                self.cfg.loss_type)
            for k, key in enumerate(("loss_sum", "tokens", "correct", "entropy_sum")):
                sums[k] += weight * terms[key].item()
        loss, tokens, correct, entropy = self._sum_over_ranks(sums)
        self.phases.pop()
        self.policy.train()
        tokens = max(tokens, 1.0)
        return {f"{prefix}/loss": loss / tokens, f"{prefix}/mean_token_accuracy": correct / tokens,
                f"{prefix}/entropy": entropy / tokens}
