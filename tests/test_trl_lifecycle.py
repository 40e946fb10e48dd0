"""A trainer's life as TRL's: callbacks at TRL's points (one can stop the run), ``state.log_history``,
``TrainOutput``, ``accelerator``, and ``end()`` leaving the process as it found it (no ZeRO-3 mode)."""

from transformers import TrainerCallback

from posttrain import SFTConfig, SFTTrainer
from posttrain.demo import tiny


class Recorder(TrainerCallback):
    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[str] = []
        self.logs: list[dict] = []
        self.stop_at = stop_at

    def on_init_end(self, args, state, control, **kw):
        self.events.append("init_end")

    def on_train_begin(self, args, state, control, **kw):
        self.events.append("train_begin")

    def on_step_end(self, args, state, control, **kw):
        self.events.append(f"step_end {state.global_step}")
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kw):
        self.events.append(f"save {state.global_step}")

    def on_train_end(self, args, state, control, **kw):
        self.events.append("train_end")


def test_callbacks_state_and_end(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    rows = [{"text": line} for line in tiny.corpus()[:32]]
    recorder = Recorder(stop_at=3)
    args = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=6, logging_steps=1,
                     save_steps=2, disable_tqdm=True, role_configs={"policy": "zero3_train"}, max_length=32)
    trainer = SFTTrainer(str(tiny.model_path()), args=args, train_dataset=rows, callbacks=[recorder])
    assert trainer.accelerator is trainer.session.accelerator and trainer.args is args
    out = trainer.train()
    # The callback stopped the run after step 3, which is logged and checkpointed as a last step.
    assert recorder.events == ["init_end", "train_begin", "step_end 1", "step_end 2", "save 2", "step_end 3", "save 3",
                               "train_end"]
    assert out.global_step == trainer.state.global_step == 3
    assert [r["loss"] for r in trainer.state.log_history if "loss" in r] == [r["loss"] for r in recorder.logs]
    assert out.training_loss == sum(r["loss"] for r in recorder.logs) / 3
    assert (tmp_path / "run" / "checkpoint-3").is_dir()
    trainer.save_model()
    assert is_deepspeed_zero3_enabled()  # ZeRO-3 role: transformers' ZeRO-3 mode is on while the trainer runs
    trainer.end()
    assert not is_deepspeed_zero3_enabled()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")  # whole, not ZeRO-3's empty placeholders
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size
    # A second run in the same process.
    again = SFTTrainer(model, args=SFTConfig(output_dir=str(tmp_path / "again"), per_device_train_batch_size=4,
                                             max_steps=1, disable_tqdm=True, max_length=32),
                       train_dataset=rows, processing_class=tiny.load_tokenizer())
    assert again.train().global_step == 1
    again.end()


def test_a_failed_overwrite_keeps_the_previous_run(tmp_path):
    """--overwrite_output_dir clears the previous run only once every model is loaded and prepared: a
    LoRA target no module matches fails first, and the old run's metrics and checkpoints are still there."""
    import pytest
    from peft import LoraConfig

    from posttrain.errors import ConfigError

    rows = [{"text": line} for line in tiny.corpus()[:8]]
    out = tmp_path / "run"
    common = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, save_steps=1, disable_tqdm=True,
                  max_length=32)
    first = SFTTrainer(str(tiny.model_path()), args=SFTConfig(**common), train_dataset=rows)
    first.train()
    first.end()
    kept = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="lora_target_modules|target_modules"):
        SFTTrainer(str(tiny.model_path()), args=SFTConfig(**common, overwrite_output_dir=True), train_dataset=rows,
                   peft_config=LoraConfig(target_modules=["q_projj"], task_type="CAUSAL_LM"))
    assert (out / "metrics.jsonl").read_text() == kept and (out / "checkpoint-1").is_dir()


def test_the_model_card_names_the_model_a_trainer_was_given(tmp_path):
    """The config names no model (TRL's configs do not): the card's base model is the path the trained model
    was loaded from; the settings it shows hide the hub token, as TrainingArguments.to_dict does."""
    rows = [{"text": line} for line in tiny.corpus()[:8]]
    path = tiny.model_path()
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, disable_tqdm=True,
                     max_length=32, hub_token="hf_secret")
    trainer = SFTTrainer(str(path), args=args, train_dataset=rows)
    trainer.train()
    trainer.end()
    card = (tmp_path / "README.md").read_text()
    assert f"fine-tuned version of `{path}`" in card and "hf_secret" not in card
    assert "hf_secret" not in (tmp_path / "posttrain_config.json").read_text()


def test_a_lora_runs_card_survives_the_adapter_save(tmp_path):
    """peft's save rewrites the README's tags from the model's tags: posttrain tags the model as TRL does, so
    the card written after the save is still recognised as its own and says what LoRA trained."""
    from peft import LoraConfig

    rows = [{"text": line} for line in tiny.corpus()[:8]]
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, disable_tqdm=True,
                     max_length=32)
    trainer = SFTTrainer(str(tiny.model_path()), args=args, train_dataset=rows,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(dataset_name="my-data")
    trainer.end()
    card = (tmp_path / "README.md").read_text()
    assert "LoRA (r 4, alpha 8, dropout 0.0, target modules ['q_proj'])" in card and "my-data" in card
