"""The decode step's switches: each an engine option, else its POSTTRAIN_ROLLOUT_* environment
variable (for A/B runs), else its default; and which decode attention runs (posttrain's Triton
kernels, flex_attention, SDPA, or bmm and softmax) for a model on a device."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from posttrain.errors import ConfigError
from posttrain.rollout.decoder import DecoderSpec


def env_choice(name: str, value: bool | None) -> bool | None:
    """An engine option, else its environment variable ("0" or "1"), else None (unset)."""
    if value is not None:
        return bool(value)
    raw = os.environ.get(name)
    if raw is None:
        return None
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}={raw!r}: use 0 or 1")
    return raw == "1"


def env_flag(name: str, value: bool | None, default: bool) -> bool:
    """:func:`env_choice`, ``default`` where neither is set."""
    choice = env_choice(name, value)
    return default if choice is None else choice


@contextlib.contextmanager
def preferred_blas(name: str | None) -> Iterator[None]:
    """torch's preferred BLAS library ``name`` ("cublaslt") for the GEMMs run inside, the previous
    one after (None: as it is). The engine's compile, warm-up and capture run inside it: a captured
    graph keeps the kernels chosen then, so the rest of the process (training) keeps its own."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


ATTENTION_NAMES = {"triton_decode": "the Triton decode kernels", "flex_decode": "flex_attention",
                   "sdpa_decode": "SDPA decode attention"}


def require_triton(device: torch.device) -> None:
    """Import the Triton kernel (which registers its op), or say what is missing."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError(f"triton_decode runs on CUDA, not {device.type}: unset POSTTRAIN_ROLLOUT_TRITON (or set "
                          "TRITON_INTERPRET=1 to run the kernel in Triton's interpreter)")
    try:
        from posttrain.rollout.kernels import (
            decode_attention as triton_decode,  # noqa: F401
        )
        from posttrain.rollout.kernels import (
            pointwise as triton_pointwise,  # noqa: F401
        )
        from posttrain.rollout.kernels import (
            sample as triton_sample,  # noqa: F401
        )
    except ImportError as err:
        raise ConfigError(f"triton_decode needs Triton ({err}): install the triton that matches your torch, or "
                          "unset POSTTRAIN_ROLLOUT_TRITON") from err


def triton_by_default(device: torch.device, spec: DecoderSpec) -> bool:
    """The Triton decode kernels are the default on CUDA where Triton imports and the head size is
    one the kernels take (a power of two, 16 to 256): 1.23x (16 rows) to 1.46x (128 rows x 768
    columns) faster steps than SDPA's cudnn kernel on an H200, log-probs as close to a forward's
    (NOTES 24, 25)."""
    d = spec.head_dim
    if device.type != "cuda" or d & (d - 1) or not 16 <= d <= 256:
        return False
    try:
        from posttrain.rollout.kernels import decode_attention as triton_decode  # noqa: F401
    except ImportError:
        return False
    return True


def attention_spec(spec: DecoderSpec, device: torch.device, fp32_scores: bool | None, sdpa_decode: bool | None,
                   flex_decode: bool | None, triton_decode: bool | None) -> DecoderSpec:
    """``spec`` with its attention switches resolved: float32 scores and SDPA on unless turned off,
    flex_attention off unless on, the Triton kernels where :func:`triton_by_default` says unless
    chosen either way (on by choice: Triton must be there; the step's pointwise kernels with them,
    unless ``triton_pointwise.ENABLED`` is off)."""
    if not env_flag("POSTTRAIN_ROLLOUT_SCORES_FP32", fp32_scores, True):
        spec = dataclasses.replace(spec, fp32_scores=False)
    spec = dataclasses.replace(spec, sdpa_decode=env_flag("POSTTRAIN_ROLLOUT_SDPA", sdpa_decode, True),
                               flex_decode=env_flag("POSTTRAIN_ROLLOUT_FLEX", flex_decode, False))
    choice = env_choice("POSTTRAIN_ROLLOUT_TRITON", triton_decode)
    if choice or (choice is None and triton_by_default(device, spec)):
        require_triton(device)
        from posttrain.rollout.kernels import pointwise as triton_pointwise

        spec = dataclasses.replace(spec, triton_decode=True, triton_pointwise=triton_pointwise.ENABLED)
    return spec
