"""The tiny default ships prebuilt in posttrain/demo/data/tiny: its paths resolve there without building,
the shipped files are what their recipes make, and any other variant builds into the cache.

The full rebuild takes minutes on two cores, so CI replays the first steps of each recipe against
the losses recorded at build time and checks the shipped weights against the recorded final loss;
`python -m posttrain.demo.recipes /tmp/tiny && diff -r /tmp/tiny posttrain/demo/data/tiny` is the full check.
"""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.demo import recipes, tiny

REPLAYED = 8  # steps of each recipe compared with the recorded losses
SHIPPED = {"sft-s0-n300": (recipes.sft_recipe, AutoModelForCausalLM),
           "reward-trained-s0-n200": (recipes.reward_recipe, AutoModelForSequenceClassification)}


def test_defaults_resolve_to_the_shipped_assets_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    assert tiny.tokenizer_path() == tiny.ASSETS / "tokenizer"
    assert tiny.sft_model_path() == tiny.ASSETS / "sft-s0-n300"
    assert tiny.reward_model_path() == tiny.ASSETS / "reward-trained-s0-n200"
    assert not (tmp_path / "cache").exists()
    size = sum(p.stat().st_size for p in tiny.ASSETS.rglob("*") if p.is_file())
    assert size < 3 * 2**20, f"the shipped tiny assets grew to {size / 2**20:.1f} MiB"


def test_shipped_tokenizer_is_what_the_recipe_builds(tmp_path):
    tiny._build_tokenizer(tmp_path / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        built = (tmp_path / "tokenizer" / name).read_text()
        assert built == (tiny.ASSETS / "tokenizer" / name).read_text(), name
        if name != "tokenizer_config.json":  # re-saved beside each model with loading keys added
            for asset in SHIPPED:  # each model folder carries the same tokenizer
                assert built == (tiny.ASSETS / asset / name).read_text(), (asset, name)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_model_is_what_its_recipe_trains(name, tmp_path):
    recipe_fn, cls = SHIPPED[name]
    shipped = tiny.ASSETS / name
    recorded = json.loads((shipped / "train_losses.json").read_text())
    trainer = recipe_fn(tiny.ASSETS / "tokenizer", tmp_path)  # posttrain's own trainer, one process
    assert len(recorded["losses"]) == trainer.total_steps
    # Same initial weights, data, order, optimizer and schedule: the same first losses.
    assert recipes.replay(trainer, REPLAYED) == pytest.approx(recorded["losses"][:REPLAYED], rel=1e-5)
    # The shipped weights are that run's result, and it learned.
    assert recipes.final_loss(cls.from_pretrained(shipped), trainer) == pytest.approx(recorded["final_first_batch"],
                                                                                   rel=1e-5)
    assert recorded["final_first_batch"] < 0.5 * recorded["losses"][0]


def test_other_variants_build_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    path = tiny.sft_model_path(steps=2)
    assert path == tmp_path / "sft-s0-n2"
    assert "building the tiny SFT policy (2 steps" in capsys.readouterr().err
    assert len(json.loads((path / "train_losses.json").read_text())["losses"]) == 2
    assert tiny.sft_model_path(steps=2) == path
    assert "building" not in capsys.readouterr().err  # built once
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tiny.load_tokenizer(path))
