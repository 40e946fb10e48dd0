"""The scripts (``posttrain dpo|ppo|distill``, examples/*.py): which settings apply, TRL/Trainer
flags, held-out data, --push_to_hub, and one plain process without a launcher."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from trl import ModelConfig, ScriptArguments

from posttrain import ConfigError, cli
from posttrain.demo import tiny
from posttrain.run import hub
from posttrain.scripts.args import demo_config, parse_config
from posttrain.scripts.data import load_train_eval
from posttrain.scripts.dpo import DataArguments
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.ppo import PPOConfig

DPO = (ScriptArguments, DataArguments, DPOConfig, ModelConfig)


def parse_dpo(*argv):
    return parse_config(DPO, demo_config("dpo"), list(argv), prog="posttrain dpo")[:3]


def test_demo_settings_only_for_the_tiny_default(capsys):
    _, _, demo = parse_dpo()
    assert (demo.learning_rate, demo.max_steps, demo.eval_strategy, demo.eval_steps) == (1e-3, 60, "steps", 20)
    assert "the built-in tiny default's demo settings" in capsys.readouterr().out
    # A user's model: TRL's DPOConfig defaults, not the demo's 1e-3 and 60 steps.
    _, _, own = parse_dpo("--model_name_or_path", "my-org/sft-model")
    assert (own.learning_rate, own.max_steps, own.num_train_epochs, own.logging_steps) == (1e-6, -1, 3.0, 10)
    assert (own.eval_strategy, own.gradient_checkpointing, own.max_length, own.beta) == ("no", True, 1024, 0.1)
    out = capsys.readouterr().out
    assert "settings from defaults" in out and "learning_rate=1e-06" in out and "model_name_or_path=my-org" in out
    # --config wins in both cases; flags override it (also in the --config=FILE form).
    _, _, given = parse_dpo(f"--config={demo_config('dpo')}", "--model_name_or_path", "my-org/m", "--max_steps", "7")
    assert (given.learning_rate, given.max_steps) == (1e-3, 7)


def test_trainer_flags_map_onto_posttrain(tmp_path):
    _, _, cfg = parse_dpo("--bf16", "true")  # TRL 1.16's bf16 is bool | None: the flag takes a value
    assert cfg.mixed_precision == "bf16"
    _, _, cfg = parse_dpo("--fp16", "true", "--save_total_limit", "2", "--push_to_hub", "--hub_model_id", "me/run")
    assert (cfg.mixed_precision, cfg.save_total_limit, cfg.push_to_hub, cfg.hub_model_id) == ("fp16", 2, True, "me/run")
    _, _, cfg = parse_dpo("--model_name_or_path", "m/x", "--eval_strategy", "steps", "--logging_steps", "4")
    assert cfg.eval_steps == 4  # TRL's rule: eval_steps defaults to logging_steps
    with pytest.raises(ConfigError, match="bf16 and fp16 are both set"):
        parse_dpo("--bf16", "true", "--fp16", "true")
    with pytest.raises(ConfigError, match="--bf16 contradicts mixed_precision 'fp16'"):
        parse_dpo("--bf16", "true", "--mixed_precision", "fp16")
    # YAML 1.1 reads 1e-3 as a string; it is converted like the same flag would be.
    (tmp_path / "c.yaml").write_text("learning_rate: 1e-3\nmax_steps: '5'\n")
    _, _, cfg = parse_dpo("--config", str(tmp_path / "c.yaml"))
    assert (cfg.learning_rate, cfg.max_steps) == (1e-3, 5)


def test_unknown_flags_and_keys_name_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown flag --lerning_rate: did you mean --learning_rate\?$"):
        parse_dpo("--lerning_rate", "1e-5")
    with pytest.raises(ConfigError, match=r"unknown flag --save_total_limt: did you mean --save_total_limit\?"):
        parse_dpo("--save_total_limt=2")
    (tmp_path / "c.yaml").write_text("per_device_train_batchsize: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown setting 'per_device_train_batchsize': did you mean "
                                          r"'?per_device_train_batch_size"):
        parse_dpo("--config", str(tmp_path / "c.yaml"))
    assert cli.main(["dpo", "--bf17"]) == 2
    assert cli.main(["ppo", "--total_episode", "4"]) == 2


def test_cli_commands(capsys):
    assert cli.main(["dpoo"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'dpoo': did you mean 'dpo'?" in err and "dpo,ppo,distill,grpo,rloo" in err
    assert cli._trainer("no_such_trainer", []) == 2
    assert "posttrain.scripts.no_such_trainer is missing" in capsys.readouterr().err
    (ppo,) = parse_config(PPOConfig, demo_config("ppo"), [], prog="posttrain ppo")
    assert ppo.total_episodes == 4096 and ppo.output_dir == "runs/ppo"


def test_distill_with_your_student_needs_a_teacher(tmp_path, capsys):
    assert cli.main(["distill", "--model_name_or_path", str(tiny.sft_model_path()), "--output_dir", str(tmp_path / "run")]) == 2
    assert "error: distilling into your own student needs a teacher with its vocabulary: set " \
           "--teacher_model_name_or_path" in capsys.readouterr().err


def rows(n):
    return [{"prompt": f"p{i}", "chosen": " good", "rejected": " bad"} for i in range(n)]


def test_held_out_split_and_the_no_eval_message(tmp_path, capsys):
    from posttrain.data.preference import write_jsonl

    path = str(write_jsonl(rows(40), tmp_path / "pairs.jsonl"))
    script = ScriptArguments(dataset_name=path)
    cfg = DPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5)
    train, test = load_train_eval(script, 0.25, cfg)
    assert (len(train), len(test)) == (30, 10)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    train, test = load_train_eval(script, 4, cfg)  # a count of rows
    assert (len(train), len(test)) == (36, 4)
    train, test = load_train_eval(script, 0.0, cfg)
    assert test is None and len(train) == 40
    said = capsys.readouterr().out
    assert f"no evaluation will run: {path} has no 'test' split" in said and "--test_split_size 0.1" in said
    train, test = load_train_eval(script, 0.25, DPOConfig(output_dir=str(tmp_path)))  # eval_strategy "no"
    assert test is None and len(train) == 40
    assert "no evaluation will run: eval_strategy is 'no'" in capsys.readouterr().out


def test_push_to_hub_uploads_the_final_model(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            from huggingface_hub import RepoUrl

            calls.append(("create_repo", repo_id, private, exist_ok))
            full = repo_id if "/" in repo_id else f"alice/{repo_id}"  # the Hub puts a bare name under the user
            return RepoUrl(f"https://huggingface.co/{full}")

        def upload_folder(self, repo_id, folder_path, commit_message, allow_patterns=None, ignore_patterns=None):
            calls.append(("upload_folder", repo_id, folder_path, allow_patterns, ignore_patterns))

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    out = tmp_path / "my-run"
    out.mkdir()
    (out / "README.md").write_text("card")
    cfg = DPOConfig(output_dir=str(out), push_to_hub=True, hub_private_repo=True, hub_token="hf_x")
    url = hub.push_to_hub(cfg, out)  # the model is at the top of the output dir: one upload, card included
    assert url == "https://huggingface.co/alice/my-run"
    assert calls == [("token", "hf_x"), ("create_repo", "my-run", True, True),
                     ("upload_folder", "alice/my-run", str(out), None, ["_*", "checkpoint-*", ".posttrain.lock"])]
    calls.clear()
    (out / "elsewhere").mkdir()
    hub.push_to_hub(DPOConfig(output_dir=str(out), hub_model_id="me/dpo"), out / "elsewhere")
    assert calls[2:] == [("upload_folder", "me/dpo", str(out / "elsewhere"), None, hub.IGNORED),
                         ("upload_folder", "me/dpo", str(out), hub.RUN_FILES, None)]


def test_one_plain_process_without_a_launcher(tmp_path):
    """`python examples/dpo.py`, as TRL scripts run on one GPU or CPU: no torchrun, no accelerate launch."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "dpo.py"), "--output_dir", str(out), "--max_steps", "2",
           "--synthetic_train_size", "64", "--synthetic_eval_size", "16", "--eval_steps", "2", "--logging_steps", "1",
           "--save_steps", "2", "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "posttrain dpo: settings from the built-in tiny default's demo settings" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2]
    assert any("eval/rewards/accuracies" in r for r in metrics)
    saved = json.loads((out / "posttrain_config.json").read_text())  # the effective settings
    assert (saved["max_steps"], saved["learning_rate"], saved["eval_strategy"], saved["eval_steps"]) == (2, 1e-3, "steps", 2)
    # ... and the script's own arguments (TRL's ScriptArguments, the data's), which the trainer does not take.
    assert saved["script_arguments"]["synthetic_train_size"] == 64 and saved["script_arguments"]["dataset_name"] is None
    assert (out / "model.safetensors").exists()  # the trained policy at the top, as TRL
    assert (out / "checkpoint-2" / "policy" / "model.safetensors").exists()
    assert "bundled synthetic preference pairs" in (out / "README.md").read_text()  # the card names the data
    # The rows scripts' report (posttrain/scripts/rows.py): held-out before -> after, summary.json, the saved model.
    assert re.search(r"^held-out eval/rewards/accuracies: \d\.\d{3} -> \d\.\d{3} \(eval/loss \d\.\d{4} -> \d\.\d{4}\)$",
                     proc.stdout, re.M), proc.stdout[-2000:]
    assert f"policy saved to {out}; metrics in {out}/metrics.jsonl" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["steps", "final_model", "eval_rewards/accuracies_before", "eval_rewards/accuracies",
                             "eval_loss", "eval_rewards/margins"]
    last_eval = [r for r in metrics if "eval/loss" in r][-1]
    assert (summary["steps"], summary["final_model"], summary["eval_loss"]) == (2, str(out), last_eval["eval/loss"])


