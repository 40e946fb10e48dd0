"""The harness's correctness canary: a frozen role's outputs through its placement against the same
weights run unsharded.

A sharded placement that gathers wrong values runs at full speed and silently corrupts rewards and
KL (issue 15: DeepSpeed's leaf-module gathering, 2-6 nats off at 4 GPUs). So every harness run
checks each frozen role once: the role's weights are gathered one unit at a time (a decoder layer,
the embeddings, the head) by a plain synchronous path (DeepSpeed's ``GatheredParameters``, or a
fast frozen model's own per-group gather) into a copy of the model in host memory, with the same
buffers; that copy then runs the same rows on the device one unit at a time, and its outputs are
compared with the engine's. The device never holds more than one unit of the copy, so the check
fits wherever the run fits (an 8B copy is 16 GB of host memory per rank, freed afterwards).

Compared: next-token log-probs (fp32 log-softmax of the logits) for causal LMs, the score for
sequence classifiers.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
from torch import nn

from posttrain.placement.frozen import _units

# Above this max abs difference (nats, or score units) a placement's outputs are "wrong".
# bf16: the copy and the engine run the same modules on the same rows, so they normally agree
# bit for bit (posttrain's fast path and DeepSpeed's defaults did at 1.1B and 3B on 2 and 4 H200s);
# what can legitimately differ is a kernel choice, which moves a logit by an ulp or two: 0.0625 at
# |logit| in [8, 16). 0.1 nats allows that and still catches the smallest wrong output measured
# (0.19 nats, 1.1B at 4 GPUs with stage3_module_granularity_threshold; 3B was off by 2.2-6.4).
# fp32 (CPU runs): rounding is about 1e-6; 1e-3 leaves room for reduction order.
TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.1, torch.float32: 1e-3}


@contextlib.contextmanager
def _without_hf_zero3():
    """transformers' global DeepSpeed config off: a wrapper model (a sequence classifier) builds
    its backbone with ``from_config``, which under the active plugin's ZeRO-3 would partition it."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def _gathered(unit_params: list[nn.Parameter], fast_unit: Any) -> contextlib.AbstractContextManager:
    """Whole values of one unit's parameters for the duration (collective under ZeRO-3)."""
    if fast_unit is not None:
        @contextlib.contextmanager
        def acquire():
            for group in fast_unit.groups:
                group.acquire()
            try:
                yield
            finally:
                for group in fast_unit.groups:
                    group.release()
        return acquire()
    if any(hasattr(p, "ds_id") for p in unit_params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(unit_params, modifier_rank=None)
    return contextlib.nullcontext()  # replicated: already whole


class HostCopy:
    """An unsharded copy of a (possibly sharded) model: parameters in host memory, moved to the
    device one unit at a time while it runs; buffers (rotary frequencies, ...) on the device, taken
    from the model as they are. Building it is collective: every rank must build it."""

    def __init__(self, model: nn.Module, device: torch.device, fast: Any = None) -> None:
        self.device = device
        with torch.device("meta"), _without_hf_zero3():
            self.model = type(model)(model.config).eval()
        sharded_units = _units(model)
        fast_units = fast.units if fast is not None else [None] * len(sharded_units)
        if fast is not None and len(fast.units) != len(sharded_units):
            raise RuntimeError("the fast frozen model's units do not match the model's")
        host: dict[int, nn.Parameter] = {}  # by the sharded parameter's id: tied weights copied once
        self.units: list[tuple[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]]] = []
        for (module, params, _), (plain, _, _), fast_unit in zip(sharded_units, _units(self.model), fast_units):
            # The (owner, name) pairs of the unit's parameters, in both models (same structure).
            slots = [(sub, name) for sub in module.modules() for name, p in sub._parameters.items()
                     if p is not None and any(p is q for q in params)]
            plain_of = dict(zip(module.modules(), plain.modules()))
            entries = []
            with _gathered(params, fast_unit), torch.no_grad():
                for sub, name in slots:
                    p = sub._parameters[name]
                    if id(p) not in host:
                        host[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False)
                    owner = plain_of[sub]
                    owner._parameters[name] = host[id(p)]
                    entries.append((owner, name, host[id(p)]))
            self.units.append((plain, entries))
        # Buffers as the model has them (posttrain recomputes rotary ones in fp32; TRL's ZeRO-3
        # path keeps zero.Init's bf16 ones): the check is about gathering, not about them.
        plain_modules = dict(self.model.named_modules())
        for name, sub in model.named_modules():
            for bname, buf in sub._buffers.items():
                if buf is not None:
                    plain_modules[name]._buffers[bname] = buf.detach().to(self.device, copy=True)
        missing = [n for n, p in self.model.named_parameters(remove_duplicate=False) if p.is_meta]
        if missing:
            raise RuntimeError(f"canary: no unit holds {missing[:3]}; the model's layout is not supported")
        self._handles = []
        for plain, entries in self.units:
            self._handles.append(plain.register_forward_pre_hook(self._to_device(entries, device)))
            self._handles.append(plain.register_forward_hook(self._to_host(entries)))

    @staticmethod
    def _to_device(entries, device: torch.device):
        # No reference to the HostCopy in the hooks: dropping it frees the host memory at once.
        def hook(module: nn.Module, args: Any) -> None:
            for owner, name, p in entries:
                owner._parameters[name] = nn.Parameter(p.data.to(device), requires_grad=False)
        return hook

    @staticmethod
    def _to_host(entries):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for owner, name, p in entries:
                owner._parameters[name] = p
        return hook

    def __call__(self, **inputs: Any) -> Any:
        with torch.no_grad():
            return self.model(**inputs)


def outputs(model_out: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """What the canary compares: next-token log-probs (fp32) of a causal LM, else the scores."""
    logits = model_out.logits
    if logits.dim() == 3:  # row by row: one row's fp32 log-softmax at a time (8B: 0.26 GB at 512 tokens)
        return torch.stack([torch.log_softmax(row[:-1].float(), dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
                            for row, ids in zip(logits, input_ids)])
    return logits.float()


@torch.no_grad()
def check(engine: Any, input_ids: torch.Tensor, fast: Any = None, perturb: Any = None) -> float:
    """Max abs difference between ``engine``'s outputs on ``input_ids`` and an unsharded copy's.
    Collective. ``perturb``: a callable run after the copy is taken and before the engine runs
    (tests use it to change the weights the engine sees, as a wrong gather would)."""
    model = getattr(engine, "module", engine)
    copy = HostCopy(model, input_ids.device, fast)
    if perturb is not None:
        perturb()
    got = outputs(engine(input_ids=input_ids), input_ids)
    want = outputs(copy(input_ids=input_ids), input_ids)
    del copy
    gc.collect()  # the copy's host memory (16 GB for an 8B model in bf16) before the next role's
    return (got - want).abs().max().item()
