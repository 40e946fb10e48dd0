"""GRPO (TRL 1.16's ``GRPOTrainer``) with a trained ``policy``, a frozen ``reference`` (none at ``beta == 0``
or with LoRA) and one frozen role per reward model, each under its own DeepSpeed plugin."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.data.order import epoch_order, mix_seed, seed_everything
from posttrain.data.preference import check_conversation
from posttrain.data.prompts import left_pad, prompt_rows, tokenize_prompt
from posttrain.errors import ConfigError
from posttrain.models import compiled_layers
from posttrain.models.lora import LoraFields, adapters_disabled, check_no_head_adapter, lora_config
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import given_once, model_config, policy_source, reference_source
from posttrain.placement.ranks import gather_ranks, mean_over_ranks, sum_over_ranks, world_size
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rewards.scoring import Rewards
from posttrain.rollout.api import RolloutFields, check_rollout_fields
from posttrain.trainers.config import TrainConfig, make_session
from posttrain.trainers.grpo_loss import (
    LOSS_TYPES,
    average_generation_metrics,
    completion_metrics,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    reduce_loss_stats,
)
from posttrain.trainers.loop import Trainer, window_mean
from posttrain.trainers.online import completion_logps, truncated_rows, write_samples
from posttrain.trainers.run_log import Phases


@dataclass
class GRPOConfig(TrainConfig, LoraFields, RolloutFields):
    """GRPO settings; names and defaults follow TRL 1.16's ``GRPOConfig`` where the concept is the same."""

    model_name_or_path: str | None = None  # hub name or local path (or the trainer's model=)
    ref_model_name_or_path: str | None = None  # default: the policy's; only with beta > 0
    # TRL's reward names (accuracy_reward, ...), "module.function", or a reward model's path; one is required.
    reward_funcs: list[str] | None = None
    reward_model_name_or_path: str | None = None  # TRL's scripts' flag: a reward model put before reward_funcs
    reward_weights: list[float] | None = None
    multi_objective_aggregation: str = "sum_then_normalize"  # | "normalize_then_sum"
    max_prompt_length: int | None = 512  # prompts are truncated from the left
    chat_template_kwargs: dict | None = None
    learning_rate: float = 1e-6
    disable_dropout: bool = False
    gradient_checkpointing: bool = True  # TRL's GRPO/RLOO default
    compile_layers: bool | None = None  # compile the policy's decoder layers (None: where it applies)
    # Generation
    num_generations: int = 8
    max_completion_length: int = 512
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # The objective
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    delta: float | None = None
    epsilon_high: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"  # | "sequence" (GSPO)
    scale_rewards: str = "group"  # | "batch" | "none"
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    use_bias_correction_kl: bool = True
    # TR-DPO's reference sync (TRL's names and defaults)
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    log_completions: bool = False  # write samples.jsonl every logging step
    num_completions_to_print: int | None = 4
    reference_model: str = field(default="", init=False)  # what the KL is measured against (not a flag)

    _loss_types = LOSS_TYPES
    _algorithm = "GRPO"
    _evaluates = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rollout_fields(self)
        world = world_size()
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        checks = [
            (self.loss_type in self._loss_types,
             f"loss_type must be one of {', '.join(self._loss_types)}; got {self.loss_type!r}"),
            (self.importance_sampling_level in ("token", "sequence"),
             f"importance_sampling_level must be 'token' or 'sequence'; got {self.importance_sampling_level!r}"),
            (self.scale_rewards in ("group", "batch", "none"),
             f"scale_rewards must be 'group', 'batch' or 'none'; got {self.scale_rewards!r}"),
            (self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
             "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum'"),
            (self.compile_layers in (None, True, False),
             f"compile_layers must be true, false or null (on a GPU where it applies); got {self.compile_layers!r}"),
            (self.num_generations >= 2,
             f"{self._algorithm} needs num_generations >= 2 to compare completions of one prompt; got "
             f"{self.num_generations}"),
            (self.max_completion_length >= 1,
             f"max_completion_length must be >= 1 (new tokens per completion); got {self.max_completion_length}"),
            (self.max_prompt_length is None or self.max_prompt_length >= 1,
             f"max_prompt_length must be >= 1, or null for no truncation; got {self.max_prompt_length}"),
            (self.beta >= 0.0, f"beta (the KL coefficient) must be >= 0; got {self.beta}"),
            (self.temperature > 0.0,
             f"temperature must be > 0 (sampling; the loss divides logits by it); got {self.temperature}"),
            (self.ref_model_name_or_path is None or self.beta != 0.0,
             f"ref_model_name_or_path is set but beta is 0, which uses no reference model: set beta > 0 to use "
             f"{self.ref_model_name_or_path}, or drop ref_model_name_or_path"),
            (0.0 < self.top_entropy_quantile <= 1.0, "top_entropy_quantile must be in (0, 1]"),
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (not self.sync_ref_model or self.beta != 0.0,
             "sync_ref_model needs a reference model, and beta: 0 loads none: set beta > 0 or drop sync_ref_model"),
            (not self.sync_ref_model or (self.ref_model_sync_steps >= 1 and 0.0 < self.ref_model_mixup_alpha <= 1.0),
             "sync_ref_model needs ref_model_sync_steps >= 1 and 0 < ref_model_mixup_alpha <= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        check_reference(self, adapters=self.use_peft)
        # TRL's batch arithmetic: a generation batch is steps_per_generation micro-batches per process.
        per_step = self.per_device_train_batch_size * world
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            if self.generation_batch_size != per_step * self.steps_per_generation:
                raise ConfigError("set generation_batch_size or steps_per_generation, not both (they disagree: "
                                  f"{self.generation_batch_size} != {per_step} x {self.steps_per_generation})")
        elif self.generation_batch_size is None:
            self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size % per_step:
            raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                              f"per_device_train_batch_size x processes ({per_step})")
        else:
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.generation_batch_size % self.num_generations:
            raise ConfigError(f"the generation batch ({self.generation_batch_size} completions = "
                              f"per_device_train_batch_size x processes x steps_per_generation) must be a multiple of "
                              f"num_generations ({self.num_generations}): every prompt's group has to be complete")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon


def check_reference(cfg: GRPOConfig, adapters: bool) -> None:
    """Refuse a reference of its own under LoRA (TRL's rule); record ``cfg.reference_model``."""
    if adapters and cfg.ref_model_name_or_path:
        raise ConfigError("use_peft takes the reference from the policy's base model (adapters disabled), so "
                          "ref_model_name_or_path is not used: drop ref_model_name_or_path, or train without --use_peft")
    if adapters and "reference" in cfg.role_configs:
        raise ConfigError("use_peft has no reference role (the reference is the policy's base with adapters disabled), "
                          "so role_configs' 'reference' entry places nothing: drop it from role_configs")
    if adapters and cfg.sync_ref_model:
        raise ConfigError("sync_ref_model needs a reference model of its own, and use_peft has none (the reference "
                          "is the base with adapters disabled): drop sync_ref_model, or train without --use_peft")
    cfg.reference_model = ("none (beta 0)" if cfg.beta == 0.0 else
                           "the policy's base model with its LoRA adapters disabled" if adapters else
                           cfg.ref_model_name_or_path or "the policy's initial weights")


class GRPOTrainer(Trainer):
    """GRPO with per-role placement; ``train()`` returns the logged rows under TRL's metric names."""

    name = "grpo"
    shown = ("reward", "kl", "loss")
    roles = TRAINER_ROLES["grpo"]
    peft_config: Any = None  # LoRA's settings (peft), None for full fine-tuning

    @property
    def separate_reference(self) -> bool:
        """A reference role of its own: beta > 0 without LoRA."""
        return self.cfg.beta != 0.0 and self.peft_config is None

    def __init__(self, cfg: GRPOConfig, reward_funcs: list | None = None, train_rows: list[dict] | None = None,
                 peft_config: Any = None, *, model: Any = None, processing_class: Any = None,
                 train_dataset: Any = None, reward_processing_classes: Any = None) -> None:
        from posttrain.rollout import Rollout, SamplingParams

        self.cfg = cfg
        self.peft_config = peft_config if peft_config is not None else lora_config(cfg)
        if peft_config is not None:
            check_reference(cfg, adapters=True)
        if self.peft_config is not None:
            check_no_head_adapter(self.peft_config)
        seed_everything(cfg.seed)
        policy_given, self.tokenizer, policy_path = policy_source(cfg, model, processing_class)
        tok = self.tokenizer
        if tok.pad_token_id is None:
            raise ConfigError(f"{policy_path}: the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = "
                              "tokenizer.eos_token) and save it with the model")
        self.eos_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []

        self.rewards = self._rewards(reward_funcs, reward_processing_classes)

        given_once(train_rows, train_dataset, "prompt dataset", "train_rows", "train_dataset=")
        self.rows = train_rows if train_rows is not None else prompt_rows(train_dataset, cfg._algorithm)
        check_conversation(self.rows, ("prompt",), tok, "train_rows" if train_rows is not None else "train_dataset")
        self.rewards.check_columns(self.rows)
        self.prompt_ids = [tokenize_prompt(r["prompt"], tok, cfg) for r in self.rows]
        max_prompt_len = max(len(p) for p in self.prompt_ids)

        world = world_size()
        self.local_gen_size = cfg.per_device_train_batch_size * cfg.steps_per_generation
        self.prompts_per_generation = cfg.generation_batch_size // cfg.num_generations
        if self.prompts_per_generation > len(self.rows):
            raise ConfigError(f"a generation batch needs {self.prompts_per_generation} prompts and the dataset has "
                              f"{len(self.rows)}: lower per_device_train_batch_size or steps_per_generation")
        self.micro_per_generation = cfg.steps_per_generation * cfg.num_iterations
        self.micro_batches_per_epoch = micro_batches_per_epoch(len(self.rows), cfg)  # the logged epoch's unit
        if cfg.max_steps > 0:
            self.total_steps = cfg.max_steps
        else:  # TRL's epoch: every prompt num_generations times, each generation batch num_iterations times
            completions = cfg.num_train_epochs * len(self.rows) * cfg.num_generations * cfg.num_iterations
            self.total_steps = max(1, math.ceil(completions / (cfg.per_device_train_batch_size * world
                                                               * cfg.gradient_accumulation_steps)))
        if cfg.save_steps and (cfg.save_steps * cfg.gradient_accumulation_steps) % self.micro_per_generation:
            raise ConfigError(
                f"save_steps ({cfg.save_steps}) must end on a generation boundary: a generation batch lasts "
                f"{self.micro_per_generation} micro-batches (steps_per_generation x num_iterations) and a step "
                f"{cfg.gradient_accumulation_steps}; pick save_steps so that save_steps x gradient_accumulation_steps "
                f"is a multiple of {self.micro_per_generation}")

        self.rewards.plan(model_config(policy_given), tok)
        frozen = (["reference"] if self.separate_reference else []) + self.rewards.roles
        self.session = s = make_session(cfg, self.roles["trained"], frozen, total_steps=self.total_steps,
                                        decoded=self.roles["decoded"])
        self.compiled_layers = 0  # how many of the policy's layers train compiled (a metric)
        self._compile = compiled_layers.wanted(cfg.compile_layers, s, "policy", self.peft_config is not None,
                                               cfg.generation_backend)
        if self.separate_reference:  # taken before the policy trains or takes adapters
            reference = reference_source(cfg.ref_model_name_or_path, policy_given)
        torch.manual_seed(cfg.seed)
        policy = s.load("policy", policy_given)
        policy.generation_config.pad_token_id = tok.pad_token_id
        # Seeded adapters: every placement starts from the same ones.
        prepare_trained(s, "policy", policy, cfg, self.peft_config, total_steps=self.total_steps,
                        adapter_seed=mix_seed(cfg.seed, "adapters"), before_optimizer=self._prepare_base)
        if self.separate_reference:
            s.prepare("reference", s.load("reference", reference))
        self.rewards.load(s)

        self.sampling = SamplingParams(max_new_tokens=cfg.max_completion_length, pad_token_id=tok.pad_token_id,
                                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                       stop_token_ids=self.eos_ids)
        self.rollout = Rollout.from_config(cfg, s, "policy", self.sampling, max_batch=self.local_gen_size,
                                          max_prompt_len=max_prompt_len)
        self.phases = Phases()
        self._buffer: list[dict[str, torch.Tensor]] = []  # the generation batch's micro-batches
        self.num_tokens = 0.0
        self.history: list[dict] = []
        # TRL hands reward functions the trainer's state.
        from transformers import TrainerState

        self.trainer_state = TrainerState(max_steps=self.total_steps, num_train_epochs=cfg.num_train_epochs,
                                          logging_steps=cfg.logging_steps, save_steps=cfg.save_steps or 0,
                                          train_batch_size=cfg.per_device_train_batch_size)
        self.trainer_state.is_world_process_zero = s.is_main_process

    def _rewards(self, reward_funcs: list | None, processing_classes: Any) -> Rewards:
        """The rewards in TRL's order (code's, the reward model flag, the config's), all checked."""
        cfg = self.cfg
        given = list(reward_funcs or [])
        if processing_classes is not None and not isinstance(processing_classes, list):
            processing_classes = [processing_classes]
        if processing_classes is not None and len(processing_classes) != len(given):
            raise ConfigError(f"reward_processing_classes has {len(processing_classes)} entries for {len(given)} "
                              "reward_funcs: give one per entry (None for a function)")
        specs = ([cfg.reward_model_name_or_path] if cfg.reward_model_name_or_path else []) + list(cfg.reward_funcs or [])
        if not given and not specs:
            raise ConfigError(f"{cfg._algorithm} needs a reward: set reward_funcs (one of TRL's reward names, "
                              "\"module.function\", or a reward model's path) or pass reward_funcs=")
        tokenizers = list(processing_classes or [None] * len(given)) + [None] * len(specs)
        return Rewards(given + specs, cfg.reward_weights, tokenizers=tokenizers,
                       batch_size=cfg.per_device_train_batch_size, chat_template_kwargs=cfg.chat_template_kwargs)

    def _prepare_base(self, base: torch.nn.Module) -> None:
        """After adapters/checkpointing: TRL's fused LM head and compiled decoder layers where it applies."""
        from trl.trainer.utils import add_fused_lm_head

        cfg = self.cfg
        if self.peft_config is not None:
            check_no_head_adapter(base)
        add_fused_lm_head(base, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
        if self._compile:
            self.compiled_layers = compiled_layers.compile_layers(base, required=cfg.compile_layers is True)

    def _generation_rows(self, cycle: int) -> list[int]:
        """This process's rows of generation batch ``cycle``: prompts, each ``num_generations`` times."""
        cfg, s = self.cfg, self.session
        per_epoch = max(1, len(self.rows) // self.prompts_per_generation)
        epoch, k = divmod(cycle, per_epoch)
        order = epoch_order(len(self.rows), cfg.seed, epoch)
        prompts = order[k * self.prompts_per_generation : (k + 1) * self.prompts_per_generation]
        expanded = [i for i in prompts for _ in range(cfg.num_generations)]
        return expanded[s.process_index * self.local_gen_size : (s.process_index + 1) * self.local_gen_size]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather_ranks(self.session, t)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(self.session, t)

    def needs_old_logps(self) -> bool:
        """Whether a generation batch outlives one optimizer step (TRL's rule for keeping old log-probs)."""
        cfg = self.cfg
        return cfg.gradient_accumulation_steps % (cfg.steps_per_generation * cfg.num_iterations) != 0

    @torch.no_grad()
    def generate_and_score(self, cycle: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Sample and score generation batch ``cycle``; returns its shuffled micro-batches and metrics."""
        cfg, s, tok = self.cfg, self.session, self.tokenizer
        dev = s.device
        idx = self._generation_rows(cycle)
        prompt_ids, prompt_mask = left_pad([self.prompt_ids[i] for i in idx], tok.pad_token_id, dev)
        with self.phases("generate"):
            out = self.rollout.generate(prompt_ids, prompt_mask)
        completion_ids, completion_mask = out.completion_ids.to(dev), out.completion_mask.to(dev).long()
        lengths = completion_mask.sum(1)
        truncated = truncated_rows(completion_ids, completion_mask, self.eos_ids + [tok.pad_token_id])
        # What was generated, up to and with EOS: what rewards read, even where the loss masks it out (TRL).
        generated = [c[m.bool()].tolist() for c, m in zip(completion_ids, completion_mask)]
        if cfg.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
        n = completion_ids.shape[1]
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": completion_mask}
        bs = cfg.per_device_train_batch_size
        with self.phases("policy_forward"):
            old = None
            if self.needs_old_logps():
                with compiled_layers.no_eager_fallback(bool(self.compiled_layers)):
                    old, _ = completion_logps(s.engines["policy"], input_ids, attention_mask, n, cfg.temperature,
                                              batch_size=bs, fused=True)
        with self.phases("score"):
            ref = None
            if self.separate_reference:
                with s.activate("reference"):
                    ref, _ = completion_logps(s.engines["reference"], input_ids, attention_mask, n,
                                              cfg.temperature, batch_size=bs)
            elif cfg.beta != 0.0:  # LoRA: the base model is the reference (TRL's use_adapter(model, None))
                with adapters_disabled(s.engines["policy"]):
                    ref, _ = completion_logps(s.engines["policy"], input_ids, attention_mask, n, cfg.temperature,
                                              batch_size=bs, fused=True)
            rows = [self.rows[i] for i in idx]
            prompts = [r["prompt"] for r in rows]
            texts = tok.batch_decode(generated, skip_special_tokens=True)
            self.trainer_state.global_step = self.step
            self.trainer_state.epoch = cycle * self.prompts_per_generation / len(self.rows)
            self.trainer_state.num_input_tokens_seen = int(self.num_tokens)
            per_func = self.rewards.score(prompts, texts, generated, rows=rows, trainer_state=self.trainer_state)
        all_per_func = self._gather(per_func)
        self.rewards.warn(all_per_func)
        adv = self.advantages(all_per_func, old, ref, completion_mask)
        local = slice(s.process_index * len(idx), (s.process_index + 1) * len(idx))
        batch["advantages"] = adv["advantages"][local]
        batch["num_items_in_batch"] = self._sum(completion_mask.sum().float())
        if old is not None:
            batch["old_per_token_logps"] = old
        if ref is not None:
            batch["ref_per_token_logps"] = ref

        metrics = self.generation_metrics(all_per_func, adv, prompt_mask, lengths, truncated)
        metrics.update(adv.get("metrics", {}))
        metrics.update(self.rewards.logged_metrics())
        self.samples = (prompts, texts, self.rewards.total(per_func), self.rewards.extra_columns())
        # TRL shuffles the generation batch, then splits it into steps_per_generation micro-batches.
        g = torch.Generator().manual_seed(mix_seed(cfg.seed, "shuffle", cycle, s.process_index))
        perm = torch.randperm(len(idx), generator=g).to(dev)
        sels = [perm[j * bs : (j + 1) * bs] for j in range(cfg.steps_per_generation)]
        return [{k: (v[sel] if v.dim() and v.shape[0] == len(idx) else v) for k, v in batch.items()}
                for sel in sels], metrics

    def advantages(self, rewards_per_func: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                   completion_mask: torch.Tensor) -> dict[str, Any]:
        cfg = self.cfg
        return group_advantages(rewards_per_func, self.rewards.weights.to(rewards_per_func.device),
                                cfg.num_generations, cfg.scale_rewards, cfg.multi_objective_aggregation)

    def generation_metrics(self, all_per_func: torch.Tensor, adv: dict[str, Any], prompt_mask: torch.Tensor,
                           lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
        """TRL's per-generation metrics, over every process's completions."""
        m = self.rewards.metrics(all_per_func)
        m["frac_reward_zero_std"] = adv["is_std_zero"].float().mean().item()
        all_lengths = self._gather(lengths).float()
        self.num_tokens += self._sum(prompt_mask.sum().float()).item() + all_lengths.sum().item()
        m["num_tokens"] = self.num_tokens
        return {**m, **completion_metrics(all_lengths, self._gather(truncated))}

    def policy_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's per-token log-probs and entropies of the batch's completions (with grad)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with compiled_layers.no_eager_fallback(bool(self.compiled_layers)):
            return completion_logps(self.session.engines["policy"], input_ids, attention_mask,
                                    batch["completion_mask"].shape[1], self.cfg.temperature, compute_entropy=True,
                                    fused=True)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg, s = self.cfg, self.session
        mask = batch["completion_mask"]
        logps, entropies = self.policy_logps(batch)
        entropy_mask = None
        if cfg.top_entropy_quantile < 1.0:
            local = entropies.detach()[mask.bool()].float()
            pool = local
            if s.num_processes > 1:  # the quantile over every process's tokens, as TRL takes it
                padded = s.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
                pool = s.accelerator.gather(padded)
                pool = pool[pool != -1e9]
            entropy_mask = high_entropy_mask(entropies.detach(), mask, 1 - cfg.top_entropy_quantile, pool)
        loss, stats = grpo_loss(cfg, logps, batch.get("old_per_token_logps"), batch.get("ref_per_token_logps"),
                                batch["advantages"], mask, entropy_mask, batch["num_items_in_batch"],
                                s.num_processes)
        stats["means"]["entropy"] = ((entropies.detach() * mask).sum(), mask.sum().float())
        return loss, stats

    def backward_scale(self) -> float:
        """TRL's GRPO loss is already divided for accumulation, as the engine also does: undo one."""
        return float(self.cfg.gradient_accumulation_steps)

    def training_step(self, step: int) -> dict[str, Any]:
        """One optimizer step, sampling a new generation batch when the current one is used up."""
        cfg, s = self.cfg, self.session
        ga = cfg.gradient_accumulation_steps
        tick = time.perf_counter()
        loss_sum, stats, generations = 0.0, [], []
        for k in range(ga):
            micro = (step - 1) * ga + k
            if micro % self.micro_per_generation == 0 or not self._buffer:
                self._buffer, metrics = self.generate_and_score(micro // self.micro_per_generation)
                generations.append(metrics)
            batch = self._buffer[micro % cfg.steps_per_generation]
            with self.phases("train"):
                loss, st = self.compute_loss(batch)
                s.backward("policy", loss * self.backward_scale())
                s.step("policy")
            loss_sum += loss.item() * self.backward_scale() / ga
            stats.append(st)
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
            with self.phases("ref_sync"):
                s.blend("reference", "policy", cfg.ref_model_mixup_alpha)
        return {"loss": loss_sum, "stats": stats, "generations": generations,
                "grad_norm": s.grad_norm("policy") or 0.0, "learning_rate": s.learning_rate("policy"),
                "epoch": step * ga / self.micro_batches_per_epoch,
                "times": {**self.phases.pop(), "time/step": time.perf_counter() - tick}}

    def log_row(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """A window's row as TRL logs it: generation metrics, micro-batch loss stats, mean step loss."""
        row = reduce_loss_stats([st for r in rows for st in r["stats"]], self._sum, self._gather)
        row["loss"] = mean_over_ranks(self.session, {"loss": sum(r["loss"] for r in rows) / len(rows)})["loss"]
        row.update(average_generation_metrics([g for r in rows for g in r["generations"]]))
        row.update({k: rows[-1][k] for k in ("grad_norm", "learning_rate", "epoch")})
        row.update(window_mean([r["times"] for r in rows]))
        row.update(self.rollout.metrics())
        row["train/compiled_layers"] = float(self.compiled_layers)
        return row

    def on_log(self, step: int) -> None:
        if self.cfg.log_completions:
            self._log_samples()

    def checkpoint_models(self) -> dict[str, Any]:
        return {"policy": self.tokenizer, **({"reference": None} if self.cfg.sync_ref_model else {})}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.num_tokens = float(state.get("num_tokens", 0.0))
        if self.cfg.sync_ref_model:
            self.session.load_weights("reference", checkpoint / "reference")

    def can_checkpoint(self, step: int) -> bool:
        # A checkpoint holds no generation batch, so it is taken only where one ends.
        return (step * self.cfg.gradient_accumulation_steps) % self.micro_per_generation == 0

    def _log_samples(self) -> None:
        prompts, texts, scores, extra = self.samples
        k = self.cfg.num_completions_to_print or len(texts)
        rows = [{"step": self.step, "prompt": p if isinstance(p, str) else p[-1]["content"], "completion": c,
                 "reward": round(float(r), 4)} for p, c, r in zip(prompts[:k], texts[:k], scores[:k].tolist())]
        for column, values in extra.items():  # columns reward functions added with log_extra
            for row, v in zip(rows, values):
                row[column] = v
        write_samples(self.session, self.cfg.output_dir, rows)


def micro_batches_per_epoch(num_prompts: int, cfg: GRPOConfig) -> int:
    """TRL's epoch in micro-batches (its dataloader's length), the unit of the logged ``epoch``."""
    prompts_per_generation = cfg.generation_batch_size // cfg.num_generations
    return (num_prompts // prompts_per_generation) * cfg.steps_per_generation * cfg.num_iterations
