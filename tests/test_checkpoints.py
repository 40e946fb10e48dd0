"""Checkpoints, output dirs and resume: atomic checkpoints (a rank killed in the middle of a save),
resume_from_checkpoint latest, metrics.jsonl truncated on resume, save_total_limit, reused output
dirs. The two-process launches (tests/dist/checkpoint_kill.py) also carry PPO's reward-model and
metric checks, to share their start-up cost."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, launch_env, torchrun
from test_rewards import other_reward_model_path

from posttrain.errors import ConfigError
from posttrain.run.output_dir import latest_checkpoint, prepare_output_dir, resume_dir
from posttrain.trainers.config import LoopConfig
from posttrain.trainers.run_log import truncate_jsonl

COMPARED = ["objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "loss/value_avg",
            "policy/approxkl_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var"]


def fake_checkpoint(out, step, complete=True):
    state = out / (f"checkpoint-{step}" if complete else f"checkpoint-{step}.tmp") / "state"
    (state / "policy").mkdir(parents=True)
    if complete:
        (state / "trainer_state.json").write_text(json.dumps({"step": step}))
    return state.parent


def write_rows(path, steps, key="step"):
    path.write_text("".join(json.dumps({key: s, "loss": 1.0 / s}) + "\n" for s in steps))


# -- one process: the output-dir rules ---------------------------------------------------------
def test_reused_output_dir_is_refused_unless_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    prepare_output_dir(LoopConfig(output_dir=str(out)))  # empty: fine
    (out / "posttrain_config.json").write_text("{}")
    prepare_output_dir(LoopConfig(output_dir=str(out)))  # settings alone are not a run
    write_rows(out / "metrics.jsonl", [5, 8])
    fake_checkpoint(out, 8)
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, checkpoint-8\): pass "
                                          r"--resume_from_checkpoint latest .* --overwrite_output_dir true"):
        prepare_output_dir(LoopConfig(output_dir=str(out)))
    prepare_output_dir(LoopConfig(output_dir=str(out), overwrite_output_dir=True))
    assert sorted(p.name for p in out.iterdir()) == [".posttrain.lock", "posttrain_config.json"]
    assert "clearing metrics.jsonl, checkpoint-8" in capsys.readouterr().err


def test_resume_latest_takes_the_newest_complete_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(ConfigError, match="'latest' but .* holds no complete checkpoint: unset resume_from_checkpoint"):
        prepare_output_dir(LoopConfig(output_dir=str(out), resume_from_checkpoint="latest"))
    for step in (2, 10):
        fake_checkpoint(out, step)
    partial = fake_checkpoint(out, 12, complete=False)
    assert latest_checkpoint(out) == out / "checkpoint-10"  # by step, not by name (10 > 2), never the .tmp
    cfg = LoopConfig(output_dir=str(out), resume_from_checkpoint="latest")
    prepare_output_dir(cfg)
    err = capsys.readouterr().err
    assert "removing" in err and "checkpoint-12.tmp: a half-written checkpoint" in err
    assert f"resuming from {out / 'checkpoint-10'} (step 10)" in err
    assert not partial.exists() and resume_dir(cfg) == out / "checkpoint-10"
    true = LoopConfig(output_dir=str(out), resume_from_checkpoint="true")  # as Trainer.train(resume_from_checkpoint=True)
    prepare_output_dir(true)
    assert true.resume_from_checkpoint == str(out / "checkpoint-10")
    # An explicit half-written or foreign path is refused with the way out.
    with pytest.raises(ConfigError, match="half-written checkpoint .* resume from .*checkpoint-10"):
        resume_dir(LoopConfig(output_dir=str(out), resume_from_checkpoint=str(fake_checkpoint(out, 14, False))))
    with pytest.raises(ConfigError, match="not a posttrain checkpoint"):
        resume_dir(LoopConfig(output_dir=str(out), resume_from_checkpoint=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="save_total_limit must be >= 1"):
        prepare_output_dir(LoopConfig(output_dir=str(out), save_total_limit=0))


def test_truncate_jsonl(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [1, 2, 3, 4])  # a dead run's rows 3 and 4 past its checkpoint at 2
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # cut short when the run was killed
    assert truncate_jsonl(tmp_path / "metrics.jsonl", 2) == 3
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    write_rows(tmp_path / "samples.jsonl", [1, 3], key="update")
    assert truncate_jsonl(tmp_path / "samples.jsonl", 2) == 1
    assert truncate_jsonl(tmp_path / "absent.jsonl", 2) == 0


# -- two processes: a rank killed while saving, then resume -------------------------------------
def launch_expecting_failure(*args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "checkpoint_kill.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    other = other_reward_model_path(tmp_path_factory.mktemp("reward-assets"), 700)
    # One launch: the full run (its JSON written), then the killed one, which ends the launch.
    killed = launch_expecting_failure(tmp / "full.json", "full-then-killed", tmp, other)
    assert (tmp / "full.json").is_file(), killed.stdout[-4000:] + killed.stderr[-8000:]
    full = json.loads((tmp / "full.json").read_text())
    killed_dir = {p.name: sorted(q.name for q in p.iterdir()) for p in (tmp / "killed").glob("checkpoint-*")}
    killed_rows = len((tmp / "killed" / "metrics.jsonl").read_text().splitlines())
    kto_killed = launch_expecting_failure(tmp / "kto-killed.json", "kto-killed", tmp)
    kto_dir = sorted(p.name for p in (tmp / "kto-killed").glob("checkpoint-*"))
    grpo_killed = launch_expecting_failure(tmp / "grpo-killed.json", "grpo-streaming-killed", tmp)
    grpo_dir = {p.name: sorted(q.name for q in (p / "state").iterdir())
                for p in (tmp / "grpo-killed").glob("checkpoint-*") if (p / "state").is_dir()}
    resumed_out = tmp / "resume.json"
    log = torchrun(ROOT / "tests" / "dist" / "checkpoint_kill.py", resumed_out, "resume", tmp)
    return dict(tmp=tmp, full=full, killed=killed, killed_dir=killed_dir, killed_rows=killed_rows, log=log,
                resumed=json.loads(resumed_out.read_text()), kto_killed=kto_killed, kto_dir=kto_dir,
                grpo_killed=grpo_killed, grpo_dir=grpo_dir)


def test_a_save_killed_midway_leaves_only_a_tmp_folder(runs):
    assert runs["killed"].returncode != 0
    # checkpoint-2 is complete; checkpoint-4 never got its name (rank 1 wrote no value state).
    assert set(runs["killed_dir"]) == {"checkpoint-2", "checkpoint-4.tmp"}
    assert runs["killed_dir"]["checkpoint-2"] == ["policy", "state"]
    assert runs["killed_rows"] == 4  # the dead run logged updates 3 and 4 past its last checkpoint


def test_resume_latest_skips_it_and_equals_the_uninterrupted_run(runs):
    tmp, full, resumed = runs["tmp"], runs["full"]["history"], runs["resumed"]
    assert "checkpoint-4.tmp: a half-written checkpoint" in runs["log"]
    assert f"resuming from {tmp / 'killed' / 'checkpoint-2'} (step 2)" in runs["log"]
    assert not (tmp / "killed" / "checkpoint-4.tmp").exists() and (tmp / "killed" / "checkpoint-4").is_dir()
    # The history is the whole run's: the dead run's rows up to the checkpoint, then the resumed ones.
    assert resumed["start"] == 2 and [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    for a, b in zip(full, resumed["history"]):
        for key in [*COMPARED, "lr", "epoch"]:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (b["step"], key)
    # metrics.jsonl: the first two rows of the dead run, then the resumed run's, none left over.
    rows = [json.loads(x) for x in (tmp / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["objective/scores"] == pytest.approx(full[3]["objective/scores"], rel=1e-5)


def test_load_state_refuses_a_missing_rank_rng_state(runs):
    assert "lacks the RNG state of rank(s) [1]" in runs["resumed"]["refused"]


def test_save_total_limit_keeps_the_newest(runs):
    from transformers import AutoModelForCausalLM

    out = runs["tmp"] / "full"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-4" / "policy")  # Hugging Face format


def test_final_save_puts_the_policy_at_the_top_and_the_value_model_beside_it(runs):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out = runs["tmp"] / "full"
    assert runs["full"]["saved"] == str(out)
    AutoModelForCausalLM.from_pretrained(out)  # TRL's layout: the output dir is the model
    AutoTokenizer.from_pretrained(out)
    assert AutoModelForSequenceClassification.from_pretrained(out / "value").config.num_labels == 1
    assert json.loads((out / "posttrain_config.json").read_text())["output_dir"] == str(out)


# -- PPO checks carried by the "full" launch ----------------------------------------------------
def test_ppo_ratio_var_is_the_variance_over_all_ranks(runs):
    # Rank values [0, 0] and [1, 1]: unbiased variance of all four is 1/3 (a mean of per-rank ones: 0).
    assert runs["full"]["gathered_var"] == pytest.approx(1 / 3)
    assert all(h["val/ratio_var"] >= 0 for h in runs["full"]["history"])


def test_ppo_reward_model_with_another_vocabulary(runs):
    """A reward model with its own 700-token tokenizer (the policy's has 547) scores decoded
    completions re-encoded with its tokenizer and chat template, through its ZeRO-3 engine."""
    other = runs["full"]["other_vocab"]
    assert not other["shares_policy_ids"] and other["updates"] == 1
    assert other["got"] == pytest.approx(other["want"], abs=1e-4)
    assert len(set(other["texts"])) > 1


def test_kto_killed_while_saving_resumes_to_the_uninterrupted_run(runs):
    """KTO on two processes, rank 1 gone while checkpoint-4 is written: the resume skips the half-written folder,
    starts at step 2 and logs what the uninterrupted run logged."""
    assert runs["kto_killed"].returncode != 0 and runs["kto_dir"] == ["checkpoint-2", "checkpoint-4.tmp"]
    full = [r for r in runs["resumed"]["kto_full"] if "loss" in r]
    resumed = [r for r in runs["resumed"]["kto_resumed"] if "loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and [r["step"] for r in full] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (b["step"], key)


def test_streaming_grpo_killed_while_saving_resumes_to_the_uninterrupted_run(runs):
    """GRPO streaming on two processes (finished, untrained groups saved per rank), rank 1 gone while checkpoint-4
    is written: the half-written folder (its streaming files already there) is skipped, the run resumes from step 2
    and logs what the uninterrupted run logged, staleness and all."""
    assert runs["grpo_killed"].returncode != 0
    assert set(runs["grpo_dir"]) == {"checkpoint-2", "checkpoint-4.tmp"}
    assert {"streaming_rank0.pt", "streaming_rank1.pt", "trainer_state.json"} <= set(runs["grpo_dir"]["checkpoint-2"])
    assert "trainer_state.json" not in runs["grpo_dir"]["checkpoint-4.tmp"]
    full = [r for r in runs["resumed"]["grpo_full"] if "loss" in r]
    resumed = [r for r in runs["resumed"]["grpo_resumed"] if "loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and [r["step"] for r in full] == [1, 2, 3, 4]
    assert max(r["sample/staleness_max"] for r in full) > 0
    for a, b in zip(full, resumed):
        for key in ("loss", "reward", "entropy", "grad_norm", "sample/staleness_mean", "completions/mean_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (b["step"], key)
