"""A user's bad input: one sentence naming the fix, exit status 2, before the output dir is touched or
any model loads (README: Bad input). In process for each case; tests/dist/bad_input.py repeats a few
on two ranks in one torchrun run and checks the launcher's output holds the sentence once."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from posttrain import ConfigError, checks, cli
from posttrain.data import preference
from posttrain.demo import tiny
from posttrain.trainers.dpo import LOSS_TYPES

MIXES = "zero2-zero3, zero3, zero2-replicated, zero2-zero3-offload, zero2-zero3-stock"
PRESETS = "tiny, 125m, 1b, 3b, 8b"
NO_DATA = ("--model_name_or_path is set but --dataset_name is not: give your data with --dataset_name (a hub name or "
           "a json/jsonl/parquet/csv file), or drop --model_name_or_path to run the built-in tiny default on its "
           "bundled data")


def pair(prompt, chosen="good", rejected="bad", role="user"):
    return {"prompt": [{"role": role, "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    """Paths the cases use: model folders broken in one way each, data files, a finished run."""
    root = tmp_path_factory.mktemp("bad")
    sft = tiny.sft_model_path()
    paths = {"root": root, "sft": sft, "reward": tiny.reward_model_path()}
    for name in ("no_template", "no_config", "truncated", "garbage", "sharded"):
        shutil.copytree(sft, root / name)
        paths[name] = root / name
    (root / "no_template" / "chat_template.jinja").unlink()
    (root / "no_config" / "config.json").unlink()
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    (root / "garbage" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"0" * 64)
    (root / "sharded" / "model.safetensors").rename(root / "sharded" / "model-00001-of-00002.safetensors")
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for name, rows in {"conv": [pair("hi")], "bad_role": [pair("hi"), pair("yo", role="usr")],
                       "no_role": [{"prompt": [{"content": "hi"}], "chosen": "a", "rejected": "b"}]}.items():
        paths[name] = preference.write_jsonl(rows, root / f"{name}.jsonl")
    feedback = [{"prompt": "the cat", "completion": " is nice", "label": True},
                {"prompt": "the dog", "completion": " is bad", "label": False}]
    for name, rows in {"kto_no_label": [{k: v for k, v in r.items() if k != "label"} for r in feedback],
                       "kto_int_label": [{**r, "label": int(r["label"])} for r in feedback],
                       "kto_one_label": [{**r, "label": True} for r in feedback],
                       "kto_no_assistant": [{"prompt": [{"role": "user", "content": "hi"}],
                                             "completion": [{"role": "user", "content": "yo"}], "label": True}]}.items():
        paths[name] = preference.write_jsonl(rows, root / f"{name}.jsonl")
    paths["prompts"] = preference.write_jsonl([{"prompt": [{"role": "user", "content": "hi"}]}] * 8,
                                              root / "prompts.jsonl")
    paths["no_column"] = preference.write_jsonl([{"question": "a", "answer": "b"}],
                                                root / "no_column.jsonl")
    paths["empty_prompt"] = preference.write_jsonl([{"prompt": "the cat is"}, {"prompt": ""}],
                                                   root / "empty_prompt.jsonl")
    for name, rows in {"tokens_oov": [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 600]}],
                       "tokens_mask": [{"input_ids": [5, 6, 7], "completion_mask": [0, 1]}],
                       "tokens": [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]}.items():
        paths[name] = preference.write_jsonl(rows, root / f"{name}.jsonl")
    (root / "roles.yaml").write_text("role_configs:\n  reference: zero3_inferense\n")
    paths["role_yaml"] = root / "roles.yaml"
    return paths


def run_dir(root: Path) -> Path:
    """A finished run's output dir: what --overwrite_output_dir would clear."""
    out = root / "previous-run"
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


