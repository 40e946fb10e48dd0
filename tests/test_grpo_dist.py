"""GRPO and RLOO on two CPU processes (one launch, tests/dist/grpo_checks.py): placement
invariance, resume, beta 0 without a reference, learning, TRL's metric names."""

import pytest
from conftest import together_json

COMPARED = ["loss", "reward", "reward_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "clip_ratio/high_max", "grad_norm", "rewards/sentiment_reward/mean",
            "rewards/reward-trained-s0-n200/mean", "completions/mean_length", "num_tokens"]


@pytest.fixture(scope="module")
def checks(launched_together):
    return together_json(launched_together, "test_grpo_dist")  # tests/dist/grpo_checks.py


def close(a: dict, b: dict, keys: list[str], tol: float) -> None:
    assert a["step"] == b["step"]
    for k in keys:
        if k in a or k in b:
            assert b[k] == pytest.approx(a[k], abs=tol, rel=tol), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("mix", ["zero2-replicated", "zero3", "hf"])
def test_placement_invariance(checks, mix):
    """The same samples, rewards (function and reward-model role), KL to a reference synced every
    step, clipped ratios and losses whatever the placement: policy ZeRO-2 or ZeRO-3, frozen roles
    ZeRO-3 or replicated; "hf": the default mix generating with transformers' generate."""
    base, other = checks["placements"]["zero2-zero3"], checks["placements"][mix]
    assert len(base) == len(other) == 4
    for a, b in zip(base, other):
        close(a, b, COMPARED, 1e-4)
    assert checks["roles"][mix] == ["policy", "reference", "reward"]


def test_the_runs_exercise_kl_clipping_and_reuse(checks):
    """So that invariance means something: the reference drifts (synced), ratios clip on the
    reused generation batch (steps 2 and 4 train on the batch sampled at steps 1 and 3)."""
    rows = checks["placements"]["zero2-zero3"]
    assert rows[1]["kl"] > 0 and rows[3]["kl"] > 0
    assert rows[1]["clip_ratio/region_mean"] > 0
    # Steps 2 and 4 sampled nothing: no reward or completion metrics (as TRL, see below).
    assert "reward" in rows[0] and "reward" not in rows[1] and rows[2]["reward"] != rows[0]["reward"]
    assert all(r["time/ref_sync"] > 0 for r in rows)
    assert checks["rollout"]["zero3"]["backend"] == "posttrain"  # the ZeRO-3 policy gathered for the engine
    assert checks["rollout"]["hf"]["backend"] == "hf"


def test_resume_equals_uninterrupted(checks):
    full, resumed = checks["placements"]["zero2-zero3"], checks["resumed"]
    # The history is the whole run's: the rows kept in metrics.jsonl up to checkpoint-2, then the resumed ones.
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        close(a, b, [*COMPARED, "learning_rate", "epoch"], 1e-5)


def test_beta_zero_loads_no_reference(checks):
    assert checks["roles"]["beta0"] == ["policy"]
    assert "kl" not in checks["learn"][0]


def test_learns_the_bundled_reward(checks):
    """40 steps on the bundled reward (positive minus negative adjectives, in [-2, 2])."""
    hist = checks["learn"]
    tenth = len(hist) // 10
    first = sum(h["reward"] for h in hist[:tenth]) / tenth
    last = sum(h["reward"] for h in hist[-tenth:]) / tenth
    assert last - first > 0.7, (first, last)


