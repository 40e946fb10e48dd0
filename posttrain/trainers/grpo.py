"""GRPO (TRL 1.16's ``GRPOTrainer``) with a trained ``policy``, a frozen ``reference`` (none at ``beta == 0``
or with LoRA) and one frozen role per reward model, each under its own DeepSpeed plugin."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.data.order import mix_seed, repeat_order, seed_everything
from posttrain.data.preference import check_conversation
from posttrain.data.prompts import check_prompt_rows, left_pad, prompt_rows, tokenize_prompt
from posttrain.errors import ConfigError
from posttrain.models import compiled_layers, varlen_attention
from posttrain.models.lora import adapters_disabled, check_no_head_adapter
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import init_kwargs, model_config, policy_source, reference_source
from posttrain.placement.ranks import gather_ranks, mean_over_ranks, pad_across_ranks, sum_over_ranks
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rewards.scoring import Rewards
from posttrain.trainers import off_policy
from posttrain.trainers import tools as agents
from posttrain.trainers.config import check_eval_data, epoch_steps, make_session, saves
from posttrain.trainers.dynamic_sampling import fill_generation_batch
from posttrain.trainers.entropy_bonus import EntropyBonus
from posttrain.trainers.generation_ranks import GenerationFeed, GenerationRank, SeparateGeneration
from posttrain.trainers.grpo_config import GRPOConfig, check_reference
from posttrain.trainers.grpo_eval import GenerationEval
from posttrain.trainers.grpo_loss import (
    average_generation_metrics,
    completion_metrics,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    reduce_loss_stats,
)
from posttrain.trainers.loop import Trainer, default_args, refuse_arguments, window_mean
from posttrain.trainers.online import completion_logps, config_sampling, truncated_rows, write_samples
from posttrain.trainers.run_log import Phases
from posttrain.trainers.streaming import StreamingGeneration, training_processes


class GRPOTrainer(SeparateGeneration, GenerationEval, Trainer):
    """GRPO with per-role placement and TRL 1.16's constructor; the logged rows (TRL's metric names) are
    ``state.log_history``."""

    name = "grpo"
    shown = ("reward", "kl", "loss")
    roles = TRAINER_ROLES["grpo"]
    evaluates = True
    config_class: type = GRPOConfig
    peft_config: Any = None  # LoRA's settings (peft), None for full fine-tuning
    eval_rows: list[dict] | None = None
    tool_use: Any = None  # trainers/tools.ToolUse with tools= or environment_factory=
    rollout_func: Any = None  # the user's TRL rollout_func
    dynamic_rounds: int = 0  # extra generation batches dynamic sampling drew (they advance the prompt order)
    streaming: StreamingGeneration | None = None  # async_generation (trainers/streaming.py)

    @property
    def separate_reference(self) -> bool:
        """A reference role of its own: beta > 0 without LoRA."""
        return self.cfg.beta != 0.0 and self.peft_config is None

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None) -> None:
        refuse_arguments(type(self).__name__, optimizers=optimizers, quantization_config=quantization_config)
        self._agent_args = (tools, environment_factory, rollout_func)  # trainers/tools.py
        self._build(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                    reward_processing_classes, peft_config)
        self._finish_init(callbacks)

    def _build(self, model: Any, reward_funcs: Any, args: Any, train_dataset: Any, eval_dataset: Any,
               processing_class: Any, reward_processing_classes: Any, peft_config: Any) -> None:
        from posttrain.rollout import Rollout

        algorithm = self.config_class._algorithm
        self.cfg = cfg = args if args is not None else default_args(self.config_class, model, algorithm)
        check_eval_data(cfg, eval_dataset)
        self.peft_config = peft_config
        check_reference(cfg, adapters=peft_config is not None)
        if peft_config is not None:
            check_no_head_adapter(peft_config)
        seed_everything(cfg.seed)
        policy_given, self.tokenizer, policy_path = policy_source(cfg, model, processing_class)
        tok = self.tokenizer
        if tok.pad_token_id is None:  # TRL's default: the EOS token pads
            if tok.eos_token is None:
                raise ConfigError(f"{policy_path}: the tokenizer has neither a pad nor an EOS token; set one "
                                  "(tokenizer.pad_token = ...) and save it with the model")
            tok.pad_token = tok.eos_token

        tools, environment_factory, self.rollout_func = getattr(self, "_agent_args", (None, None, None))
        self.tool_use, reward_funcs = agents.setup(tools, environment_factory, self.rollout_func, reward_funcs, cfg,
                                                   tok, model_config(policy_given).get_text_config().max_position_embeddings)
        self.rewards = self._rewards(reward_funcs, reward_processing_classes)
        if cfg.async_generation and (self.tool_use is not None or self.rollout_func is not None):
            raise ConfigError("async_generation streams single-turn completions: drop tools, environment_factory "
                              "and rollout_func, or set async_generation false")

        self.rows = prompt_rows(train_dataset, cfg._algorithm)
        check_conversation(self.rows, ("prompt",), tok, "train_dataset")
        if self.rollout_func is None:  # a rollout_func's extra fields are reward arguments too (TRL)
            self.rewards.check_columns(self.rows)
        self.prompt_ids = ([tokenize_prompt(r["prompt"], tok, cfg) for r in self.rows] if self.tool_use is None
                           else agents.check_prompts(self.tool_use, self.rows))
        if eval_dataset is not None:
            self.eval_rows = check_prompt_rows(eval_dataset, "eval_dataset", cfg._algorithm)
            check_conversation(self.eval_rows, ("prompt",), tok, "eval_dataset")
            if self.rollout_func is None:
                self.rewards.check_columns(self.eval_rows)
            self.eval_prompt_ids = ([tokenize_prompt(r["prompt"], tok, cfg) for r in self.eval_rows]
                                    if self.tool_use is None else agents.check_prompts(self.tool_use, self.eval_rows))
        max_prompt_len = max(len(p) for p in self.prompt_ids + getattr(self, "eval_prompt_ids", []))

        world = training_processes(cfg)  # generation ranks (generation_processes) take no batch
        self.local_gen_size = cfg.per_device_train_batch_size * cfg.steps_per_generation
        self.prompts_per_generation = cfg.generation_batch_size // cfg.num_generations
        if self.prompts_per_generation > len(self.rows):
            raise ConfigError(f"a generation batch needs {self.prompts_per_generation} prompts and the dataset has "
                              f"{len(self.rows)}: lower per_device_train_batch_size or steps_per_generation")
        self.micro_per_generation = cfg.steps_per_generation * cfg.num_iterations
        self.micro_batches_per_epoch = micro_batches_per_epoch(len(self.rows), cfg)  # the logged epoch's unit
        # TRL's epoch: every prompt num_generations times, each generation batch num_iterations times
        steps_per_epoch = max(1, math.ceil(len(self.rows) * cfg.num_generations * cfg.num_iterations
                                           / (cfg.per_device_train_batch_size * world * cfg.gradient_accumulation_steps)))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs
                                                                                    * steps_per_epoch))
        epoch_steps(cfg, steps_per_epoch)
        # A checkpoint holds no generation batch: refused where one would fall inside (a save_steps past the
        # run's end saves only at the end, where the last generation batch ends unless max_steps cuts it).
        if (saves(cfg) and cfg.save_steps <= self.total_steps
                and (cfg.save_steps * cfg.gradient_accumulation_steps) % self.micro_per_generation):
            what = (f"an epoch's {cfg.save_steps} steps (save_strategy epoch)" if cfg.save_strategy == "epoch"
                    else f"save_steps ({cfg.save_steps})")
            raise ConfigError(
                f"{what} must end on a generation boundary: a generation batch lasts "
                f"{self.micro_per_generation} micro-batches (steps_per_generation x num_iterations) and a step "
                f"{cfg.gradient_accumulation_steps}; pick save_steps so that save_steps x gradient_accumulation_steps "
                f"is a multiple of {self.micro_per_generation}"
                + (", with --save_strategy steps" if cfg.save_strategy == "epoch" else ""))

        self.rewards.plan(model_config(policy_given), tok)
        frozen = (["reference"] if self.separate_reference else []) + self.rewards.roles
        self.session = s = make_session(cfg, self.roles["trained"], frozen, total_steps=self.total_steps,
                                        decoded=self.roles["decoded"])
        self.compiled_layers = 0  # how many of the policy's layers train compiled (a metric)
        self._compile = compiled_layers.wanted(cfg.compile_layers, s, "policy", self.peft_config is not None,
                                               cfg.generation_backend)
        kwargs = init_kwargs(cfg, dtype="float32")  # TRL loads float32 unless told
        varlen_attention.choose_for(s, kwargs, policy_given, cfg.padding_free)
        if self.separate_reference:  # taken before the policy trains or takes adapters
            reference = reference_source(None, policy_given)
        torch.manual_seed(cfg.seed)  # TRL's set_seed(seed) before it loads the policy
        policy = s.load("policy", policy_given, **kwargs)
        policy.config.get_text_config().pad_token_id = tok.pad_token_id
        policy.generation_config.pad_token_id = tok.pad_token_id
        self.sampling = config_sampling(cfg, policy, tok)
        self.eos_ids = self.sampling.stop_token_ids  # what ends a completion also counts it as terminated
        if s.generates:  # this rank only generates (trainers/generation_ranks.py): no engine, its own loop
            self.generation_rank = GenerationRank(self, policy, max_prompt_len)
            self.model, self.rollout = self.generation_rank.copy, self.generation_rank.rollout
            return
        # TRL's adapters start from the state set_seed(seed) left (a causal LM's from_pretrained draws nothing);
        # seeded here so that every placement starts from those same adapters.
        prepare_trained(s, "policy", policy, cfg, self.peft_config, total_steps=self.total_steps,
                        adapter_seed=cfg.seed, before_optimizer=self._prepare_base)
        self.model = s.engines["policy"]
        if self.separate_reference:
            s.prepare("reference", s.load("reference", reference, **kwargs))
        self.rewards.load(s)

        self.rollout = Rollout.from_config(cfg, s, "policy", self.sampling, max_batch=self.local_gen_size,
                                          max_prompt_len=max_prompt_len)
        if cfg.async_generation and s.groups is not None:  # the generation ranks generate (generation_processes)
            self.feed = GenerationFeed(self)
        elif cfg.async_generation:
            self.streaming = StreamingGeneration(self.rollout, cfg, world, self._generation_rows, self.prompt_ids,
                                                 tok.pad_token_id)
        self.phases = Phases()
        self._buffer: list[dict[str, torch.Tensor]] = []  # the generation batch's micro-batches
        self.num_tokens = 0.0
        self.dynamic_rounds = 0  # extra generation batches dynamic sampling drew (they advance the prompt order)
        self.entropy_bonus = EntropyBonus(cfg) if hasattr(cfg, "entropy_coef") else None  # TRL's RLOO has none
        # TRL hands reward functions the trainer's state.
        from transformers import TrainerState

        self.trainer_state = TrainerState(max_steps=self.total_steps, num_train_epochs=cfg.num_train_epochs,
                                          logging_steps=cfg.logging_steps, save_steps=cfg.save_steps or 0,
                                          train_batch_size=cfg.per_device_train_batch_size)
        self.trainer_state.is_world_process_zero = s.is_main_process

    def _rewards(self, reward_funcs: Any, processing_classes: Any) -> Rewards:
        """The rewards in TRL's order, all checked: functions, reward models (paths or objects), TRL's
        built-in names and ``module.function`` names."""
        cfg = self.cfg
        if reward_funcs is None:
            given = []
        elif isinstance(reward_funcs, (list, tuple)):
            given = list(reward_funcs)
        else:  # TRL takes one reward as it is
            given = [reward_funcs]
        if processing_classes is not None and not isinstance(processing_classes, list):
            processing_classes = [processing_classes]
        if processing_classes is not None and len(processing_classes) != len(given):
            raise ConfigError(f"reward_processing_classes has {len(processing_classes)} entries for {len(given)} "
                              "reward_funcs: give one per entry (None for a function)")
        if not given:
            raise ConfigError(f"{cfg._algorithm} needs a reward: pass reward_funcs= (functions, one of TRL's reward "
                              "names, \"module.function\", or a reward model's path or object)")
        return Rewards(given, cfg.reward_weights, tokenizers=processing_classes,
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

    def _generation_rows(self, cycle: int, rank: int | None = None) -> list[int]:
        """This process's (training ``rank``'s) rows of generation batch ``cycle``: prompts, each ``num_generations``
        times."""
        cfg, s = self.cfg, self.session
        rank = s.process_index if rank is None else rank
        per_epoch = max(1, len(self.rows) // self.prompts_per_generation)
        epoch, k = divmod(cycle, per_epoch)
        order = repeat_order(len(self.rows), cfg.seed, epoch, cfg.shuffle_dataset)  # TRL's RepeatSampler
        prompts = order[k * self.prompts_per_generation : (k + 1) * self.prompts_per_generation]
        expanded = [i for i in prompts for _ in range(cfg.num_generations)]
        return expanded[rank * self.local_gen_size : (rank + 1) * self.local_gen_size]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather_ranks(self.session, t)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(self.session, t)

    def needs_old_logps(self) -> bool:
        """Whether a generation batch outlives one optimizer step (TRL's rule for keeping old log-probs)."""
        cfg = self.cfg
        return cfg.gradient_accumulation_steps % (cfg.steps_per_generation * cfg.num_iterations) != 0

    def logps_in_rewards(self) -> bool:
        """Whether the advantages read the policy's and reference's log-probs (RLOO's KL in the reward)."""
        return False

    @torch.no_grad()
    def generate_and_score(self, cycle: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Sample and score generation batch ``cycle``; returns its shuffled micro-batches and metrics."""
        cfg, s = self.cfg, self.session
        idx = self._generation_rows(cycle + self.dynamic_rounds)
        self.trainer_state.global_step = self.step
        self.trainer_state.epoch = cycle * self.prompts_per_generation / len(self.rows)
        self.trainer_state.num_input_tokens_seen = int(self.num_tokens)
        if self.feed is not None:  # the generation ranks' groups of this batch (trainers/generation_ranks.py)
            with self.phases("generate"):
                idx, *generated, streamed = self.feed.batch(cycle, s.device)
        elif self.streaming is not None:  # the first groups to finish, whatever generation batch they came from
            with self.phases("generate"):
                step = cycle + 1  # one generation batch per optimizer step
                groups = self.streaming.next_groups(drain=self.evaluates_after(step) or self.saves_after(step))
                idx, *generated, streamed = self.streaming.batch(groups, s.device)
        if self.streaming is not None or self.feed is not None:
            batch, metrics = self._sample_and_score([self.rows[i] for i in idx], [], cfg.num_generations, train=True,
                                                    generated=tuple(generated))
            metrics.update(streamed)
        else:
            batch, metrics = self._sample_and_score([self.rows[i] for i in idx], [self.prompt_ids[i] for i in idx],
                                                    cfg.num_generations, train=True)
        if cfg.dynamic_sampling:
            batch, metrics = fill_generation_batch(self, cycle, batch, metrics)
        # TRL shuffles the generation batch, then splits it into steps_per_generation micro-batches.
        bs = cfg.per_device_train_batch_size
        g = torch.Generator().manual_seed(mix_seed(cfg.seed, "shuffle", cycle, s.process_index))
        perm = torch.randperm(len(idx), generator=g).to(s.device)
        sels = [perm[j * bs : (j + 1) * bs] for j in range(cfg.steps_per_generation)]
        return [{k: (v[sel] if v.dim() and v.shape[0] == len(idx) else v) for k, v in batch.items()}
                for sel in sels], metrics

    def _sample_and_score(self, rows: list[dict], ids: list[list[int]], num_generations: int, train: bool,
                          generated: tuple | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Complete and score this process's share of a batch (every process's rows in groups of
        ``num_generations``); ``train``: keep what the loss needs and count the tokens; ``generated``: the
        (prompt_ids, prompt_mask, RolloutOutput) already sampled (streaming)."""
        cfg, s, tok = self.cfg, self.session, self.tokenizer
        dev = s.device
        prompts, agent = [r["prompt"] for r in rows], None
        with self.phases("generate"):
            if generated is not None:
                prompt_ids, prompt_mask, out = generated
            elif self.tool_use is None and self.rollout_func is None:
                prompt_ids, prompt_mask = left_pad(ids, tok.pad_token_id, dev)
                out = self.rollout.generate(prompt_ids, prompt_mask)
            else:  # multi-turn with tools, or the user's rollout_func (trainers/tools.py)
                out = agent = agents.sample(self, rows)
                prompts, prompt_ids, prompt_mask = agent.prompts, agent.prompt_ids, agent.prompt_mask
        completion_ids, completion_mask = out.completion_ids.to(dev), out.completion_mask.to(dev).long()
        tool_mask = agent.tool_mask if agent is not None else None  # 0 on tool output: out of the loss (TRL)
        lengths = completion_mask.sum(1) if tool_mask is None else (completion_mask * tool_mask).sum(1)
        truncated = truncated_rows(completion_ids, completion_mask, self.eos_ids + [tok.pad_token_id])
        # What was generated, up to and with EOS: what rewards read, even where the loss masks it out (TRL).
        generated = [c[m.bool()].tolist() for c, m in zip(completion_ids, completion_mask)]
        if cfg.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
            tool_mask = tool_mask * (~truncated).unsqueeze(1).long() if tool_mask is not None else None
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
        n = completion_ids.shape[1]
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": completion_mask, **({"tool_mask": tool_mask} if tool_mask is not None else {})}
        bs = cfg.per_device_train_batch_size if train else cfg.per_device_eval_batch_size
        sampler = getattr(out, "logprobs", None)  # a rollout that reports none is not corrected
        corrects = train and sampler is not None and off_policy.corrects_sampling(cfg)
        # Where TRL keeps no old log-probs they are the loss forward's own: the correction reads those there.
        logps = self.needs_old_logps() if train else self.logps_in_rewards()
        old = None
        if logps:
            with self.phases("policy_forward"), compiled_layers.no_eager_fallback(bool(self.compiled_layers)):
                old, _ = completion_logps(s.engines["policy"], input_ids, attention_mask, n, cfg.temperature,
                                          batch_size=bs, fused=True, padding_free=cfg.padding_free)
        with self.phases("score"):
            ref = None
            if not train and not logps:
                pass
            elif self.separate_reference:
                with s.activate("reference"):
                    ref, _ = completion_logps(s.engines["reference"], input_ids, attention_mask, n,
                                              cfg.temperature, batch_size=bs, padding_free=cfg.padding_free)
            elif cfg.beta != 0.0:  # LoRA: the base model is the reference (TRL's use_adapter(model, None))
                with adapters_disabled(s.engines["policy"]):
                    ref, _ = completion_logps(s.engines["policy"], input_ids, attention_mask, n, cfg.temperature,
                                              batch_size=bs, fused=True, padding_free=cfg.padding_free)
            texts = tok.batch_decode(generated, skip_special_tokens=True)
            per_func = self.rewards.score(prompts, texts, generated, rows=rows, trainer_state=self.trainer_state,
                                          **({"completions": agent.completions, "extra": agent.reward_kwargs}
                                             if agent is not None else {}))
        all_per_func = self._gather(per_func)
        self.rewards.warn(all_per_func)
        adv = self.advantages(all_per_func, old, ref, loss_mask, num_generations)
        local = slice(s.process_index * len(rows), (s.process_index + 1) * len(rows))
        batch["advantages"] = adv["advantages"][local]
        batch["num_items_in_batch"] = self._sum(loss_mask.sum().float())
        if train and cfg.dynamic_sampling:
            batch["rewards_per_func"] = per_func.to(dev)
        if old is not None:
            batch["old_per_token_logps"] = old
        if ref is not None:
            batch["ref_per_token_logps"] = ref
        sampled = {}
        if train and sampler is not None:  # full vocabulary, temperature-scaled, as the training forward's
            batch["sampling_per_token_logps"] = sampler.to(dev)
            if corrects and old is not None:
                batch["importance_sampling_ratio"], sampled = off_policy.correct_sampling(
                    cfg, old, batch["sampling_per_token_logps"], loss_mask, self._gather)

        metrics = self.generation_metrics(all_per_func, adv, prompt_mask, lengths, truncated, count_tokens=train)
        metrics.update(adv.get("metrics", {}))
        metrics.update(sampled)
        metrics.update(self.rewards.logged_metrics())
        if self.tool_use is not None:
            counts = self._sum(torch.tensor([agent.calls, agent.failures], dtype=torch.float32, device=dev))
            metrics.update(self.tool_use.metrics(counts[0].item(), counts[1].item(), len(rows) * s.num_processes))
        if train:
            self.samples = (prompts, texts, self.rewards.total(per_func), self.rewards.extra_columns())
        else:
            self.rewards.extra_columns()  # an eval batch's logged columns are not the training samples'
        return batch, metrics

    def advantages(self, rewards_per_func: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                   completion_mask: torch.Tensor, num_generations: int | None = None) -> dict[str, Any]:
        cfg = self.cfg
        return group_advantages(rewards_per_func, self.rewards.weights.to(rewards_per_func.device),
                                num_generations or cfg.num_generations, cfg.scale_rewards,
                                cfg.multi_objective_aggregation)

    def generation_metrics(self, all_per_func: torch.Tensor, adv: dict[str, Any], prompt_mask: torch.Tensor,
                           lengths: torch.Tensor, truncated: torch.Tensor, count_tokens: bool = True
                           ) -> dict[str, float]:
        """TRL's per-generation metrics, over every process's completions; ``count_tokens``: add them to
        ``num_tokens`` (training batches, as TRL's ``num_input_tokens_seen``)."""
        m = self.rewards.metrics(all_per_func)
        m["frac_reward_zero_std"] = adv["is_std_zero"].float().mean().item()
        all_lengths = self._gather(lengths).float()
        prompt_tokens = self._sum(prompt_mask.sum().float()).item()
        if count_tokens:
            self.num_tokens += prompt_tokens + all_lengths.sum().item()
        m["num_tokens"] = self.num_tokens
        return {**m, **completion_metrics(all_lengths, self._gather(truncated))}

    def policy_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's per-token log-probs and entropies of the batch's completions (with grad)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        bonus = self.entropy_bonus is not None and self.entropy_bonus.enabled
        with compiled_layers.no_eager_fallback(bool(self.compiled_layers)):
            return completion_logps(self.session.engines["policy"], input_ids, attention_mask,
                                    batch["completion_mask"].shape[1], self.cfg.temperature, compute_entropy=True,
                                    fused=True, padding_free=self.cfg.padding_free, entropy_grad=bonus)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg, s = self.cfg, self.session
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)  # tool output is out of the loss (TRL)
        logps, entropies = self.policy_logps(batch)
        entropy_mask = None
        if cfg.top_entropy_quantile < 1.0:
            local = entropies.detach()[mask.bool()].float()
            pool = local
            if s.num_processes > 1:  # the quantile over every process's tokens, as TRL takes it
                pool = gather_ranks(s, pad_across_ranks(s, local, dim=0, pad_index=-1e9))
                pool = pool[pool != -1e9]
            entropy_mask = high_entropy_mask(entropies.detach(), mask, 1 - cfg.top_entropy_quantile, pool)
        ratio, sampled = batch.get("importance_sampling_ratio"), None
        if ratio is None and "sampling_per_token_logps" in batch and off_policy.corrects_sampling(cfg):
            ratio, sampled = off_policy.correct_in_loss(cfg, logps, batch["sampling_per_token_logps"], mask)
        loss, stats = grpo_loss(cfg, logps, batch.get("old_per_token_logps"), batch.get("ref_per_token_logps"),
                                batch["advantages"], mask, entropy_mask, batch["num_items_in_batch"],
                                s.num_processes, batch.get("sampling_per_token_logps"), ratio, entropies,
                                self.entropy_bonus)
        stats["means"]["entropy"] = ((entropies.detach() * mask).sum(), mask.sum().float())
        if sampled is not None:  # training_step reduces them over the generation batch (sampling/*)
            stats["sampling"] = sampled
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
                if cfg.vllm_enable_sleep_mode:  # the engine's cache and graphs free while the batch trains
                    self.rollout.sleep()
                sampled = []  # the sampling_values of the micro-batches whose loss formed the correction
            batch = self._buffer[micro % cfg.steps_per_generation]
            with self.phases("train"):
                loss, st = self.compute_loss(batch)
                s.backward("policy", loss * self.backward_scale())
                s.step("policy")
            loss_sum += loss.item() * self.backward_scale() / ga
            if "sampling" in st:  # such a generation batch trains within this step
                place, part = micro % self.micro_per_generation, st.pop("sampling")
                if place < cfg.steps_per_generation:  # its first pass (num_iterations): each sequence once
                    sampled.append(part)
                if place == cfg.steps_per_generation - 1:  # all of it has trained: TRL's metrics over the batch
                    metrics.update(off_policy.reduce_sampling_values(sampled, cfg.vllm_importance_sampling_mode,
                                                                     self._gather))
            stats.append(st)
        bonus = {}
        if self.entropy_bonus is not None and self.entropy_bonus.enabled:  # logged at the step's end, as TRL
            self.entropy_bonus.step_ended(self._sum)
            bonus = {"entropy_coef": self.entropy_bonus.coef}
        if self.streaming is not None:
            with self.phases("generate"):
                self.streaming.weights_changed()
        if self.feed is not None:
            with self.phases("weight_sync"):
                self.feed.stepped(step)
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
            with self.phases("ref_sync"):
                s.blend("reference", "policy", cfg.ref_model_mixup_alpha)
        return {"loss": loss_sum, "stats": stats, "generations": generations, **bonus,
                "grad_norm": s.grad_norm("policy") or 0.0, "learning_rate": s.learning_rate("policy"),
                "epoch": step * ga / self.micro_batches_per_epoch,
                "times": {**self.phases.pop(), "time/step": time.perf_counter() - tick}}

    def log_row(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """A window's row as TRL logs it: generation metrics, micro-batch loss stats, mean step loss."""
        row = reduce_loss_stats([st for r in rows for st in r["stats"]], self._sum, self._gather)
        row["loss"] = mean_over_ranks(self.session, {"loss": sum(r["loss"] for r in rows) / len(rows)})["loss"]
        row.update(average_generation_metrics([g for r in rows for g in r["generations"]]))
        row.update({k: rows[-1][k] for k in ("grad_norm", "learning_rate", "epoch")})
        if "entropy_coef" in rows[-1]:
            row["entropy_coef"] = sum(r["entropy_coef"] for r in rows) / len(rows)
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
        adaptive = self.entropy_bonus is not None and self.entropy_bonus.adaptive
        return {"num_tokens": self.num_tokens, "dynamic_rounds": self.dynamic_rounds,
                **(self.entropy_bonus.state() if adaptive else {})}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.num_tokens = float(state.get("num_tokens", 0.0))
        self.dynamic_rounds = int(state.get("dynamic_rounds", 0))
        if self.entropy_bonus is not None:
            self.entropy_bonus.restore(state)
        if self.cfg.sync_ref_model:
            self.session.load_weights("reference", checkpoint / "reference")

    def can_checkpoint(self, step: int) -> bool:
        # A checkpoint holds no generation batch, so it is taken only where one ends (streaming: drained).
        if self.streaming is not None:
            return self.streaming.drained
        if self.feed is not None:  # the generation ranks drain only where the config saves
            return self.saves_after(step)
        return (step * self.cfg.gradient_accumulation_steps) % self.micro_per_generation == 0

    def checkpoint_rank_state(self, directory: Path, rank: int) -> None:
        if self.streaming is not None:  # the finished groups not yet trained
            self.streaming.save(directory, rank)
        if self.feed is not None:
            self.feed.save(directory, rank, self.step)

    def restore_rank_state(self, directory: Path, rank: int) -> None:
        if self.streaming is not None:
            self.streaming.restore(directory, rank)
        if self.feed is not None:
            self.feed.restore(directory, rank)

    def _log_samples(self) -> None:
        prompts, texts, scores, extra = self.samples
        k = self.cfg.num_completions_to_print or len(texts)
        rows = [{"step": self.step, "prompt": p if isinstance(p, str) else p[-1]["content"], "completion": c,
                 "reward": round(float(r), 4)} for p, c, r in zip(prompts[:k], texts[:k], scores[:k].tolist())]
        for column, values in extra.items():  # columns reward functions added with log_extra
            for row, v in zip(rows, values):
                row[column] = v
        write_samples(self.session, self.cfg.output_dir, rows, step=self.step, unique_prompts=self.cfg.log_unique_prompts)


def micro_batches_per_epoch(num_prompts: int, cfg: GRPOConfig) -> int:
    """TRL's epoch in micro-batches (its dataloader's length), the unit of the logged ``epoch``."""
    prompts_per_generation = cfg.generation_batch_size // cfg.num_generations
    return (num_prompts // prompts_per_generation) * cfg.steps_per_generation * cfg.num_iterations
