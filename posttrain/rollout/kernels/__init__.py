"""The decode step's Triton kernels (CUDA): decode attention, pointwise ops and the sampler."""

from __future__ import annotations

import torch


def unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why the decode step cannot run these kernels, or None (importing them registers the step's ops)."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head size {head_dim}: the Triton decode kernels take powers of two from 16 to 256"
    try:
        from posttrain.rollout.kernels import decode_attention, pointwise, sample  # noqa: F401
    except ImportError as err:
        return f"the Triton decode kernels need Triton ({err}): install the triton that matches your torch"
    # Triton decides at import whether its kernels are interpreted (TRITON_INTERPRET=1).
    if device.type != "cuda" and type(decode_attention._own).__name__ != "InterpretedFunction":
        return f"the Triton decode kernels run on CUDA, not {device.type} (outside Triton's interpreter)"
    return None