def test_the_trained_policy_is_the_output_dir_and_the_cards_quick_start_runs(checks, capsys):
    """TRL's layout: from_pretrained(output_dir) loads the policy, the run's settings do not take
    config.json, and the model card's own quick-start code (pipeline(model=output_dir)) runs."""
    import re
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    out = Path(checks["learn_dir"])
    AutoModelForCausalLM.from_pretrained(out)
    assert (out / "posttrain_config.json").is_file()
    card = (out / "README.md").read_text()
    (code,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", card, re.S)
    assert f'model="{out}"' in code
    exec(compile(code, "quick_start", "exec"), {})
    assert capsys.readouterr().out.strip()  # it generated


def test_trl_metric_names_and_phases(checks):
    row = checks["placements"]["zero2-zero3"][0]  # a step that generated
    for key in ["reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean",
                "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "completions/mean_terminated_length", "num_tokens",
                "rewards/sentiment_reward/mean", "rewards/sentiment_reward/std", "loss", "grad_norm",
                "learning_rate", "epoch", "time/generate", "time/score", "time/policy_forward", "time/train"]:
        assert key in row, key


def test_rloo_placement_invariance(checks):
    base, other = checks["rloo"]["zero2-zero3"], checks["rloo"]["zero2-replicated"]
    assert len(base) == len(other) == 4
    for a, b in zip(base, other):
        close(a, b, ["loss", "reward", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"], 1e-4)
    # One generation batch (steps_per_generation 2 x num_iterations 2) serves all four steps (only
    # the first logs its rewards, as TRL); the policy moves away from the sampler's old log-probs.
    assert [("reward" in r, "num_tokens" in r) for r in base] == [(True, True)] + [(False, False)] * 3
    assert any(r["clip_ratio/region_mean"] > 0 for r in base[1:])


GENERATION_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "num_tokens")


def generation_keys(row: dict) -> set[str]:
    return {k for k in row if k in GENERATION_KEYS or k.startswith(("rewards/", "completions/"))}


def test_reuse_steps_log_what_trl_logs(checks, tmp_path):
    """TRL 1.16's GRPOTrainer, two steps on one generation batch (steps_per_generation 2): the
    second step logs no reward, completion or num_tokens metrics (its _metrics hold only what was
    appended since the last log). posttrain's rows have the same generation keys, step by step."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from posttrain.demo import synthetic, tiny

    args = TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=6, steps_per_generation=2, max_steps=2,
                     logging_steps=1, save_strategy="no", disable_tqdm=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path())
    trainer = TRLTrainer(model=model, reward_funcs=[synthetic.sentiment_reward], args=args,
                         train_dataset=Dataset.from_dict({"prompt": synthetic.prompts(16, seed=0)}),
                         processing_class=tiny.load_tokenizer())
    trainer.train()
    theirs = [generation_keys(r) for r in trainer.state.log_history if "loss" in r]
    ours = [generation_keys(r) for r in checks["placements"]["zero2-zero3"][:2]]
    rename = {"rewards/reward-trained-s0-n200/mean", "rewards/reward-trained-s0-n200/std"}  # our second reward
    assert theirs[1] == ours[1] == set()
    assert theirs[0] == ours[0] - rename and "num_tokens" in theirs[0]


def test_window_metrics_as_trl_log():
    """A logging window's generation metrics (TRL's log(): the mean of what was appended, NaN left
    out; num_tokens replaced, so the latest cumulative count, also with several generations per
    step)."""
    import math

    from posttrain.trainers.grpo import average_generation_metrics

    gens = [{"reward": 1.0, "rewards/f/mean": math.nan, "num_tokens": 100.0},
            {"reward": 2.0, "rewards/f/mean": 3.0, "num_tokens": 250.0}]
    assert average_generation_metrics(gens) == {"reward": 1.5, "rewards/f/mean": 3.0, "num_tokens": 250.0}
    assert math.isnan(average_generation_metrics([{"reward": math.nan}])["reward"])
    assert average_generation_metrics([]) == {}


def test_summary_reads_the_rows_that_sampled():
    from posttrain.scripts.grpo import summarize
    from posttrain.trainers.grpo import GRPOConfig

    rows = [{"step": 1, "reward": 0.0}, {"step": 2}, {"step": 3, "reward": 1.0}, {"step": 4}]
    out = summarize(rows, GRPOConfig(per_device_train_batch_size=8, num_generations=4), 1.0)
    assert (out["steps"], out["reward_first_tenth"], out["reward_last_tenth"]) == (4, 0.0, 1.0)


def test_a_reward_function_failing_on_one_rank_stops_both(checks):
    sentence = checks["failure"][1]
    assert sentence.startswith("reward function 'judge_down_on_rank_1' raised ConnectionError: the judge is down (at ")
    assert checks["failure"] == [sentence, sentence]


def test_num_tokens_is_cumulative_with_a_generation_per_micro_step(checks):
    """Two generations per optimizer step: the logged num_tokens is the count after both (TRL's
    state.num_input_tokens_seen), not the mean of the two cumulative counts."""
    rows, total = checks["ga2"]["history"], checks["ga2"]["num_tokens"]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["num_tokens"] == total
    # Each generation adds at least its completions' tokens: 32 rows x mean length.
    assert rows[1]["num_tokens"] - rows[0]["num_tokens"] >= 2 * 32 * rows[1]["completions/mean_length"] - 1e-6


# -- LoRA (the launch's LoRA runs; the one-process checks are in tests/test_lora_online.py) ------
@pytest.mark.parametrize("mix", ["zero2-replicated", "zero3"])
def test_lora_placement_invariance(checks, mix):
    """A LoRA policy under ZeRO-2 or ZeRO-3 (the frozen base sharded while the adapters train),
    the reward model replicated or ZeRO-3: the same run; no reference role (its base is the reference)."""
    base, other = checks["lora"]["zero2-zero3"], checks["lora"][mix]
    assert len(base) == len(other) == 4
    for a, b in zip(base, other):
        close(a, b, COMPARED, 1e-4)
    assert checks["roles"][f"lora-{mix}"] == ["policy", "reward"]
    assert base[3]["kl"] > 1e-3 and any(r["clip_ratio/region_mean"] > 0 for r in base)  # the adapters moved
    for a, b in zip(checks["lora"]["rloo-zero2-zero3"], checks["lora"]["rloo-zero3"]):
        close(a, b, ["loss", "reward", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"], 1e-4)


def test_lora_resume_equals_uninterrupted(checks):
    """Resumed from checkpoint-2 (adapters and their optimizer state): the uninterrupted run's rows."""
    full, resumed = checks["lora"]["zero2-zero3"], checks["lora"]["resumed"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        close(a, b, [*COMPARED, "learning_rate", "epoch"], 1e-5)


def test_lora_saves_the_adapter_or_the_merged_model(checks):
    """ZeRO-2 run: the adapter in PEFT format at the top of the output dir; ZeRO-3 run with
    merge_adapters: a plain transformers model (its shards gathered); the two give the same logits.
    posttrain_config.json and the model card say the reference was the base with adapters disabled."""
    import json
    from pathlib import Path

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny

    adapter_dir, merged_dir = (Path(checks["lora_dir"]) / f"lora-{m}" for m in ("zero2-zero3", "zero3"))
    assert (adapter_dir / "adapter_model.safetensors").is_file() and not (adapter_dir / "model.safetensors").exists()
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter_config.json").exists()
    untrained = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    with torch.no_grad():
        a, b, before = adapted(input_ids=ids).logits, merged(input_ids=ids).logits, untrained(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert (a - before).abs().max() > 1e-3  # it trained
    said = "the policy's base model with its LoRA adapters disabled"
    for out in (adapter_dir, merged_dir):
        assert json.loads((out / "posttrain_config.json").read_text())["reference_model"] == said
        assert said in (out / "README.md").read_text()


def test_dynamic_sampling_is_placement_invariant_and_resumes(checks):
    """Two processes: every rank keeps the same groups (the runs agree across placements and after a resume
    from step 2, the extra generation batches drawn before it included); zero-spread groups were dropped."""
    runs = checks["dynamic"]
    base = runs["zero2-zero3"]
    counters = ["dynamic_sampling/extra_rounds", "dynamic_sampling/dropped_groups", "dynamic_sampling/underfilled"]
    sampled = [r for r in base if "dynamic_sampling/extra_rounds" in r]
    assert len(sampled) == 2 and all(r["dynamic_sampling/extra_rounds"] >= 1 for r in sampled)
    assert all(r["frac_reward_zero_std"] > 0 for r in sampled)
    for other in (runs["zero3"], runs["resumed"]):
        assert [r["step"] for r in other] == [1, 2, 3, 4]
        for a, b in zip(base, other):
            close(a, b, [*COMPARED, *counters], 1e-4)


def test_streaming_is_placement_invariant_and_resumes(checks):
    """Two processes streaming their own groups (max_staleness 2, 4 slots each): the same rows under
    zero2-zero3 and zero3 and after a resume from step 2; some trained groups were sampled under older weights."""
    runs = checks["streaming"]
    base = [r for r in runs["zero2-zero3"] if "loss" in r]
    streamed = ["sample/staleness_mean", "sample/staleness_max", "streaming/dropped_groups"]
    assert [r["step"] for r in base] == [1, 2, 3, 4]
    assert 0 < max(r["sample/staleness_max"] for r in base) <= 2
    for other in (runs["zero3"], runs["resumed"]):
        other = [r for r in other if "loss" in r]
        assert [r["step"] for r in other] == [1, 2, 3, 4]
        for a, b in zip(base, other):
            close(a, b, [*COMPARED, *streamed], 1e-4)
