"""One reference model placed four ways in one process group, on identical weights: replicated,
DeepSpeed's stock ZeRO-3, and ZeRO-3 with posttrain's fast frozen path (posttrain/frozen.py) over
each of its transports (copy engines reading peer-mapped memory, and NCCL).

    torchrun --standalone --nproc_per_node 2 benchmarks/frozen_probe.py --shape 1b --out DIR [--profile]

Rank 0 writes ``DIR/probe-<shape>.json`` with:

- ``logps``: per-token log-probs of fast and stock against replicated on the same tokens (the
  harness cannot check this: its mixes build their models by different initialisation paths);
- ``forward_ms``: the frozen forward (logits and per-token log-probs, as DPO's reference computes
  them), the placements interleaved, medians; ``forward_after_train_step_ms``: the same, each
  forward right after a policy training step, as in a DPO step; ``issue_over_forward``: the share
  of a forward the CPU spends issuing it (near 1: CPU-bound, where hooks cost time directly);
- ``policy``: the ZeRO-2 policy's generation and training step (forward, backward, AdamW) in the
  same process before any ZeRO-3 model exists, after the fast reference is prepared, and after
  the stock one is too: what a frozen ZeRO-3 model in the process costs the trained one;
- ``memory_gib``: what each placement adds at rest, and the fast forward's peak above rest.

``--profile`` also writes a torch.profiler trace of fast and replicated forwards (Chrome format,
gzipped) and its kernel table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from posttrain.placement.roles import Role  # noqa: E402
from posttrain.placement.session import Session  # noqa: E402
from posttrain.planner import memory  # noqa: E402

GiB = 2**30
CUDA = torch.cuda.is_available()  # on CPU the probe runs too (a smoke test), without memory figures


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--micro-batch", type=int, default=4, help="pairs per GPU: the forward sees 2x rows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64, help="policy generation length")
    ap.add_argument("--repeat", type=int, default=20, help="forwards per placement")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tmp", default="/tmp/frozen_probe", help="where the shared initial weights are written")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    roles = [Role("policy", "zero2_train", trains=True), Role("rep", "replicated_inference"),
             Role("fast", "zero3_inference", fast_frozen=True), Role("fast_nccl", "zero3_inference", fast_frozen=True),
             Role("stock", "zero3_inference", fast_frozen=False)]
    dtype = torch.bfloat16 if CUDA else torch.float32
    s = Session(roles, micro_batch_size=args.micro_batch, mixed_precision="bf16" if CUDA else "no", learning_rate=1e-6,
                weight_decay=0.0, max_grad_norm=1.0)
    rank, dev = s.process_index, s.device
    cfg = memory.model_config(args.shape)
    res: dict[str, Any] = {"shape": args.shape, "world_size": s.num_processes, "micro_batch": args.micro_batch,
                           "seq_len": args.seq_len, "rows_per_forward": 2 * args.micro_batch,
                           "torch": torch.__version__}

    torch.manual_seed(0)
    with torch.device(dev):
        policy = s.load("policy", config=cfg, dtype=dtype)
    # The reference starts as the policy does (as in DPO and PPO): its initial weights, on disk, are
    # what every placement loads.
    path = Path(args.tmp) / args.shape
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        policy.save_pretrained(path)
    s.accelerator.wait_for_everyone()
    policy = s.prepare("policy", policy, torch.optim.AdamW(policy.parameters(), lr=1e-6))

    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    ids = torch.randint(3, cfg.vocab_size, (2 * args.micro_batch, args.seq_len), device=dev, generator=g)
    prompts = ids[: args.micro_batch, : args.seq_len - args.new_tokens]

    def logps(model: Any) -> torch.Tensor:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(model(input_ids=ids).logits[:, :-1], ids[:, 1:])

    def generate() -> None:
        with torch.no_grad():
            policy.module.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                   max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=True, pad_token_id=0)

    def train_step() -> None:
        loss = -logps(policy).sum(-1).mean() * 1e-3
        s.backward("policy", loss)
        s.step("policy")

    def measure_policy(tag: str) -> None:
        # Alternating short blocks: the host's speed drifts over seconds.
        gen, train = [], []
        for _ in range(3):
            gen += timed(generate, 2)
            train += timed(train_step, 4)
        res.setdefault("policy", {})[tag] = {"generate_s": statistics.median(gen), "generate_min_s": min(gen),
                                             "generate_all": gen, "train_step_s": statistics.median(train),
                                             "train_min_s": min(train), "train_all": train}

    generate()  # warm-up: kernels, allocator
    train_step()
    measure_policy("alone")

    engines: dict[str, Any] = {}
    mem: dict[str, float] = {}

    def used() -> int:  # device-wide, allocations outside PyTorch's caching allocator included
        return torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] if CUDA else 0

    def add(name: str) -> None:
        sync()
        before, before_used = allocated(), used()
        if name == "fast_nccl":
            os.environ["POSTTRAIN_FROZEN_TRANSPORT"] = "nccl"
        model = s.load(name, path, dtype=dtype)  # a ZeRO-3 role's is partitioned onto the GPU by zero.Init
        engines[name] = s.prepare(name, model)
        os.environ.pop("POSTTRAIN_FROZEN_TRANSPORT", None)
        sync()
        mem[f"{name}_at_rest"] = (allocated() - before) / GiB
        if name in s.fast_frozen:
            mem[f"{name}_outside_allocator"] = s.fast_frozen[name].bytes_outside_allocator() / GiB
        mem[f"{name}_at_rest_device"] = (used() - before_used) / GiB

    add("rep")
    add("fast")
    measure_policy("with_fast_zero3")
    add("fast_nccl")
    res["transports"] = {n: s.fast_frozen[n].transport for n in ("fast", "fast_nccl")}

    def forward(name: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                return logps(engines[name])
        return run

    want = forward("rep")()
    got = forward("fast")()  # the first fast forward records the unit order
    got = forward("fast")()  # the second prefetches along it
    if CUDA:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for name in ("fast", "rep"):
            torch.cuda.reset_peak_memory_stats()
            forward(name)()
            torch.cuda.synchronize()
            mem[f"{name}_forward_peak_above_rest"] = (torch.cuda.max_memory_allocated() - base) / GiB

    def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
        a, b = a.float(), b.float()
        return {"max_abs_token": (a - b).abs().max().item(), "mean_abs_token": (a - b).abs().mean().item(),
                "max_abs_sequence": (a.sum(-1) - b.sum(-1)).abs().max().item(),
                "bitwise_equal": bool(torch.equal(a, b))}

    forward("fast_nccl")()
    res["logps"] = {"fast_vs_rep": diff(got, want), "fast_nccl_vs_fast": diff(forward("fast_nccl")(), got)}
    # bf16's own spread: the replicated model on half the rows (other GEMM shapes, other kernels)
    # against the same rows of the full batch.
    half = ids.shape[0] // 2
    with torch.no_grad():
        from trl.trainer.utils import selective_log_softmax

        part = selective_log_softmax(engines["rep"](input_ids=ids[:half]).logits[:, :-1], ids[:half, 1:])
    res["logps"]["rep_half_batch_vs_rep"] = diff(part, want[:half])
    # Where a difference would come from: the weights and buffers each placement computes with.
    fast_sd = s.state_dict("fast")
    rep_sd = {k: v.detach().cpu() for k, v in engines["rep"].module.state_dict().items()}
    res["weights_fast_vs_rep_max_abs"] = max((fast_sd[k].float() - v.float()).abs().max().item() for k, v in rep_sd.items())
    res["buffers_fast_vs_rep_max_abs"] = {
        n: (b.float() - dict(engines["rep"].module.named_buffers())[n].float()).abs().max().item()
        for n, b in engines["fast"].module.named_buffers()}

    times: dict[str, list[float]] = {"rep": [], "fast": [], "fast_nccl": []}
    for _ in range(args.repeat):  # interleaved, so drift in clocks affects both alike
        for name in times:
            times[name] += timed(forward(name), 1)
    # CPU-bound or GPU-bound: how long the CPU takes to issue a forward (the call returns before
    # the GPU finishes) against the whole forward. Near 1 means the GPU waits for the CPU, where
    # the fast path's hooks add directly to the time.
    issue: dict[str, list[float]] = {"rep": [], "fast": []}
    for _ in range(max(4, args.repeat // 2)):
        for name in issue:
            sync()
            t = time.perf_counter()
            forward(name)()
            issued = time.perf_counter() - t
            sync()
            issue[name].append(issued / (time.perf_counter() - t))
    res["issue_over_forward"] = {k: statistics.median(v) for k, v in issue.items()}
    # The same forwards as a DPO step runs them: each after a policy forward, backward and step
    # (the harness's loop, where the allocator's pool and the streams are in another state).
    in_loop: dict[str, list[float]] = {"rep": [], "fast": []}
    for _ in range(max(4, args.repeat // 2)):
        for name in in_loop:
            train_step()
            in_loop[name] += timed(forward(name), 1)
    res["forward_after_train_step_ms"] = {k: 1e3 * statistics.median(v) for k, v in in_loop.items()}
    res["forward_after_train_step_all_ms"] = {k: [round(1e3 * x, 2) for x in v] for k, v in in_loop.items()}

    if args.profile:
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=activities) as prof:
            for name in ("fast", "rep", "fast", "rep"):
                with record_function(f"forward_{name}"):
                    forward(name)()
                sync()
        if rank == 0:
            prof.export_chrome_trace(str(out / "trace.json"))
            with open(out / "trace.json", "rb") as f, gzip.open(out / f"trace-{args.shape}.json.gz", "wb") as z:
                shutil.copyfileobj(f, z)
            (out / "trace.json").unlink()
            (out / f"kernels-{args.shape}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total" if CUDA else "cpu_time_total", row_limit=40))

    add("stock")
    measure_policy("with_fast_and_stock_zero3")
    stock_first = forward("stock")()
    stock_second = forward("stock")()  # DeepSpeed prefetches along the trace it recorded on the first
    res["logps"]["stock_vs_rep"] = diff(stock_first, want)
    res["logps"]["fast_vs_stock"] = diff(got, stock_first)
    res["logps"]["stock_second_vs_first"] = diff(stock_second, stock_first)
    times["stock"] = []
    for _ in range(max(5, args.repeat // 4)):
        for name in times:
            times[name] += timed(forward(name), 1)

    res["forward_ms"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    res["forward_ms"]["fast_over_rep"] = res["forward_ms"]["fast"] / res["forward_ms"]["rep"]
    res["forward_ms"]["fast_nccl_over_rep"] = res["forward_ms"]["fast_nccl"] / res["forward_ms"]["rep"]
    res["forward_all_ms"] = {k: [round(1e3 * x, 2) for x in v] for k, v in times.items()}
    p = res["policy"]
    res["policy_ratios_of_fastest"] = {
        "generate_with_fast_over_alone": p["with_fast_zero3"]["generate_min_s"] / p["alone"]["generate_min_s"],
        "train_with_fast_over_alone": p["with_fast_zero3"]["train_min_s"] / p["alone"]["train_min_s"],
        "generate_with_stock_over_alone":
            p["with_fast_and_stock_zero3"]["generate_min_s"] / p["alone"]["generate_min_s"],
        "train_with_stock_over_alone": p["with_fast_and_stock_zero3"]["train_min_s"] / p["alone"]["train_min_s"],
    }
    res["policy_ratios"] = {
        "generate_with_fast_over_alone": p["with_fast_zero3"]["generate_s"] / p["alone"]["generate_s"],
        "train_with_fast_over_alone": p["with_fast_zero3"]["train_step_s"] / p["alone"]["train_step_s"],
        "generate_with_stock_over_alone": p["with_fast_and_stock_zero3"]["generate_s"] / p["alone"]["generate_s"],
        "train_with_stock_over_alone":
            p["with_fast_and_stock_zero3"]["train_step_s"] / p["alone"]["train_step_s"],
    }
    ff = s.fast_frozen["fast"]
    size = torch.finfo(dtype).bits // 8
    res["fast_units"] = {"units": len(ff.units), "largest_unit_gib": max(u.nbytes for u in ff.units) / GiB,
                         "lookahead_gib": ff.lookahead_bytes / GiB,
                         "local_gib": ff.local_numel() * size / GiB, "full_gib": ff.full_numel() * size / GiB}
    res["memory_gib"] = mem
    summary = torch.tensor([res["forward_ms"][k] for k in ("fast", "rep", "fast_nccl")], device=dev)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    res["forward_ms_max_rank"] = dict(zip(("fast", "rep", "fast_nccl"), summary.tolist()))
    if rank == 0:
        (out / f"probe-{args.shape}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: res[k] for k in ("transports", "forward_ms", "forward_after_train_step_ms", "issue_over_forward",
                                              "policy_ratios", "policy_ratios_of_fastest",
                                              "memory_gib", "logps", "buffers_fast_vs_rep_max_abs")},
                         indent=1))
    s.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