# (id, command line with {placeholders} from the fixture, the sentence after "error: ")
CASES = [
    ("mistyped mix with overwrite", "dpo --output_dir {run} --overwrite_output_dir true --mix zero2-zero4",
     f"unknown mix 'zero2-zero4' (did you mean zero2-zero3?): choose one of {MIXES}, or map each role to a config "
     "in role_configs"),
    ("mistyped role config with overwrite", "dpo --output_dir {run} --overwrite_output_dir true --config {role_yaml}",
     "role_configs reference: DeepSpeed config 'zero3_inferense' not found (did you mean zero3_inference?): give a "
     "path to a JSON file or one of: replicated_inference, zero2_train, zero2_train_bf16_states, zero2_train_offload, "
     "zero3_inference, zero3_inference_offload, zero3_train, zero3_train_bf16_states"),
    ("negative learning rate", "dpo --output_dir {out} --learning_rate -1e-3",
     "learning_rate must be >= 0, got -0.001: set --learning_rate to 0 or more"),
    ("negative beta1", "ppo --output_dir {out} --adam_beta1 -.5",
     "adam_beta1 must be in [0, 1), got -0.5: AdamW's default is 0.9 / 0.999"),
    ("dpo model without data", "dpo --output_dir {out} --model_name_or_path {sft}", NO_DATA),
    ("ppo model without data", "ppo --output_dir {out} --model_name_or_path {sft}", NO_DATA),
    ("distill model without data",
     "distill --output_dir {out} --model_name_or_path {sft} --teacher_model_name_or_path {sft}", NO_DATA),
    ("no chat template", "dpo --output_dir {out} --model_name_or_path {no_template} --dataset_name {conv}",
     "train_dataset is conversational (lists of messages) but the tokenizer of {no_template} has no chat template: "
     "use a chat model's tokenizer, set tokenizer.chat_template and save it with the model, or give the data as "
     "plain text"),
    ("no chat template, ppo",
     "ppo --output_dir {out} --model_name_or_path {no_template} --reward_model_path {reward} --dataset_name {conv}",
     "train_dataset is conversational (lists of messages) but the tokenizer of {no_template} has no chat template: use a "
     "chat model's tokenizer, set tokenizer.chat_template and save it with the model, or give the data as plain "
     "text"),
    ("unknown role", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name {bad_role}",
     "train_dataset: row 1, 'prompt', message 0 has the unknown role 'usr': use one of system, user, assistant, "
     "tool, developer, ipython, function"),
    ("message without role", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name {no_role}",
     "train_dataset: row 0, 'prompt', message 0 has no 'role': each message is {{\"role\": ..., \"content\": ...}}"),
    ("missing column", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name {no_column}",
     "{no_column} (split 'train'): no column 'chosen'; a preference dataset needs prompt, chosen, rejected (or an "
     "implicit prompt in chosen/rejected), got columns ['question', 'answer']: rename its columns"),
    # Fewer rows than a batch train as TRL trains them (a short batch); no row left is refused.
    ("every prompt over max_length", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name {conv} "
     "--max_length 2", "train_dataset: no usable rows, every prompt fills max_length=2: raise --max_length"),
    ("sft tokenized ids outside the vocabulary", "sft --output_dir {out} --model_name_or_path {sft} --dataset_name "
     "{tokens_oov}", "train_dataset: row 1 has the token id 600 in 'input_ids', outside the tokenizer's vocabulary (0 "
     "to 546): tokenize the data with this model's tokenizer, or give it as text"),
    ("sft completion_mask of the wrong length", "sft --output_dir {out} --model_name_or_path {sft} --dataset_name "
     "{tokens_mask} --completion_only_loss true", "train_dataset: row 0 has 2 'completion_mask' values for its 3 "
     "'input_ids': give one completion_mask value per token"),
    ("sft completion_only_loss without a completion_mask", "sft --output_dir {out} --model_name_or_path {sft} "
     "--dataset_name {tokens} --completion_only_loss true", "train_dataset: completion_only_loss is on (asked for, or "
     "the default with prompt/completion columns) but the tokenized rows have no 'completion_mask' (nor 'labels'): add "
     "a completion_mask column (1 per completion token, 0 per prompt token), or set --completion_only_loss false to "
     "train on every token"),
    ("dpo loss type typo", "dpo --output_dir {out} --loss_type sigmod",
     "unknown loss_type 'sigmod': choose from " + ", ".join(LOSS_TYPES)),
    ("dataset path typo", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name {root}/prefs.jsonl",
     "--dataset_name '{root}/prefs.jsonl' does not exist ({root} has no 'prefs.jsonl'): give a json/jsonl/parquet/"
     "csv file, a dataset folder or a hub dataset name"),
    ("dataset file typo, relative", "dpo --output_dir {out} --model_name_or_path {sft} --dataset_name prefs.jsonl",
     "--dataset_name 'prefs.jsonl' does not exist (no such file in the current directory): give a json/jsonl/"
     "parquet/csv file, a dataset folder or a hub dataset name"),
    ("policy without config.json", "dpo --output_dir {out} --model_name_or_path {no_config} --dataset_name {conv}",
     "--model_name_or_path '{no_config}' has no config.json: give the folder that save_pretrained wrote "
     "(config.json beside the weights)"),
    ("truncated safetensors", "dpo --output_dir {out} --model_name_or_path {truncated} --dataset_name {conv}",
     "{truncated}/model.safetensors is truncated or corrupt (651136 bytes; its header says 652136): copy it again "
     "or re-save the model"),
    ("safetensors header not JSON", "dpo --output_dir {out} --model_name_or_path {garbage} --dataset_name {conv}",
     "{garbage}/model.safetensors is not a safetensors file (its header is not JSON): copy it again or re-save the "
     "model"),
    ("missing weight shard", "dpo --output_dir {out} --model_name_or_path {sharded} --dataset_name {conv}",
     "--model_name_or_path '{sharded}' lacks 1 of its 2 weight shards (model-00002-of-00002.safetensors, ...): copy "
     "the missing files, or re-save the model"),
    ("reward model path typo",
     "ppo --output_dir {out} --model_name_or_path {sft} --dataset_name {conv} --reward_model_path ./rm-typo",
     "--reward_model_path './rm-typo' does not exist: it is neither a local directory nor a hub id (owner/name); "
     "check the path"),
    ("reward model with two labels",
     "ppo --output_dir {out} --model_name_or_path {sft} --dataset_name {conv} --reward_model_path {sft}",
     "--reward_model_path '{sft}' has 2 labels in its config.json; a reward model scores with one logit: give a "
     "sequence-classification model trained with num_labels=1 (as TRL's RewardTrainer saves it)"),
    ("reference path typo", "dpo --output_dir {out} --ref_model_name_or_path {root}/sft-typo",
     "--ref_model_name_or_path '{root}/sft-typo' does not exist: {root} has no folder 'sft-typo'; check the path"),
    ("resume from a model folder", "dpo --output_dir {out} --resume_from_checkpoint {sft}",
     "resume_from_checkpoint '{sft}' is a model folder, not a checkpoint: to start from these weights pass "
     "--model_name_or_path instead; to continue a run give its checkpoint-N folder"),
    ("resume from nowhere", "grpo --output_dir {out} --resume_from_checkpoint {root}/checkpoint-9",
     "resume_from_checkpoint '{root}/checkpoint-9' does not exist: give a checkpoint-N folder of an output dir, or "
     "latest (the newest in {out})"),
    ("output dir is a file", "rloo --output_dir {conv}",
     "output_dir '{conv}' is a file: choose a folder with --output_dir"),
    ("a streamed dataset", "sft --output_dir {run} --overwrite_output_dir true --dataset_streaming true",
     "--dataset_streaming: posttrain's trainers take a whole datasets.Dataset (or rows), not a stream; drop the flag"),
    ("a streamed prompt dataset", "grpo --output_dir {out} --dataset_streaming true",
     "--dataset_streaming: posttrain's trainers take a whole datasets.Dataset (or rows), not a stream; drop the flag"),
    ("kto data without labels", "kto --output_dir {out} --model_name_or_path {sft} --dataset_name {kto_no_label}",
     "{kto_no_label} (split 'train'): no column 'label'; KTO's unpaired data needs prompt, completion, label (label true "
     "for a desirable completion, false for an undesirable one), or paired data with chosen and rejected, got columns "
     "['prompt', 'completion']: add or rename the columns"),
    ("kto labels that are not booleans", "kto --output_dir {out} --model_name_or_path {sft} --dataset_name "
     "{kto_int_label}", "{kto_int_label} (split 'train'): its 'label' column holds int64 values, not booleans: give "
     "each row's label as true (desirable completion) or false (undesirable completion)"),
    ("kto data of one label", "kto --output_dir {out} --model_name_or_path {sft} --dataset_name {kto_one_label}",
     "train_dataset: every row's label is true (desirable); KTO learns from both kinds of completion: add rows "
     "labelled false"),
    ("kto conversation without an assistant turn", "kto --output_dir {out} --model_name_or_path {sft} --dataset_name "
     "{kto_no_assistant}", "{kto_no_assistant} (split 'train'): row 0's 'completion' has no assistant message, so "
     "there is no completion to train on: end it with a {{\"role\": \"assistant\", \"content\": ...}} message"),
]
GRPO_CASES = [
    pytest.param("grpo model without data", "grpo --output_dir {out} --model_name_or_path {sft}", NO_DATA),
    pytest.param("rloo model without data", "rloo --output_dir {out} --model_name_or_path {sft}", NO_DATA),
    pytest.param("no chat template, grpo", "grpo --output_dir {out} --model_name_or_path {no_template} "
                 "--dataset_name {prompts} --reward_funcs posttrain.demo.synthetic:sentiment_reward",
                 "train_dataset is conversational (lists of messages) but the tokenizer of {no_template} has no chat "
                 "template: use a chat model's tokenizer, set tokenizer.chat_template and save it with the model, or "
                 "give the data as plain text"),
    # Prompt data: the script loads --dataset_name and names it.
    pytest.param("prompts without a prompt column, ppo", "ppo --output_dir {out} --model_name_or_path {sft} "
                 "--reward_model_path {reward} --dataset_name {no_column}",
                 "{no_column}: PPO needs a 'prompt' column (text or a list of messages); the columns are ['question', "
                 "'answer']"),
    pytest.param("an empty prompt, rloo", "rloo --output_dir {out} --model_name_or_path {sft} --dataset_name "
                 "{empty_prompt} --reward_funcs posttrain.demo.synthetic:sentiment_reward",
                 "{empty_prompt}: row 1 has an empty 'prompt'"),
]


