"""The policy's decoder layers compiled for training (``compile_layers``, trainers/compiled_layers.py):
GRPO trains to the same numbers with them as without (aot_eager on CPU: bit-equal to eager), the
metric says how many layers ran compiled, settings where it cannot run are refused in one sentence
before anything loads, and a recompile past dynamo's limit raises instead of running eagerly."""

import pytest
import torch
from test_rollout_shared_prompt import small_grpo, trained_rows

from posttrain.errors import ConfigError
from posttrain.models import compiled_layers


def test_grpo_trains_the_same_with_compiled_layers(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    runs, layers = {}, {}
    for on in (None, True):  # None: off on a CPU
        trainer = small_grpo(tmp_path / str(on), compile_layers=on)
        layers[on] = compiled_layers.decoder_layers(trainer.session.engines["policy"].module)
        runs[on] = trained_rows(trainer)
    assert all(row["train/compiled_layers"] == 0.0 for row in runs[None])
    assert all(row["train/compiled_layers"] == len(layers[True]) == 2 for row in runs[True])
    assert all(layer._compiled_call_impl is None for layer in layers[None])
    assert all(layer._compiled_call_impl is not None for layer in layers[True])
    for a, b in zip(runs[None], runs[True], strict=True):
        for k in ("reward", "kl", "loss", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k


@pytest.mark.parametrize("fields, sentence", [
    ({"compile_layers": "yes"}, "compile_layers must be true, false or null (on a GPU where it applies); got 'yes'"),
    ({"compile_layers": True, "generation_backend": "hf"},
     "compile_layers=True does not go with generation_backend 'hf' (transformers' generate calls the layers at "
     "every length): set compile_layers to false (or leave it unset: it is on where it applies)"),
    ({"compile_layers": True, "peft_config": "lora"},
     "compile_layers=True does not go with LoRA adapters: set compile_layers to false (or leave it unset: it is on "
     "where it applies)"),
    ({"compile_layers": True, "mix": "zero3"},
     "compile_layers=True does not go with a ZeRO-3 policy (its parameters are gathered by hooks inside the layers' "
     "calls): set compile_layers to false (or leave it unset: it is on where it applies)"),
])
def test_where_compiled_layers_cannot_run(tmp_path, monkeypatch, fields, sentence):
    from peft import LoraConfig

    loaded = []
    monkeypatch.setattr("posttrain.placement.session.Session.load", lambda *a, **k: loaded.append(a) or 1 / 0)
    if fields.get("peft_config"):
        fields = {**fields, "peft_config": LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear")}
    with pytest.raises(ConfigError) as err:
        small_grpo(tmp_path, **fields)
    assert str(err.value) == sentence
    assert not loaded


def test_a_recompile_past_the_limit_raises():
    """Outside the guard dynamo would run the function eagerly from its limit on (one warning); in
    it the error names the setting that trains the layers eagerly."""
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        with compiled_layers.no_eager_fallback():
            double(torch.ones(2))
        with pytest.raises(RuntimeError, match="set compile_layers: false to train them eagerly") as err:
            with compiled_layers.no_eager_fallback():
                double(torch.ones(3))
    assert isinstance(err.value.__cause__, torch._dynamo.exc.FailOnRecompileLimitHit)


def test_a_model_without_one_list_of_layers():
    """Unset, such a model trains eagerly (the metric says 0 layers); asked for, one sentence."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert compiled_layers.compile_layers(model, required=False) == 0
    with pytest.raises(ConfigError, match="^Sequential: compile_layers needs one list of identical decoder layers"):
        compiled_layers.compile_layers(model)
