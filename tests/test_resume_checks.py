"""Resuming a checkpoint, checked before any weights load (another trainer's, another model's, LoRA or not,
a corrupt file, another process count), and a full disk while saving one: each one sentence naming the fix.
Checkpoints are written by save_checkpoint through a stub session (torch.save'd state files, no training)."""

import errno
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, LlamaConfig

from posttrain.errors import ConfigError
from posttrain.run import output_dir
from posttrain.run.output_dir import SAVED_BY_FILE, check_resume, plan_output_dir, save_checkpoint


@dataclass
class SFTSettings:
    """A trainer config's output-dir fields (output_dir.OutputDirSettings)."""

    output_dir: str
    overwrite_output_dir: bool = False
    resume_from_checkpoint: str | None = None
    save_total_limit: int | None = None


class DPOSettings(SFTSettings):
    """Another trainer's config class."""


def llama(hidden: int = 16) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=64)


class StubSession:
    """What save_checkpoint asks of a Session: a policy exported as save_pretrained writes it (an adapter
    with LoRA), and a DeepSpeed-like state (per-rank RNG and ZeRO optimizer partitions, torch.save'd)."""

    is_main_process = True

    def __init__(self, config, processes: int = 1, peft: bool = False) -> None:
        self.num_processes, self.peft, self.fail = processes, peft, None
        self.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
        self.wait_for_everyone = self.accelerator.wait_for_everyone
        base = SimpleNamespace(config=config)
        self.model = SimpleNamespace(peft_config={}, get_base_model=lambda: base) if peft else base

    def unwrap(self, name):
        return self.model

    def save_pretrained(self, name, directory, tokenizer=None):
        if self.fail is not None:
            raise self.fail
        directory.mkdir(parents=True)
        if self.peft:
            (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        else:
            self.model.config.save_pretrained(directory)
        weights = "adapter_model.safetensors" if self.peft else "model.safetensors"
        save_file({"w": torch.zeros(256)}, directory / weights)

    def save_state(self, directory, extra=None):
        tag = directory / "policy" / "pytorch_model"
        tag.mkdir(parents=True)
        (directory / "policy" / "latest").write_text("pytorch_model")
        for rank in range(self.num_processes):
            torch.save({"rank": rank}, directory / "policy" / f"random_states_{rank}.pkl")
            torch.save({"exp_avg": torch.ones(64)}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        (directory / "trainer_state.json").write_text(json.dumps(extra))


def save(out: Path, step: int, session: StubSession, trainer: str | None = "sft", settings=SFTSettings,
         **fields) -> Path:
    cfg = settings(output_dir=str(out), **fields)
    return save_checkpoint(session, cfg, step, {"policy": None}, {"total_steps": 10}, trainer=trainer)


def latest(out: Path, settings=SFTSettings) -> SFTSettings:
    return settings(output_dir=str(out), resume_from_checkpoint="latest")


def test_a_checkpoint_records_who_saved_it_and_resumes(tmp_path):
    out = tmp_path / "run"
    ckpt = save(out, 3, StubSession(llama()))
    saved = json.loads((ckpt / "state" / SAVED_BY_FILE).read_text())
    assert saved == {"trainer": "sft", "config": "SFTSettings", "models": {"policy": {
        "peft": False, "name_or_path": None, "arch": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2,
                                                      "num_attention_heads": 2, "num_key_value_heads": 1,
                                                      "intermediate_size": 32, "vocab_size": 64}}}}
    assert json.loads((ckpt / "state" / "trainer_state.json").read_text()) == {"step": 3, "total_steps": 10}
    assert check_resume(latest(out), "sft", llama(), uses_peft=False, num_processes=1) == ckpt
    assert check_resume(SFTSettings(output_dir=str(out)), "sft", llama()) is None  # no resume: nothing to check


def test_another_trainers_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    ckpt = save(out, 3, StubSession(llama()), trainer="dpo")
    with pytest.raises(ConfigError) as err:
        check_resume(latest(out), "sft", llama())
    assert str(err.value) == (
        f"checkpoint {ckpt} was saved by the dpo trainer and this run is sft (resuming would take its optimizer, "
        f"schedule and step): give a checkpoint of a sft run, or start a new run from its model with "
        f"--model_name_or_path {ckpt / 'policy'}")
    # A trainer that does not pass its name: the config class it recorded tells the trainers apart.
    other = tmp_path / "other"
    save(other, 2, StubSession(llama()), trainer=None, settings=DPOSettings)
    with pytest.raises(ConfigError, match=r"was saved by a run configured with DPOSettings and this run is sft \("):
        check_resume(latest(other), "sft", llama())
    assert check_resume(latest(other, DPOSettings), "dpo", llama()) == other / "checkpoint-2"


def test_another_architecture_is_refused(tmp_path):
    out = tmp_path / "run"
    ckpt = save(out, 3, StubSession(llama(16)))
    with pytest.raises(ConfigError) as err:
        check_resume(latest(out), "sft", llama(32))
    assert str(err.value) == (
        f"checkpoint {ckpt} was saved from another model than the one given (hidden_size 16 there, 32 here): give "
        "--model_name_or_path of the model that run started from to resume it, or a checkpoint of this model")
    # A checkpoint from before the record: its exported config.json (GPT-2's n_embd read as hidden_size), and
    # the run's settings name the model it started from.
    old = tmp_path / "old"
    ckpt = save(old, 2, StubSession(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)))
    (ckpt / "state" / SAVED_BY_FILE).unlink()
    (old / "posttrain_config.json").write_text(json.dumps({"model_name_or_path": "runs/gpt2-tiny"}))
    with pytest.raises(ConfigError, match=r"\(hidden_size 32 there, 64 here\): give --model_name_or_path "
                                          r"runs/gpt2-tiny to resume it"):
        check_resume(latest(old), "sft", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2,
                                          "vocab_size": 64})
    assert check_resume(latest(old), "sft", GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)) == ckpt


