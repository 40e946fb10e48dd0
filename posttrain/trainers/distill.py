"""Knowledge distillation as TRL 1.16's ``DistillationTrainer`` (on-policy: the student generates, and learns the
frozen teacher's next-token distributions over its completions), with GKD's ``lmbda`` and ``seq_kd`` to train
also on the dataset's or the teacher's completions; each model under its own DeepSpeed plugin."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import trl

from posttrain.data.order import mix_seed, rank_batches, seed_everything
from posttrain.data.prompts import check_prompt_rows, left_pad
from posttrain.errors import ConfigError
from posttrain.models import varlen_attention
from posttrain.models.lora import check_no_head_adapter
from posttrain.models.packing import Packing, packs
from posttrain.models.setup import prepare_trained
from posttrain.models.sources import distinct_objects, init_kwargs, model_config, policy_source
from posttrain.placement.ranks import sum_over_ranks, world_size
from posttrain.placement.roles import TRAINER_ROLES
from posttrain.rollout.api import RolloutFields, check_rollout_fields
from posttrain.rollout.sampling import check_min_p, check_repetition_penalty, generation_overrides
from posttrain.trainers.config import TrainConfig, check_eval_data, epoch_steps, make_session
from posttrain.trainers.loop import Trainer, default_args, refuse_arguments
from posttrain.trainers.online import config_sampling, write_samples
from posttrain.trainers.run_log import Phases


@dataclass
class DistillationConfig(TrainConfig, RolloutFields, trl.DistillationConfig):
    """``trl.DistillationConfig`` (its fields, names and defaults) plus posttrain's placement and rollout fields
    and GKD's sequence sources (``lmbda``, ``seq_kd``), whose defaults are TRL's on-policy distillation."""

    # Fraction of micro-batches on the student's own generations; 1: always, as TRL's DistillationTrainer.
    lmbda: float = 1.0
    seq_kd: bool = False  # the other micro-batches: the teacher's generations instead of the dataset's completions
    # Prompt + completion tokens of a dataset row (the prompt cut from the left); None: no limit, as TRL.
    max_length: int | None = None
    padding_free: bool = True  # student and teacher forwards on packed rows (exact, no compute on padding)

    _algorithm = "distillation"
    _trl_works = ("model_init_kwargs", "trust_remote_code", "teacher_model_name_or_path", "teacher_model_revision",
                  "teacher_model_init_kwargs", "disable_dropout", "max_completion_length",
                  "ds3_gather_for_generation", "pad_to_multiple_of", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "chat_template_kwargs", "generation_kwargs", "beta", "log_completions",
                  "num_completions_to_print", "log_unique_prompts")
    _trl_refused = {
        "shuffle_dataset": "posttrain's distillation always shuffles the rows (TRL's default)",
        "cache_implementation": "posttrain generates with its own engine (generation_backend), not transformers' cache",
        "max_tool_calling_iterations": "multi-turn tool use runs in GRPOTrainer and RLOOTrainer",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta", "lmbda"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        check_min_p(self.min_p)
        check_repetition_penalty(self.repetition_penalty)
        generation_overrides(self.generation_kwargs, [], self.temperature)
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length must be >= 1 (new tokens per generated completion), got "
                              f"{self.max_completion_length!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"max_length must be >= 2 (a prompt token and a completion token) or null, got "
                              f"{self.max_length}")
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


def completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device,
                     pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion`` rows (to a multiple of ``pad_to_multiple_of``); labels keep only the
    completion tokens."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, len(p) : len(s)] = ids[i, len(p) : len(s)]
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def check_rows(dataset: Any, name: str, needs_completion: bool) -> list[dict]:
    """``dataset``'s rows (a Dataset or a list of dicts): a "prompt" each (text or messages), and a "completion"
    of the same kind where ``needs_completion``; one sentence for what is missing, before anything loads."""
    rows = check_prompt_rows(dataset, name, "distillation")
    has = [r.get("completion") is not None for r in rows]
    if needs_completion and not all(has):
        raise ConfigError(f"{name}: row {has.index(False)} has no 'completion', which lmbda < 1 without seq_kd trains "
                          "on (TRL's prompt-completion format): add the completions, or set lmbda 1 (TRL's on-policy "
                          "distillation: the student's own completions) or seq_kd true (the teacher's)")
    for i, r in enumerate(rows):
        kinds = {type(r["prompt"]) is str} | ({type(r["completion"]) is str} if r.get("completion") is not None else set())
        if len(kinds) > 1 or not isinstance(r["prompt"], (str, list)):
            raise ConfigError(f"{name}: row {i} mixes forms: prompt and completion must both be text or both lists of "
                              "messages ({'role', 'content'})")
    return rows


class DistillationTrainer(Trainer):
    """TRL 1.16's ``DistillationTrainer``: the student (``model``: a hub name, a local path or an object) learns the
    teacher's (``teacher_model``, else ``args.teacher_model_name_or_path``) next-token distributions by the
    generalized JSD (``beta``) over completions from the student itself (``lmbda``), the teacher (``seq_kd``) or
    the dataset's "completion" column."""

    name = "distill"
    shown = ("loss", "eval/loss")
    roles = TRAINER_ROLES["distill"]
    evaluates = True

    def __init__(self, model: Any, teacher_model: Any = None, args: DistillationConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None) -> None:
        refuse_arguments("DistillationTrainer", optimizers=optimizers, quantization_config=quantization_config,
                         tools=tools or None)
        self.cfg = cfg = args if args is not None else default_args(DistillationConfig, model, "Distillation")
        check_eval_data(cfg, eval_dataset)
        distinct_objects(model=model, teacher_model=teacher_model)
        self.teacher_source = teacher_source(teacher_model, cfg.teacher_model_name_or_path)
        if train_dataset is None:
            raise ConfigError("DistillationTrainer needs train_dataset= (a datasets.Dataset or a list of dicts with a "
                              "'prompt')")
        needs_completion = cfg.lmbda < 1 and not cfg.seq_kd
        train_rows = check_rows(train_dataset, "train_dataset", needs_completion)
        eval_rows = check_rows(eval_dataset, "eval_dataset", False) if eval_dataset is not None else None
        if peft_config is not None:
            check_no_head_adapter(peft_config)  # TRL: the loss reads lm_head.weight, an adapter there never trains
        self.student_source, self.tokenizer, self.student_path = policy_source(cfg, model, processing_class,
                                                                                what="student")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        check_vocabularies(model_config(self.student_source), model_config(self.teacher_source))
        self.train_rows = self._prepare(train_rows)
        self.eval_rows = self._prepare(eval_rows) if eval_rows else None
        # Evaluation without completions generates the student's, as TRL's.
        eval_generates = bool(self.eval_rows) and any(r["completion_ids"] is None for r in self.eval_rows)
        self.max_prompt_len = max(len(r["prompt_ids"]) for r in self.train_rows + (self.eval_rows or []))
        seed_everything(cfg.seed)
        self.total_steps = self.count_steps()
        per_step = cfg.per_device_train_batch_size * world_size() * cfg.gradient_accumulation_steps
        epoch_steps(cfg, max(1, math.ceil(len(self.train_rows) / per_step)))  # transformers' steps per epoch
        decoded = self.roles["trained"] if cfg.lmbda > 0 or eval_generates else []
        self.session = s = make_session(cfg, self.roles["trained"], self.roles["frozen"], total_steps=self.total_steps,
                                        decoded=decoded)
        student_kwargs = init_kwargs(cfg, dtype="float32")  # TRL's default
        varlen_attention.choose_for(s, student_kwargs, self.student_source, cfg.padding_free)
        student = s.load("student", self.student_source, **student_kwargs)
        teacher_kwargs = {**(cfg.teacher_model_init_kwargs or {})}
        if cfg.teacher_model_revision is not None:
            teacher_kwargs.setdefault("revision", cfg.teacher_model_revision)
        if cfg.trust_remote_code:
            teacher_kwargs.setdefault("trust_remote_code", True)
        varlen_attention.choose_for(s, teacher_kwargs, self.teacher_source, cfg.padding_free)
        teacher = s.load("teacher", self.teacher_source, **teacher_kwargs)
        self.sampling = config_sampling(cfg, student, self.tokenizer)
        self.peft_config = peft_config
        self.student = self.model = prepare_trained(s, "student", student, cfg, peft_config,
                                                    total_steps=self.total_steps)
        self.teacher = self.teacher_model = s.prepare("teacher", teacher)
        self.phases = Phases()
        self._batches = None
        self._samples: list[dict] = []  # the last step's (prompt, completion) texts, for log_completions
        self.rollouts: dict[str, Any] = {}  # role -> posttrain.rollout.Rollout
        self.num_tokens = 0
        self._finish_init(callbacks)

    def count_steps(self) -> int:
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        per_step = cfg.per_device_train_batch_size * world_size() * cfg.gradient_accumulation_steps
        return max(1, math.ceil(cfg.num_train_epochs * len(self.train_rows) / per_step))

    def _encode(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int] | None]]:
        """Prompt and completion ids of raw rows (a missing completion: None), as TRL tokenizes them: a text
        prompt with the tokenizer's special tokens, its completion bare + EOS; messages through the chat template
        (``chat_template_kwargs``). With ``max_length``, the prompt keeps its last tokens and the completion what
        fits."""
        from trl.data_utils import apply_chat_template

        tok, cfg = self.tokenizer, self.cfg
        prompts, completions = [], []
        for r in rows:
            completion = r.get("completion")
            if isinstance(r["prompt"], list):
                example = {"prompt": r["prompt"], **({"completion": completion} if completion is not None else {})}
                text = apply_chat_template(example, tok, **(cfg.chat_template_kwargs or {}))
                prompt = tok(text["prompt"], add_special_tokens=False)["input_ids"]
                # The template ends the assistant's turn itself.
                done = tok(text["completion"], add_special_tokens=False)["input_ids"] if completion is not None else None
            else:
                prompt = tok(r["prompt"])["input_ids"]
                done = (tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                        if completion is not None else None)
            if cfg.max_length is not None:
                prompt = prompt[-(cfg.max_length - 1):]
                done = done[: max(1, cfg.max_length - len(prompt))] if done is not None else None
            if not prompt:
                raise ConfigError(f"prompt {r['prompt']!r} tokenizes to nothing")
            prompts.append(prompt)
            completions.append(done)
        return prompts, completions

    def _prepare(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts, completions = self._encode(rows)
        return [{"prompt_ids": p, "completion_ids": c} for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def generate(self, role: str, prompts: list[list[int]]) -> list[list[int]]:
        """Sample completions from ``role``'s model, each cut after its first EOS (collective on ZeRO-3)."""
        from posttrain.rollout import Rollout

        s, tok, cfg = self.session, self.tokenizer, self.cfg
        batch = cfg.per_device_train_batch_size
        if role not in self.rollouts:
            self.rollouts[role] = Rollout.from_config(cfg, s, role, self.sampling, max_batch=batch,
                                                      max_prompt_len=self.max_prompt_len)
        out_rows = []
        for i in range(0, len(prompts), batch):
            ids, mask = left_pad(prompts[i : i + batch], tok.pad_token_id, s.device)
            out = self.rollouts[role].generate(ids, mask)
            out_rows += [row[:n] for row, n in zip(out.completion_ids.tolist(), out.completion_mask.sum(1).tolist())]
        return out_rows

    def _source(self, micro_step: int) -> str:
        # GKD's draw, seeded by micro-step: the same on every rank (ZeRO-3 is collective) and on resume.
        if self.cfg.lmbda >= 1.0 or random.Random(mix_seed(self.cfg.seed, "source", micro_step)).random() < self.cfg.lmbda:
            return "student"
        return "teacher" if self.cfg.seq_kd else "data"

    def logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Student and teacher logits at the positions that predict a next token (all but the last);
        ``padding_free``: computed on the packed row, 0 at padding (the loss reads completion tokens only)."""
        if self.cfg.padding_free and packs(self.student) and packs(self.teacher):
            packing = Packing.of(batch["attention_mask"])
            inputs = {**packing.model_inputs(batch["input_ids"]), "use_cache": False}

            def padded(logits: torch.Tensor) -> torch.Tensor:
                return packing.unpack(logits[0].float())[:, :-1]
        else:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

            def padded(logits: torch.Tensor) -> torch.Tensor:
                return logits[:, :-1].float()
        with self.session.activate("teacher"), torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        student_logits = self.student(**inputs).logits
        return padded(student_logits), padded(teacher_logits)

    def _batch(self, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
        return completion_batch(prompts, completions, self.tokenizer.pad_token_id, self.session.device,
                                self.cfg.pad_to_multiple_of)

    def training_step(self, step: int) -> dict[str, float]:
        s, cfg, phases = self.session, self.cfg, self.phases
        ga = cfg.gradient_accumulation_steps
        if self._batches is None:
            self._batches = rank_batches(len(self.train_rows), cfg.per_device_train_batch_size, cfg.seed,
                                         s.process_index, s.num_processes, start=(step - 1) * ga)
        # The step's completions first (TRL generates a step's batch at once), then its micro-batches.
        batches, sources, lengths = [], [], []
        for k in range(ga):
            micro_step = (step - 1) * ga + k
            source = self._source(micro_step)
            rows = [self.train_rows[i] for i in next(self._batches)]
            prompts = [r["prompt_ids"] for r in rows]
            completions = [r["completion_ids"] for r in rows]
            if source != "data":
                # Seeded per micro-step and rank so that a resumed run samples the same sequences.
                torch.manual_seed(mix_seed(cfg.seed, "generate", micro_step, s.process_index))
                with phases("generate"):
                    completions = self.generate(source, prompts)
            batches.append(self._batch(prompts, completions))
            sources.append(source)
            lengths.append(sum(len(c) for c in completions) / len(completions))
            self._samples = [{"step": step, "source": source, "prompt": self.tokenizer.decode(p, skip_special_tokens=True),
                              "completion": self.tokenizer.decode(c, skip_special_tokens=True)}
                             for p, c in zip(prompts, completions)] if cfg.log_completions else []
        # TRL's reduction: the divergence summed over every completion token of the step (all micro-batches and
        # processes) over their count; the engine's division by accumulation steps and processes is undone.
        local = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        items = max(self._sum([float(local)])[0], 1.0)
        loss_sum, n_input = 0.0, 0
        for batch in batches:
            with phases("forward"):
                student_logits, teacher_logits = self.logits(batch)
                div = generalized_jsd_loss(student_logits, teacher_logits, batch["labels"][:, 1:], beta=cfg.beta,
                                           temperature=cfg.temperature, reduction="sum")
            with phases("backward"):
                s.backward("student", div * (s.num_processes * ga / items))
                s.step("student")
            loss_sum += div.item()
            n_input += int(batch["attention_mask"].sum())
        loss_sum, n_input = self._sum([loss_sum, float(n_input)])
        self.num_tokens += int(n_input)
        seen = step * ga * cfg.per_device_train_batch_size * s.num_processes
        return {"loss": loss_sum / items, "completion_length": sum(lengths) / len(lengths),
                "grad_norm": s.grad_norm("student") or 0.0, "learning_rate": s.learning_rate("student"),
                "epoch": seen / len(self.train_rows),  # TRL's fractional epoch (rows seen over the dataset's)
                "num_tokens": float(self.num_tokens),
                "on_policy": sources.count("student") / len(sources), "seq_kd": sources.count("teacher") / len(sources),
                **{f"{k}/{role}": v for role, r in self.rollouts.items() for k, v in r.metrics().items()},
                **phases.pop()}

    def _sum(self, values: list[float]) -> list[float]:
        s = self.session
        return sum_over_ranks(s, torch.tensor(values, dtype=torch.float64, device=s.device)).tolist()

    def on_log(self, step: int) -> None:
        """``log_completions``: the step's last micro-batch (this process's) in ``samples.jsonl``."""
        if self.cfg.log_completions and self._samples:
            n = self.cfg.num_completions_to_print
            write_samples(self.session, self.cfg.output_dir, self._samples[:n] if n is not None else self._samples,
                          step=step, unique_prompts=self.cfg.log_unique_prompts)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens}

    def restore(self, state: dict[str, Any], checkpoint: Any) -> None:
        self.num_tokens = int(state.get("num_tokens", 0))

    @torch.no_grad()
    def evaluate(self, rows: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Token-weighted forward KL, reverse KL, JSD and training loss on ``rows`` (default: the eval set), over
        their completions, or the student's own (sampled at a fixed seed) where a row has none, as TRL's."""
        s, cfg = self.session, self.cfg
        prepared = self._prepare(check_rows(rows, "rows", False)) if rows is not None else self.eval_rows or []
        per_rank = len(prepared) // s.num_processes
        if per_rank == 0:
            raise ConfigError(f"evaluation needs at least {s.num_processes} rows, one per process")
        mine = prepared[s.process_index * per_rank : (s.process_index + 1) * per_rank]
        measures = {"forward_kl": (0.0, 1.0), "jsd": (0.5, 1.0), "reverse_kl": (1.0, 1.0),
                    "loss": (cfg.beta, cfg.temperature)}
        sums = dict.fromkeys(measures, 0.0)
        tokens = 0
        generates = any(r["completion_ids"] is None for r in prepared)  # the same on every rank: collective
        rng = torch.get_rng_state()
        self.student.eval()
        for i in range(0, per_rank, cfg.per_device_eval_batch_size):
            chunk = mine[i : i + cfg.per_device_eval_batch_size]
            prompts = [r["prompt_ids"] for r in chunk]
            completions = [r["completion_ids"] for r in chunk]
            if generates:
                torch.manual_seed(mix_seed(cfg.seed, "evaluate", i, s.process_index))
                generated = self.generate("student", prompts)
                completions = [c if c is not None else g for c, g in zip(completions, generated)]
            batch = self._batch(prompts, completions)
            student_logits, teacher_logits = self.logits(batch)
            for name, (beta, temperature) in measures.items():
                sums[name] += generalized_jsd_loss(student_logits, teacher_logits, batch["labels"][:, 1:], beta=beta,
                                                   temperature=temperature, reduction="sum").item()
            tokens += int((batch["labels"][:, 1:] != -100).sum())
        self.student.train()
        torch.set_rng_state(rng)  # evaluating does not move the training run's sampling
        totals = self._sum([*sums.values(), tokens])
        return {f"eval/{k}": v / max(totals[-1], 1) for k, v in zip(sums, totals)}

    def has_eval_data(self) -> bool:
        return bool(self.eval_rows)


def teacher_source(teacher_model: Any, teacher_model_name_or_path: str | None) -> Any:
    """The teacher: ``teacher_model`` (TRL's script passes the config's name there too), else the config's name."""
    if teacher_model is None:
        if not teacher_model_name_or_path:
            raise ConfigError("distillation needs a teacher: pass teacher_model= (a hub name, a local path or a model "
                              "object) or set teacher_model_name_or_path")
        return teacher_model_name_or_path
    if teacher_model_name_or_path and str(teacher_model) != str(teacher_model_name_or_path):
        raise ConfigError("the teacher is given twice (teacher_model= and teacher_model_name_or_path), differently: "
                          "give one of them, or the same name in both (as TRL's script does)")
    return teacher_model
