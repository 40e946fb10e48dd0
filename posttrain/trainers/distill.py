"""Knowledge distillation as TRL's GKDTrainer: a trained student learns a frozen teacher's next-token
distributions, each model under its own DeepSpeed plugin."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.data.order import mix_seed, rank_batches, seed_everything
from posttrain.data.prompts import left_pad
from posttrain.errors import ConfigError
from posttrain.models.lora import LoraFields, lora_config
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import distinct_objects, given_once, model_config, policy_source
from posttrain.placement.ranks import sum_over_ranks, world_size
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rollout.api import RolloutFields, check_rollout_fields
from posttrain.trainers.config import TrainConfig, make_session
from posttrain.trainers.loop import Trainer
from posttrain.trainers.run_log import Phases


@dataclass
class DistillConfig(TrainConfig, LoraFields, RolloutFields):
    """Distillation settings; names follow TRL's GKDConfig / DistillationConfig."""

    output_dir: str = "runs/distill"
    learning_rate: float = 1e-6  # TRL's DistillationConfig
    model_name_or_path: str | None = None  # the student (or model=)
    teacher_model_name_or_path: str | None = None
    beta: float = 0.5  # 0: forward KL, 0.5: JSD, 1: reverse KL (GKDConfig's default)
    temperature: float = 1.0  # softens both distributions in the loss, and samples (DistillationTrainer)
    # Fraction of steps on the student's own generations; 0 since generation dominates a step's time.
    lmbda: float = 0.0
    seq_kd: bool = False  # on the other steps, train on the teacher's generations instead of the data
    max_new_tokens: int = 128  # TRL's GKDConfig
    max_length: int = 128  # prompt + completion tokens of a dataset row (generation adds max_new_tokens)
    disable_dropout: bool = True  # GKDConfig's default: a deterministic loss

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta", "lmbda"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        check_rollout_fields(self)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "batchmean") -> torch.Tensor:
    """TRL's GKD loss, ``beta·KL(teacher‖m) + (1-beta)·KL(student‖m)`` with ``m = beta·teacher +
    (1-beta)·student``, over positions whose label is not -100. A copy: TRL's is experimental."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:  # forward KL(teacher || student)
        div = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:  # reverse KL(student || teacher)
        div = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log1p(-b), teacher_log_probs + torch.log(b)]), 0)
        kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
        div = b * kl_teacher + (1 - b) * kl_student
    mask = labels != -100 if labels is not None else None
    if mask is not None:
        div = div[mask]
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if mask is not None else max(div.size(0), 1)
        return div.sum() / denom
    if reduction == "sum":
        return div.sum()
    if reduction == "mean":
        return div.mean()
    return div


def check_vocabularies(student_config: Any, teacher_config: Any) -> None:
    """The divergence compares whole next-token distributions, so both models need one vocabulary."""
    s = student_config.get_text_config().vocab_size
    t = teacher_config.get_text_config().vocab_size
    if s != t:
        raise ConfigError(f"the student's vocabulary has {s} tokens but the teacher's has {t}: distillation "
                          "compares the teacher's full next-token distribution with the student's, so both "
                          "must share one vocabulary (and tokenizer). Pick a teacher and student from the "
                          "same model family.")


def completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion`` rows; labels keep only the completion tokens."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, len(p) : len(s)] = ids[i, len(p) : len(s)]
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


class DistillTrainer(Trainer):
    """Distil teacher into student on prompt/completion rows; each model a config path or an object."""

    name = "distill"
    shown = ("loss", "eval/loss")
    roles = TRAINER_ROLES["distill"]
    evaluates = True

    def __init__(self, cfg: DistillConfig, train_dataset: Any, eval_dataset: Any = None, *, model: Any = None,
                 teacher_model: Any = None, processing_class: Any = None) -> None:
        distinct_objects(model=model, teacher_model=teacher_model)
        self.teacher_source = given_once(teacher_model, cfg.teacher_model_name_or_path or None, "teacher", "teacher_model",
                                         "teacher_model_name_or_path")
        if self.teacher_source is None:
            raise ConfigError("distillation needs a teacher: set teacher_model_name_or_path (or pass teacher_model=)")
        for rows, what in ((train_dataset, "train_dataset"), (eval_dataset or [], "eval_dataset")):
            if rows and not {"prompt", "completion"} <= set(rows[0]):
                raise ConfigError(f"{what} rows need 'prompt' and 'completion' (TRL's prompt-completion format)")
            if rows and not (isinstance(rows[0]["prompt"], str) and isinstance(rows[0]["completion"], str)):
                raise ConfigError(f"{what}: prompt and completion must be text; apply the chat template to "
                                  "conversational rows first (tokenizer.apply_chat_template(..., tokenize=False))")
        self.cfg = cfg
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.student_source, self.tokenizer, self.student_path = policy_source(cfg, model, processing_class,
                                                                                what="student")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        check_vocabularies(model_config(self.student_source), model_config(self.teacher_source))
        seed_everything(cfg.seed)
        self.total_steps = self.count_steps()
        self.session = s = make_session(cfg, self.roles["trained"], self.roles["frozen"], total_steps=self.total_steps,
                                        decoded=self.roles["trained"] if cfg.lmbda > 0 else [])
        # GKDTrainer's order (adapters, then dropout off); trained without activation checkpointing.
        self.student = prepare_trained(s, "student", s.load("student", self.student_source), cfg, lora_config(cfg),
                                       total_steps=self.total_steps, gradient_checkpointing=False)
        self.teacher = s.prepare("teacher", s.load("teacher", self.teacher_source))
        self.phases = Phases()
        self._batches = None
        self.rollouts: dict[str, Any] = {}  # role -> posttrain.rollout.Rollout
        self.history: list[dict] = []

    def count_steps(self) -> int:
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        world = world_size()
        per_step = cfg.per_device_train_batch_size * world * cfg.gradient_accumulation_steps
        return max(1, math.ceil(cfg.num_train_epochs * len(self.train_dataset) / per_step))

    def _encode(self, rows: list[dict[str, str]]) -> tuple[list[list[int]], list[list[int]]]:
        tok, keep = self.tokenizer, self.cfg.max_length - 1
        # The prompt as the tokenizer encodes text (with its BOS, if any), the completion bare + EOS.
        prompts = [tok(r["prompt"])["input_ids"][-keep:] for r in rows]
        completions = []
        for p, r in zip(prompts, rows):
            ids = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            completions.append(ids[: max(1, self.cfg.max_length - len(p))])
        return prompts, completions

    @torch.no_grad()
    def generate(self, role: str, prompts: list[list[int]]) -> list[list[int]]:
        """Sample completions from ``role``'s model, each cut after its first EOS (collective on ZeRO-3)."""
        from posttrain.rollout import Rollout, SamplingParams

        s, tok, cfg = self.session, self.tokenizer, self.cfg
        if role not in self.rollouts:
            sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id,
                                      temperature=cfg.temperature, stop_token_ids=[tok.eos_token_id])
            self.rollouts[role] = Rollout.from_config(cfg, s, role, sampling, max_batch=cfg.per_device_train_batch_size,
                                                      max_prompt_len=max(1, cfg.max_length - 1))
        ids, mask = left_pad(prompts, tok.pad_token_id, s.device)
        out = self.rollouts[role].generate(ids, mask)
        return [row[:n] for row, n in zip(out.completion_ids.tolist(), out.completion_mask.sum(1).tolist())]

    def _source(self, micro_step: int) -> str:
        # GKD's draw, seeded by micro-step: the same on every rank (ZeRO-3 is collective) and on resume.
        if random.Random(mix_seed(self.cfg.seed, "source", micro_step)).random() < self.cfg.lmbda:
            return "student"
        return "teacher" if self.cfg.seq_kd else "data"

    def logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Student and teacher logits at the positions that predict a next token (all but the last)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with self.session.activate("teacher"), torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        student_logits = self.student(**inputs).logits
        return student_logits[:, :-1].float(), teacher_logits[:, :-1].float()

    def training_step(self, step: int) -> dict[str, float]:
        s, cfg, phases = self.session, self.cfg, self.phases
        if self._batches is None:
            self._batches = rank_batches(len(self.train_dataset), cfg.per_device_train_batch_size, cfg.seed,
                                         s.process_index, s.num_processes, start=(step - 1) * cfg.gradient_accumulation_steps)
        batches = self._batches
        losses, lengths, sources = [], [], []
        for k in range(cfg.gradient_accumulation_steps):
            micro_step = (step - 1) * cfg.gradient_accumulation_steps + k
            source = self._source(micro_step)
            sources.append(source)
            rows = [self.train_dataset[i] for i in next(batches)]
            prompts, completions = self._encode(rows)
            if source != "data":
                # Seeded per micro-step and rank so that a resumed run samples the same sequences.
                torch.manual_seed(mix_seed(cfg.seed, "generate", micro_step, s.process_index))
                with phases("generate"):
                    completions = self.generate(source, prompts)
            batch = completion_batch(prompts, completions, self.tokenizer.pad_token_id, s.device)
            with phases("forward"):
                student_logits, teacher_logits = self.logits(batch)
                loss = generalized_jsd_loss(student_logits, teacher_logits, batch["labels"][:, 1:],
                                            beta=cfg.beta, temperature=cfg.temperature)
            with phases("backward"):
                s.backward("student", loss)
                s.step("student")
            losses.append(loss.item())
            lengths.append(sum(len(c) for c in completions) / len(completions))
        metrics = {"loss": sum(losses) / len(losses), "completion_length": sum(lengths) / len(lengths)}
        seen = step * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * s.num_processes
        return {**metrics, "grad_norm": s.grad_norm("student") or 0.0, "learning_rate": s.learning_rate("student"),
                "epoch": seen / len(self.train_dataset),  # TRL's fractional epoch (rows seen over the dataset's)
                "on_policy": sources.count("student") / len(sources), "seq_kd": sources.count("teacher") / len(sources),
                **{f"{k}/{role}": v for role, r in self.rollouts.items() for k, v in r.metrics().items()},
                **phases.pop()}

    @torch.no_grad()
    def evaluate(self, rows: list[dict[str, str]] | None = None) -> dict[str, float]:
        """Token-weighted forward KL, reverse KL, JSD and training loss on ``rows`` (default: eval set)."""
        s, cfg = self.session, self.cfg
        rows = rows if rows is not None else self.eval_dataset or []
        per_rank = len(rows) // s.num_processes
        if per_rank == 0:
            raise ConfigError(f"evaluation needs at least {s.num_processes} rows, one per process")
        mine = [rows[i] for i in range(s.process_index * per_rank, (s.process_index + 1) * per_rank)]
        measures = {"forward_kl": (0.0, 1.0), "jsd": (0.5, 1.0), "reverse_kl": (1.0, 1.0),
                    "loss": (cfg.beta, cfg.temperature)}
        sums = dict.fromkeys(measures, 0.0)
        tokens = 0
        self.student.eval()
        for i in range(0, per_rank, cfg.per_device_eval_batch_size):
            prompts, completions = self._encode(mine[i : i + cfg.per_device_eval_batch_size])
            batch = completion_batch(prompts, completions, self.tokenizer.pad_token_id, s.device)
            student_logits, teacher_logits = self.logits(batch)
            for name, (beta, temperature) in measures.items():
                sums[name] += generalized_jsd_loss(student_logits, teacher_logits, batch["labels"][:, 1:], beta=beta,
                                                   temperature=temperature, reduction="sum").item()
            tokens += int((batch["labels"][:, 1:] != -100).sum())
        self.student.train()
        totals = torch.tensor([*sums.values(), tokens], dtype=torch.float64, device=s.device)
        totals = sum_over_ranks(s, totals)
        return {f"eval/{k}": v / max(totals[-1].item(), 1) for k, v in zip(sums, totals.tolist())}

    def has_eval_data(self) -> bool:
        return bool(self.eval_dataset)
