"""GRPO's and RLOO's evaluation, as TRL's without its loss: completions of every eval prompt, scored."""

from __future__ import annotations

from typing import Any

from posttrain.errors import ConfigError
from posttrain.trainers.grpo_loss import average_generation_metrics


class GenerationEval:
    """``evaluate`` for a trainer with GRPOTrainer's ``_sample_and_score``, ``eval_rows`` and ``phases``."""

    cfg: Any
    session: Any
    eval_rows: list[dict] | None = None

    def has_eval_data(self) -> bool:
        """Evaluation as TRL's: an eval_dataset, and eval_strategy other than "no"."""
        return self.eval_rows is not None and self.cfg.eval_strategy != "no"

    def evaluate(self) -> dict[str, float]:
        """TRL's GRPO evaluation without its loss: ``num_generations_eval`` completions of every eval prompt
        (global batches of ``per_device_eval_batch_size`` x processes), scored; the rewards and completion
        metrics averaged over the batches as TRL logs them (``eval/reward``, ``eval/rewards/<name>/mean``, ...)."""
        cfg, s = self.cfg, self.session
        if self.eval_rows is None:
            raise ConfigError(f"{cfg._algorithm}: evaluate() needs eval_dataset= (rows with a 'prompt')")
        generations = cfg.num_generations_eval or cfg.num_generations
        global_batch = cfg.per_device_eval_batch_size * s.num_processes
        if global_batch % generations:
            raise ConfigError(f"the eval batch (per_device_eval_batch_size {cfg.per_device_eval_batch_size} x "
                              f"{s.num_processes} processes) must be a multiple of num_generations_eval "
                              f"({generations}), TRL's rule: set --per_device_eval_batch_size or --num_generations_eval")
        per_batch, n = global_batch // generations, len(self.eval_rows)
        policy = s.engines["policy"]
        policy.eval()
        gens = []
        try:
            for start in range(0, n, per_batch):
                # The last batch filled from the first prompts (accelerate's even_batches; TRL scores them too).
                prompts = [(start + k) % n for k in range(per_batch)]
                expanded = [i for i in prompts for _ in range(generations)]
                mine = expanded[s.process_index * cfg.per_device_eval_batch_size:
                                (s.process_index + 1) * cfg.per_device_eval_batch_size]
                _, metrics = self._sample_and_score([self.eval_rows[i] for i in mine],
                                                    [self.eval_prompt_ids[i] for i in mine], generations, train=False)
                gens.append(metrics)
        finally:
            policy.train()
            self.phases.pop()
            if cfg.vllm_enable_sleep_mode:  # training resumes: the engine's cache frees for it
                self.rollout.sleep()
        return {f"eval/{k}": v for k, v in average_generation_metrics(gens).items()}
