"""Every field of TRL 1.16's configs is accounted for in posttrain's (it works, or a value other than TRL's
default is refused in one sentence), and the README's table is the one the code generates."""

from pathlib import Path

import pytest

import posttrain
from posttrain.errors import ConfigError
from posttrain.trainers import trl_fields

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [name for name in posttrain._TRAINERS if name.endswith("Config")]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_trl_field_is_accounted_for(name):
    cls = getattr(posttrain, name)
    status = trl_fields.field_status(cls)
    assert [f for f, reason in status.items() if reason == "?"] == []
    # posttrain keeps TRL's name for each of TRL's fields: none is shadowed by a field of another meaning.
    assert set(status) <= {f.name for f in __import__("dataclasses").fields(cls)}


@pytest.mark.parametrize("name", ["SFTConfig"])
def test_a_refused_field_names_its_reason(name, tmp_path):
    cls = getattr(posttrain, name)
    with pytest.raises(ConfigError, match=r"^fsdp is 'full_shard', which posttrain does not support \(posttrain "
                                          r"places every model with its own DeepSpeed plugin"):
        cls(output_dir=str(tmp_path), fsdp="full_shard")
    with pytest.raises(ConfigError, match=r"^optim 'adafactor' is not supported: posttrain takes 'adamw_torch' or "
                                          r"'adamw_torch_fused'"):
        cls(output_dir=str(tmp_path), optim="adafactor")
    with pytest.raises(ConfigError, match=r"^model_init_kwargs 'dtype=bf16' is not a JSON dict"):
        cls(output_dir=str(tmp_path), model_init_kwargs="dtype=bf16")
    cfg = cls(output_dir=str(tmp_path), model_init_kwargs='{"dtype": "bfloat16"}', report_to="none",
              logging_steps=5.0, warmup_steps=0.1)
    assert cfg.model_init_kwargs == {"dtype": "bfloat16"} and cfg.report_to == [] and cfg.logging_steps == 5


def test_trl_parser_takes_posttrain_configs_beside_model_config():
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    for name in CONFIGS:
        cls = getattr(posttrain, name)
        if cls.trl_config().__module__.startswith("trl"):
            TrlParser((ScriptArguments, cls, ModelConfig, DatasetMixtureConfig))  # no conflicting option


def test_readme_table_is_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    table = readme.split(trl_fields.README_START, 1)[1].split(trl_fields.README_END, 1)[0].strip()
    assert table == trl_fields.readme_table(), "run: python -m posttrain.trainers.trl_fields README.md"


def test_a_yaml_with_a_tab_is_one_sentence(tmp_path):
    from trl import ModelConfig

    from posttrain.scripts.args import parse_config

    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-3\n\tmax_steps: 3\n")
    with pytest.raises(ConfigError, match=r"run.yaml is not valid YAML \(line 2, column 1\): found character '\\t' "
                                          r"that cannot start any token; indent with spaces, not tabs$"):
        parse_config((posttrain.SFTConfig, ModelConfig), None, ["--config", str(config)])


def test_lr_scheduler_kwargs_schedule_as_transformers_trainer(tmp_path):
    """``lr_scheduler_kwargs`` (open-r1's ``cosine_with_min_lr`` with ``min_lr_rate``) gives the learning rates
    transformers' Trainer (TRL's) gives for the same settings, step by step."""
    import torch
    from transformers import Trainer, TrainingArguments

    from posttrain.models.setup import optimizer_and_scheduler
    from posttrain.trainers.grpo import GRPOConfig

    settings = dict(learning_rate=1e-3, lr_scheduler_type="cosine_with_min_lr", warmup_steps=0.2,
                    lr_scheduler_kwargs={"min_lr_rate": 0.1})
    cfg = GRPOConfig(per_device_train_batch_size=8, num_generations=4, **settings)
    model = torch.nn.Linear(2, 2)
    opt, ours = optimizer_and_scheduler(model, cfg, total_steps=10)
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                          report_to=[], **settings))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    theirs = trainer.lr_scheduler
    got, want = [], []
    for _ in range(10):
        got.append(ours.get_last_lr()[0])
        want.append(theirs.get_last_lr()[0])
        opt.step(), ours.step(), trainer.optimizer.step(), theirs.step()
    assert got == pytest.approx(want, rel=1e-12) and got[1] > got[0]  # warm-up, then the decay
    assert ours.get_last_lr()[0] == pytest.approx(1e-4)  # the end of the run: min_lr_rate x learning_rate


def test_gradient_checkpointing_kwargs_as_trl(caplog):
    """``gradient_checkpointing_kwargs`` (open-r1's ``{"use_reentrant": false}``) reach torch's checkpoint as TRL
    hands them to transformers: non-reentrant unless set, reentrant for adapters under ZeRO-3 (said once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.demo import tiny
    from posttrain.models.setup import checkpointing_kwargs, enable_gradient_checkpointing
    from posttrain.trainers.grpo import GRPOConfig

    def cfg(kwargs):
        return GRPOConfig(per_device_train_batch_size=8, num_generations=4, gradient_checkpointing_kwargs=kwargs)

    assert checkpointing_kwargs(cfg(None), zero3_lora=False) == {"use_reentrant": False}
    assert checkpointing_kwargs(cfg({"use_reentrant": True}), zero3_lora=False) == {"use_reentrant": True}
    assert checkpointing_kwargs(cfg({"preserve_rng_state": False}), zero3_lora=False) == {
        "preserve_rng_state": False, "use_reentrant": False}
    with caplog.at_level("WARNING"):
        assert checkpointing_kwargs(cfg({"use_reentrant": False}), zero3_lora=True) == {"use_reentrant": True}
    assert "need reentrant checkpointing" in caplog.text
    # What the model's layers are given: the layers' checkpoint function carries the kwargs.
    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32).train()
    enable_gradient_checkpointing(model, **checkpointing_kwargs(cfg({"preserve_rng_state": False}), False))
    fn = model.model.layers[0]._gradient_checkpointing_func
    assert fn.keywords == {"preserve_rng_state": False, "use_reentrant": False}