def no_model_loads(monkeypatch):
    """Any model built from weights or a config fails the test: every case must end before."""
    from transformers import PreTrainedModel

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(PreTrainedModel, "_from_config", classmethod(refuse))


def _error(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("error")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("case,command,sentence", CASES + GRPO_CASES,
                         ids=[c[0] for c in CASES] + [c.values[0] for c in GRPO_CASES])
def test_bad_input_sentence(a, tmp_path, capsys, monkeypatch, case, command, sentence):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    no_model_loads(monkeypatch)
    values = {k: str(v) for k, v in a.items()} | {"run": str(run_dir(tmp_path)), "out": str(tmp_path / "out")}
    argv = [part.format(**values) for part in command.split()]
    assert cli.main(argv) == 2
    assert _error(capsys) == "error: " + sentence.format(**values)
    assert not (tmp_path / "out").exists()  # nothing written
    assert (tmp_path / "previous-run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing deleted


def test_read_only_output_dir(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the check see what another user would
        real = os.access
        monkeypatch.setattr(checks.os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    no_model_loads(monkeypatch)
    assert cli.main(["dpo", "--output_dir", str(locked / "run")]) == 2
    assert _error(capsys) == (f"error: output_dir '{locked / 'run'}' cannot be created: {locked} is not writable; "
                              "choose a writable --output_dir")
    assert cli.main(["dpo", "--output_dir", str(locked)]) == 2
    assert _error(capsys) == f"error: output_dir '{locked}' is not writable; choose a writable --output_dir"


def test_make_session_checks_before_clearing(tmp_path):
    """The Python API: make_session resolves the placement before prepare_output_dir clears a run."""
    from posttrain.trainers.config import LoopConfig, make_session

    out = run_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"^unknown mix 'zero2-zero4' \(did you mean zero2-zero3\?\)"):
        make_session(LoopConfig(output_dir=str(out), overwrite_output_dir=True, mix="zero2-zero4"), ["policy"], [])
    with pytest.raises(ConfigError, match=r"config given for unknown role\(s\) \['critic'\]"):
        make_session(LoopConfig(output_dir=str(out), overwrite_output_dir=True,
                                 role_configs={"critic": "zero3_inference"}), ["policy"], ["reference"])
    assert (out / "metrics.jsonl").exists()


def test_negative_values_parse_for_every_flag():
    from trl import ScriptArguments

    from posttrain.scripts.args import parse_config
    from posttrain.scripts.dpo import DataArguments
    from posttrain.trainers.dpo import DPOConfig
    from posttrain.trainers.ppo import PPOConfig

    _, _, cfg = parse_config((ScriptArguments, DataArguments, DPOConfig), None,
                             ["--max_steps", "-1", "--max_grad_norm", "0", "--ld_alpha", "-0.5"])
    assert (cfg.max_steps, cfg.ld_alpha) == (-1, -0.5)
    (ppo,) = parse_config(PPOConfig, None, ["--reward_weights", "-1e-1", "2", "--output_dir", "x"])
    assert ppo.reward_weights == [-0.1, 2.0]


@pytest.mark.parametrize("argv,sentence", [
    (["--shape", "7B"], f"--shape '7B' is not a preset: choose one of {PRESETS} (any case), or give a model folder "
                        "or hub id"),
    (["--shape", "./nowhere"], "--shape './nowhere' does not exist: it is neither a local directory nor a hub id "
                               f"(owner/name); check the path, or choose a preset: {PRESETS}"),
    (["--mix", "zero9"], "unknown mix 'zero9': choose one of " + MIXES + ", trl-zero2, trl-zero3, or all"),
    (["--role-shape", "critic=1b"], "--role-shape 'critic=1b': expected ROLE=SHAPE with ROLE one of policy, reference"),
    (["--world-size", "0"], "--world-size must be 1 or more, got 0"),
])
def test_plan_bad_input(capsys, argv, sentence):
    assert cli.main(["plan", *argv]) == 2
    assert _error(capsys) == "error: " + sentence


def test_plan_preset_in_any_case(capsys):
    assert cli.main(["plan", "--shape", "1B", "--workload", "dpo", "--mix", "zero2-zero3"]) == 0
    assert "recommended: zero2-zero3" in capsys.readouterr().out


def test_check_conversation_for_prompt_rows():
    """GRPO/PPO prompts (rows with only a "prompt") go through the same check as DPO's pairs."""
    tok = tiny.load_tokenizer()
    preference.check_conversation([{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": "text"}],
                                  ("prompt",), tok, "prompts")
    with pytest.raises(ConfigError, match=r"^prompts: row 0, 'prompt', message 1 has the unknown role 'human'"):
        preference.check_conversation([{"prompt": [{"role": "user", "content": "hi"}, {"role": "human", "content": "x"}]}],
                                      ("prompt",), tok, "prompts")
    tok.chat_template = None
    with pytest.raises(ConfigError, match=r"^prompts is conversational \(lists of messages\) but the tokenizer"):
        preference.check_conversation([{"prompt": [{"role": "user", "content": "hi"}]}], ("prompt",), tok, "prompts")
    preference.check_conversation([{"prompt": "plain text needs no template"}], ("prompt",), tok, "prompts")


def test_whole_model_folders_pass():
    checks.check_model_path(tiny.sft_model_path())
    checks.check_safetensors(tiny.sft_model_path() / "model.safetensors")
    checks.check_model_path("Qwen/Qwen2.5-0.5B")  # a hub id is left to the hub


def test_two_ranks_one_sentence(a, tmp_path):
    """Two ranks, one torchrun run (tests/dist/bad_input.py): every case fails on both ranks with the
    same sentence and nothing loaded; the last, through the script's own exit, is printed once, at
    the end of the launcher's failure block, and the run it would have overwritten is intact."""
    run = run_dir(tmp_path)
    out = tmp_path / "ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "bad_input.py"), str(out), str(run), str(a["sft"]), str(a["no_config"])]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    combined = proc.stdout + proc.stderr
    assert proc.returncode != 0, combined
    ranks = [json.loads((tmp_path / f"ranks.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 3, ranks
    assert ranks[0][0] == "learning_rate must be >= 0, got -0.001: set --learning_rate to 0 or more"
    assert ranks[0][1].startswith(f"--model_name_or_path '{a['no_config']}' has no config.json")
    assert ranks[0][2] == NO_DATA
    last = f"error: unknown mix 'zero2-zero4' (did you mean zero2-zero3?): choose one of {MIXES}"
    assert combined.count(last) == 1, combined
    assert "error (rank 1)" not in combined, combined
    assert not [line for line in combined.splitlines() if "/posttrain/" in line and 'File "' in line], combined
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_hub_dataset_not_found(monkeypatch):
    """A well-formed hub name is asked for; that it is not there is one sentence, not a traceback."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def missing(name, *a, **k):
        raise DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(ConfigError, match=r"^dataset 'my-org/prefs' could not be loaded \(Dataset 'my-org/prefs' "
                                          r"doesn't exist on the Hub or cannot be accessed.\): check the name, or give "
                                          r"a local json/jsonl/parquet/csv file$"):
        preference.load_dataset_source("my-org/prefs")
