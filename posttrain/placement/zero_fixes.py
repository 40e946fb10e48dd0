"""Corrections to DeepSpeed's ZeRO applied by the Session: fp32 rotary buffers after zero.Init,
shared bf16 master weights at one process, and gradients cast to the master dtype as they flatten."""

from __future__ import annotations

from typing import Any

import torch


def share_bf16_master(zero_optimizer: Any) -> bool:
    """World of one: ZeRO-1/2 bf16 master updates the model's own weights, not a clone; returns whether."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = zero_optimizer
    if (not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload
            or opt.master_weights_and_grads_dtype != torch.bfloat16 or opt.optimizer.state):
        return False
    if any(len(parts) != 1 for parts in opt.parallel_partitioned_bit16_groups):
        return False  # more than one rank holds a partition
    pairs = list(zip(opt.single_partition_of_fp32_groups, (parts[0] for parts in opt.parallel_partitioned_bit16_groups)))
    if any(m.shape != o.shape or m.dtype != o.dtype or not torch.equal(m, o) for m, o in pairs):
        return False
    for i, (group, (_, own)) in enumerate(zip(opt.optimizer.param_groups, pairs)):
        own.requires_grad = True  # as DeepSpeed marks its master partition
        opt.single_partition_of_fp32_groups[i] = own
        group["params"] = [own]
    opt._link_all_hp_params()  # the per-parameter views into the master partition
    return True


def cast_grads_while_flattening(zero_optimizer: Any) -> bool:
    """Flatten a ZeRO optimizer's grads straight into its (different) master dtype; returns whether it did."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = zero_optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return _zero12_flat_in_master_dtype(opt)
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return _zero3_flat_in_master_dtype(opt)
    return False


def _flat_into(grads: list[torch.Tensor], master: torch.Tensor, size: int) -> torch.Tensor:
    """``grads`` end to end in a new [size] tensor of ``master``'s dtype, zero-padded."""
    out = torch.empty(size, dtype=master.dtype, device=master.device)
    offset = 0
    for g in grads:
        out.narrow(0, offset, g.numel()).copy_(g.reshape(-1))
        offset += g.numel()
    out.narrow(0, offset, size - offset).zero_()
    return out


def _counted(opt: Any) -> None:
    opt.posttrain_flat_casts = getattr(opt, "posttrain_flat_casts", 0) + 1


def _zero12_flat_in_master_dtype(opt: Any) -> bool:
    if (opt.cpu_offload or getattr(opt, "zenflow", False) or not hasattr(opt, "_get_preflattened_grad_partition")
            or all(m.dtype == opt.dtype for m in opt.single_partition_of_fp32_groups)):
        return False  # no offload path here; same dtypes: flattening gives the master dtype already
    preflattened = opt._get_preflattened_grad_partition

    def flat_in_master_dtype(i: int) -> torch.Tensor | None:
        flat, grads = preflattened(i), opt.averaged_gradients.get(i)
        master = opt.single_partition_of_fp32_groups[i]
        size = int(opt.partition_size[i])
        if flat is not None or grads is None or master.dtype == opt.dtype or sum(g.numel() for g in grads) > size:
            return flat  # None: DeepSpeed's own flatten (and its size assertion)
        _counted(opt)
        return _flat_into(grads, master, size)

    opt._get_preflattened_grad_partition = flat_in_master_dtype
    return True


def _zero3_flat_in_master_dtype(opt: Any) -> bool:
    if (opt.offload_optimizer or not hasattr(opt, "_prepare_fp32_grad_for_sub_group")
            or all(m.dtype == opt.dtype for m in opt.fp32_partitioned_groups_flat)):
        return False
    prepare = opt._prepare_fp32_grad_for_sub_group

    def prepare_in_master_dtype(sub_group_id: int) -> None:
        master = opt.fp32_partitioned_groups_flat[sub_group_id]
        flatten = opt.flatten

        def flat(grads: list[torch.Tensor]) -> torch.Tensor:
            if sum(g.numel() for g in grads) != master.numel():
                return flatten(grads)  # DeepSpeed's own, and its size assertion
            _counted(opt)
            return _flat_into(grads, master, master.numel())

        opt.flatten = flat  # the one flatten of that method
        try:
            prepare(sub_group_id)
        finally:
            opt.flatten = flatten

    opt._prepare_fp32_grad_for_sub_group = prepare_in_master_dtype
    return True


def recompute_rotary_buffers(model: torch.nn.Module) -> int:
    """Recompute rotary inverse frequencies in fp32 (call outside zero.Init); returns how many were fixed."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fixed = 0
    for module in model.modules():
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "original_inv_freq"):
            continue
        init_fns = {"axial": getattr(module, "compute_axial_rope_parameters", None),
                    "ntk_alpha": getattr(module, "compute_ntk_alpha_rope_parameters", None),
                    "default": getattr(module, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
        init_fn = init_fns.get(getattr(module, "rope_type", None))
        if init_fn is None:
            continue
        value, _ = init_fn(module.config)
        for name in ("inv_freq", "original_inv_freq"):
            buf = getattr(module, name)
            buf.data = value.to(device=buf.device, dtype=torch.float32)
        fixed += 1
    return fixed