def test_online_scripts_take_trls_script_arguments(tmp_path):
    """`posttrain grpo|rloo|ppo` parse TRL's ScriptArguments beside the trainer's config: a YAML's
    dataset_name and split go there (the configs have no dataset settings), the script loads the
    prompts (other columns kept, for reward functions) or, with no dataset, its bundled ones."""
    from posttrain.data.preference import write_jsonl
    from posttrain.scripts.data import BUNDLED_PROMPTS, PromptArguments, bundled_prompts, load_prompts
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.rloo import RLOOConfig

    rows = [{"prompt": f"the cat {i} is", "answer": str(i)} for i in range(4)]
    path = str(write_jsonl(rows, tmp_path / "prompts.jsonl"))
    (tmp_path / "c.yaml").write_text(f"dataset_name: {path}\ndataset_train_split: train\nnum_prompts: 8\n"
                                     f"output_dir: {tmp_path / 'out'}\n")
    from trl.scripts.grpo import GRPOScriptArguments  # TRL's grpo.py/rloo.py's: reward_funcs, reward model
    for config_cls, name, script_cls in ((GRPOConfig, "grpo", GRPOScriptArguments),
                                         (RLOOConfig, "rloo", GRPOScriptArguments), (PPOConfig, "ppo", ScriptArguments)):
        script, data, cfg = parse_config((script_cls, PromptArguments, config_cls), demo_config(name),
                                         ["--config", str(tmp_path / "c.yaml")])
        assert (script.dataset_name, script.dataset_train_split, data.num_prompts) == (path, "train", 8)
        assert not hasattr(cfg, "dataset_name") and not hasattr(cfg, "num_prompts")
        with pytest.raises(ConfigError, match=r"^unknown flag --dataset_split: did you mean --dataset_train_split\?$"):
            parse_config((script_cls, PromptArguments, config_cls), demo_config(name), ["--dataset_split", "train"])
    assert load_prompts(script, 8, 42, "PPO") == (rows, path)
    assert load_prompts(ScriptArguments(), 8, 42, "PPO") == (bundled_prompts(8, seed=42), BUNDLED_PROMPTS)
    with pytest.raises(ConfigError) as err:
        load_prompts(ScriptArguments(dataset_name=path, dataset_train_split="test"), 8, 42, "PPO")
    assert str(err.value) == (f"{path} (split 'test'): {path} is a single file: it has only the split 'train', not "
                              "'test'; set --dataset_train_split to one of its splits")