def test_lora_and_full_checkpoints_are_not_mixed(tmp_path):
    full, lora = tmp_path / "full", tmp_path / "lora"
    full_ckpt = save(full, 2, StubSession(llama()))
    lora_ckpt = save(lora, 2, StubSession(llama(), peft=True))
    with pytest.raises(ConfigError) as err:
        check_resume(latest(full), "sft", llama(), uses_peft=True)
    assert str(err.value) == (
        f"checkpoint {full_ckpt} trained the whole model and this run trains LoRA adapters (use_peft): drop "
        f"--use_peft to resume it, or start a new LoRA run from its model with --model_name_or_path "
        f"{full_ckpt / 'policy'}")
    with pytest.raises(ConfigError, match=r"trained LoRA adapters \(use_peft\) and this run trains the whole model: "
                                          r"add --use_peft true with the LoRA settings it was saved with"):
        check_resume(latest(lora), "sft", llama(), uses_peft=False)
    (lora_ckpt / "state" / SAVED_BY_FILE).unlink()  # an older checkpoint: its adapter folder says LoRA
    with pytest.raises(ConfigError, match="trained LoRA adapters"):
        check_resume(latest(lora), "sft", llama(), uses_peft=False)
    assert check_resume(latest(lora), "sft", llama(), uses_peft=True) == lora_ckpt


def test_a_corrupt_latest_checkpoint_names_the_one_before(tmp_path):
    out = tmp_path / "run"
    first = save(out, 2, StubSession(llama()))
    second = save(out, 4, StubSession(llama()))
    optim = second / "state" / "policy" / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:300])  # a copy or a disk that stopped midway
    before = sorted(p.name for p in out.iterdir())
    for check in (lambda: check_resume(latest(out), "sft", llama()), lambda: plan_output_dir(latest(out))):
        with pytest.raises(ConfigError) as err:
            check()
        assert str(err.value) == (
            f"checkpoint {second} is corrupt (state/policy/pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt is "
            f"truncated): resume from the one before with --resume_from_checkpoint {first}")
    assert sorted(p.name for p in out.iterdir()) == before  # nothing removed or locked
    assert check_resume(SFTSettings(output_dir=str(out), resume_from_checkpoint=str(first)), "sft", llama()) == first
    weights = first / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint-2 is corrupt \(policy/model.safetensors is "
                                          r"truncated or corrupt .*\): there is no earlier checkpoint: copy it again"):
        check_resume(SFTSettings(output_dir=str(out), resume_from_checkpoint=str(first)), "sft", llama())
    (second / "state" / "trainer_state.json").write_text('{"step": 4, "tot')
    with pytest.raises(ConfigError, match=r"\(state/trainer_state.json is not readable JSON\)"):
        check_resume(latest(out), "sft", llama())


def test_another_process_count_is_refused_with_what_works(tmp_path, monkeypatch):
    out = tmp_path / "run"
    ckpt = save(out, 2, StubSession(llama(), processes=2))
    with pytest.raises(ConfigError) as err:
        check_resume(latest(out), "sft", llama(), num_processes=1)
    assert str(err.value) == (
        f"checkpoint {ckpt} was saved by 2 processes and this run has 1 (DeepSpeed split its optimizer state 2 ways "
        "and cannot split it again): resume it on 2 (torchrun --nproc_per_node 2, or accelerate launch "
        f"--num_processes 2), or start a new run from its model with --model_name_or_path {ckpt / 'policy'}")
    monkeypatch.setenv("WORLD_SIZE", "1")  # the launcher's world, read before any process group exists
    with pytest.raises(ConfigError, match="was saved by 2 processes and this run has 1"):
        plan_output_dir(latest(out))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert check_resume(latest(out), "sft", llama()) == ckpt


def test_a_full_disk_while_saving_is_one_sentence_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    session = StubSession(llama())
    first = save(out, 2, session, save_total_limit=1)
    kept = sorted(str(p.relative_to(first)) for p in first.rglob("*"))
    session.fail = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(output_dir, "_free_bytes", lambda folder: 3 * 2**20)
    with pytest.raises(ConfigError) as err:
        save(out, 4, session, save_total_limit=1)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file()) / 2**10
    assert str(err.value) == (
        f"the disk of {out} is full: checkpoint-4 could not be saved (it needs about {size:.1f} KB, as much as "
        "checkpoint-2; 3.0 MB free): free space there, lower --save_total_limit (now 1; a save needs room for one "
        "more), or choose an --output_dir on a larger disk; checkpoint-2 is whole, resume from it with "
        "--resume_from_checkpoint latest")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # the half-written folder is gone
    assert sorted(str(p.relative_to(first)) for p in first.rglob("*")) == kept
    # torch's zip writer fails without an errno: a full disk shows in the free space; else the error is its own.
    session.fail = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    with pytest.raises(ConfigError, match="the disk of .* is full: checkpoint-4 could not be saved"):
        save(out, 4, session)
    monkeypatch.setattr(output_dir, "_free_bytes", lambda folder: 50 * 2**30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        save(out, 4, session)
