"""Minimal reproduction, DeepSpeed and transformers only: ZeRO-3 leaf modules
(`stage3_module_granularity_threshold` > 0, which turns on `fast_sharding_for_leaf_module`)
give wrong outputs on a GPU when the compute stream lags the all-gather stream.

    torchrun --standalone --nproc_per_node 2 benchmarks/ds_leaf_race.py --out DIR

Suspected cause (DeepSpeed 0.19.8, runtime/zero/partitioned_param_coordinator.py): with fast
sharding, `fetch_sub_module` waits on a leaf module's all-gather inside
`with stream(allgather_stream)`, so the gathered full parameter (`torch.cat` in
`AllGatherCoalescedHandle.wait`) is allocated on the all-gather stream, and with
`handle_dependency=False` nothing records the compute stream's use of it. `release_sub_module`
then drops it with `param.data = empty_buffer` (the comment says the empty buffer "ensures that
all computations are complete"; allocating it synchronises nothing) instead of `free_param`,
which calls `record_stream(current_stream)`. The caching allocator hands the block to the next
all-gather on the all-gather stream (which never waits on the compute stream) while the
released module's kernels are still queued on the compute stream: they read another
parameter's bytes.

The script makes the lag deterministic: a forward pre-hook, registered after DeepSpeed's,
queues `torch.cuda._sleep` on the compute stream at the start of every decoder layer and of the
head, so the CPU (and the all-gather stream) run ahead, as they do on fast interconnects with
long GEMMs (the 3B shape's 128256 x 3072 tied head at 4 GPUs). It compares log-probs of one
ZeRO-3 inference engine per setting with the same weights replicated:

    threshold 0 (DeepSpeed's defaults)   | leaf modules   | leaf modules + record_stream before release
and with and without the injected lag. Rank 0 writes DIR/ds_leaf_race.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


def build(seed: int, vocab: int, hidden: int, layers: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      tie_word_embeddings=True, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.eval().requires_grad_(False)
    return model


def logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def patch_release_records_stream() -> None:
    """The fix under test: record the compute stream's use of every gathered parameter of a
    module before DeepSpeed releases it (what free_param does on the default path)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
        iter_params,
    )
    from deepspeed.utils import z3_leaf_module

    original = PartitionedParameterCoordinator.release_sub_module

    def release_sub_module(self, submodule, forward=False):
        stream = torch.cuda.current_stream()
        for p in iter_params(submodule, recurse=z3_leaf_module(submodule)):
            if p.ds_status == ZeroParamStatus.AVAILABLE and p.data.is_cuda and p.data.numel() > 0:
                p.data.record_stream(stream)
        return original(self, submodule, forward)

    PartitionedParameterCoordinator.release_sub_module = release_sub_module


def add_lag(model: torch.nn.Module, cycles: int) -> list:
    def lag(module, args):
        torch.cuda._sleep(cycles)

    targets = list(model.model.layers) + [model.lm_head]
    return [m.register_forward_pre_hook(lag) for m in targets]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lag-cycles", type=int, default=20_000_000)  # ~10 ms per module at ~2 GHz
    ap.add_argument("--forwards", type=int, default=3)
    # Leaf modules are those whose parameters per submodule are at most this; 2e6 makes each
    # decoder layer of the default shape a leaf (about 1.1M per submodule) but not the model
    # itself (its 131M-parameter embedding puts it near 3.8M). DeepSpeed's own rule makes the
    # whole model one leaf at 1e8 for a model this small, which hides the race.
    ap.add_argument("--threshold", type=int, default=2_000_000)
    args = ap.parse_args()

    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).cuda()

    replicated = build(0, args.vocab, args.hidden, args.layers).cuda()
    with torch.no_grad():
        want = logps(replicated, ids)
    del replicated
    torch.cuda.empty_cache()

    results = []
    t = args.threshold
    settings = [("threshold 0", 0, False), (f"threshold {t}", t, False), (f"threshold {t} + record_stream", t, True)]
    patched = False
    for name, threshold, fix in settings:
        if fix and not patched:
            patch_release_records_stream()
            patched = True
        for lag in (0, args.lag_cycles):
            config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": threshold}}
            engine, *_ = deepspeed.initialize(model=build(0, args.vocab, args.hidden, args.layers), config=config)
            engine.eval()
            hooks = add_lag(engine.module, lag) if lag else []
            leaves = sum(bool(getattr(m, "_z3_leaf", False)) for m in engine.module.modules())
            with torch.no_grad():
                # Back to back with no host sync between them (as a training loop issues them):
                # the second forward on prefetches along the recorded trace.
                outs = [logps(engine, ids) for _ in range(args.forwards)]
                diffs = [(got - want).abs().max().item() for got in outs]
            for h in hooks:
                h.remove()
            t = torch.tensor(diffs, device="cuda")
            gathered = [torch.zeros_like(t) for _ in range(world)]
            dist.all_gather(gathered, t)
            row = {"setting": name, "lag_cycles": lag, "leaf_modules": leaves,
                   "max_abs_logprob_diff_per_rank": [max(x.tolist()) for x in gathered],
                   "per_forward_rank0": diffs}
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            engine.destroy()
            del engine
            torch.cuda.empty_cache()

    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        env = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "world": world,
               "gpu": torch.cuda.get_device_name(), "args": vars(args)}
        (out / "ds_leaf_race.json").write_text(json.dumps({"env": env, "rows": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
