"""ZeRO-3 leaf modules by size (stage3_module_granularity_threshold) are refused on a GPU, where
DeepSpeed 0.19 releases their gathered parameters while kernels may still read them."""

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.placement import dsconfig


def _resolve(cfg: dict) -> dict:
    return dsconfig.resolve(cfg, role="reference", trains=False, micro_batch_size=1, gradient_accumulation_steps=1,
                            world_size=2, mixed_precision="bf16")


LEAF = {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": int(1e8)}}


def test_refused_on_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="remove the key"):
        _resolve(LEAF)
    _resolve({"zero_optimization": {"stage": 3}})  # DeepSpeed's default (0) is fine
    _resolve({"zero_optimization": {"stage": 2, "stage3_module_granularity_threshold": int(1e8)}})  # ignored below 3


def test_allowed_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve(LEAF)["zero_optimization"]["stage3_module_granularity_threshold"] == int(1e8)


def test_no_shipped_preset_sets_it():
    for path in dsconfig.CONFIG_DIR.glob("*.json"):
        zero = dsconfig.read_config(str(path)).get("zero_optimization", {})
        assert not zero.get("stage3_module_granularity_threshold"), path.name
