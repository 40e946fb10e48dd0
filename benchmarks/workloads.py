"""One benchmark run: one workload under one mix, in the process group torchrun started.

Run by benchmarks/harness.py as ``torchrun --nproc_per_node N benchmarks/workloads.py SPEC OUTDIR``;
each rank writes ``OUTDIR/rank<R>.json``. The workloads drive the Session directly and mirror the
trainers' compute on random tokens:

- dpo: reference forward (no grad) on chosen+rejected, policy forward+backward on both, AdamW step;
- ppo: generate (policy samples ``response_len`` tokens), score (reference forward, reward forward),
  train (policy forward+backward+step, then value forward+backward+step);
- distill: teacher forward (no grad), student forward+backward on the KL to it, step.

Baselines ``trl-zero2``/``trl-zero3`` give the trained roles one config and prepare the frozen models
with TRL's ``prepare_deepspeed`` under that single plugin, as TRL's trainers do.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import lower_quartiles  # noqa: E402
from posttrain import memory  # noqa: E402
from posttrain.roles import Role, roles_for  # noqa: E402
from posttrain.session import Session  # noqa: E402
from posttrain.trainers.common import Phases  # noqa: E402

GiB = 2**30


def is_oom(err: BaseException) -> bool:
    """CUDA allocator failures, and the library errors that wrap one (cuBLAS, NCCL, DeepSpeed)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return any(s in text for s in ("out of memory", "cublas_status_alloc_failed", "cuda error: out of memory"))


# Peak memory over the whole run: phases reset the allocator's peak to get their own.
PEAK = {"allocated": 0.0, "reserved": 0.0}
# Device bytes held outside PyTorch's caching allocator (Session.bytes_outside_allocator), which
# every allocated/reserved figure adds back; constant once the models are prepared.
OUTSIDE = {"bytes": 0}


def gib(allocator_bytes: int) -> float:
    """An allocator figure in GiB, with the bytes held outside the allocator added back."""
    return (allocator_bytes + OUTSIDE["bytes"]) / GiB


def fold_peak() -> None:
    if _cuda():
        PEAK["allocated"] = max(PEAK["allocated"], gib(torch.cuda.max_memory_allocated()))
        PEAK["reserved"] = max(PEAK["reserved"], gib(torch.cuda.max_memory_reserved()))


def _cuda() -> bool:
    return torch.cuda.is_available()


def mem_now() -> dict[str, float] | None:
    if not _cuda():
        return None
    return {"allocated": gib(torch.cuda.memory_allocated()), "reserved": gib(torch.cuda.memory_reserved())}


class Bench:
    """The session, the role engines and the timing/memory bookkeeping of one run."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.workload = spec["workload"]
        names = memory.WORKLOADS[self.workload]
        self.trained, self.frozen = names["trained"], names["frozen"]
        self.mix = spec["mix"]
        self.baseline = self.mix in memory.BASELINES
        self.precision = spec.get("precision") or ("bf16" if _cuda() else "no")
        self.dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        if self.baseline:
            train_cfg = memory.BASELINES[self.mix][0]
            roles = [Role(n, train_cfg, trains=True) for n in self.trained]
        else:
            roles = roles_for(self.trained, self.frozen, mix=self.mix)
        self.session = Session(roles, micro_batch_size=spec["micro_batch"], mixed_precision=self.precision,
                               learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0)
        self.engines: dict[str, Any] = {}
        self.role_memory: dict[str, float] = {}
        self.phases = Phases()
        self.phase_peaks: dict[str, list[float]] = {}
        self.rollout: Any = None  # posttrain.rollout.Rollout of the ppo workload
        # One tokenizer for all roles: a smaller preset takes the first trained role's vocabulary.
        self.vocab = memory.shared_vocab(spec["shapes"], self.workload)

    # -- set-up ----------------------------------------------------------------------------
    def load_all(self) -> None:
        for name in self.trained + self.frozen:
            before = gib(torch.cuda.memory_allocated()) if _cuda() else 0.0
            self.engines[name] = self._load(name)
            if _cuda():
                torch.cuda.synchronize()
                OUTSIDE["bytes"] = self.session.bytes_outside_allocator()
                self.role_memory[name] = gib(torch.cuda.memory_allocated()) - before

    def _load(self, name: str) -> Any:
        s = self.session
        kind = memory.ROLE_KINDS[name]
        cfg = memory.model_config(self.spec["shapes"][name], kind, self.vocab)
        cls = memory.model_class(kind)
        torch.manual_seed(self.spec.get("seed", 0) + len(self.engines))
        if name in s.roles:
            # Non-ZeRO-3 models are built straight on the GPU (random init there is fast); ZeRO-3
            # models are built partitioned by zero.Init under the role's plugin.
            place = contextlib.nullcontext() if s.zero_stage(name) == 3 or not _cuda() else torch.device(s.device)
            with place:
                model = s.load(name, config=cfg, model_cls=cls, dtype=self.dtype)
            if s.role(name).trains:
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
                return s.prepare(name, model, opt)
            return s.prepare(name, model)
        # TRL's way: built under the single (trained) plugin, then prepare_deepspeed copies its config.
        from trl.models.utils import prepare_deepspeed

        zero3 = s.zero_stage(s.primary) == 3
        with s.activate(s.primary):
            with contextlib.nullcontext() if zero3 or not _cuda() else torch.device(s.device):
                model = cls.from_config(cfg, dtype=self.dtype)
            model.eval().requires_grad_(False)
            return prepare_deepspeed(model, s.accelerator)

    # -- measurement -----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase and record its own peak (the allocator's peak is reset for it)."""
        if _cuda():
            fold_peak()
            torch.cuda.reset_peak_memory_stats()
        with self.phases(name):
            yield
        if _cuda():
            self.phase_peaks.setdefault(name, []).append(gib(torch.cuda.max_memory_allocated()))
            fold_peak()

    def tokens(self, rows: int, length: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (rows, length), device=self.session.device)

    # -- workloads ---------------------------------------------------------------------------
    def dpo_step(self) -> dict[str, float]:
        from trl.trainer.utils import selective_log_softmax

        mb, length = self.spec["micro_batch"], self.spec["seq_len"]
        ids = self.tokens(2 * mb, length)  # chosen rows, then rejected rows
        policy, reference = self.engines["policy"], self.engines["reference"]

        def logps(model: Any) -> torch.Tensor:
            logits = model(input_ids=ids).logits[:, :-1]
            return selective_log_softmax(logits, ids[:, 1:]).sum(-1)

        with self.phase("reference_forward"), torch.no_grad():
            ref = logps(reference)
        with self.phase("policy_forward_backward"):
            pol = logps(policy)
            margin = (pol[:mb] - ref[:mb]) - (pol[mb:] - ref[mb:])
            loss = -torch.nn.functional.logsigmoid(0.1 * margin).mean()
            self.session.backward("policy", loss)
        with self.phase("optimizer_step"):
            self.session.step("policy")
        return {"loss": float(loss)}

    def ppo_step(self) -> dict[str, float]:
        from trl.trainer.utils import selective_log_softmax

        from posttrain.rollout import Rollout, SamplingParams

        s = self.session
        mb, length, resp = self.spec["micro_batch"], self.spec["seq_len"], self.spec["response_len"]
        prompts = self.tokens(mb, length - resp)
        policy = self.engines["policy"]
        if self.rollout is None:
            # PPO's sampling (temperature 1, no top-k/top-p, no stop token: every row full length);
            # "hf" is transformers' generate with TRL's ZeRO-3 gathering, "posttrain" the engine.
            sampling = SamplingParams(max_new_tokens=resp, pad_token_id=0, temperature=1.0, top_k=0, top_p=1.0)
            self.rollout = Rollout(s, "policy", sampling, max_batch=mb, max_prompt_len=length - resp,
                                   backend=self.spec.get("generation_backend") or "posttrain")
        with self.phase("generate"), torch.no_grad():
            seqs = self.rollout.generate(prompts, torch.ones_like(prompts)).sequences
        if seqs.shape[1] != length:
            raise RuntimeError(f"generation returned {seqs.shape[1]} tokens per row, expected {length}")
        targets = seqs[:, 1:]
        with self.phase("score"), torch.no_grad():
            ref_logps = selective_log_softmax(self.engines["reference"](input_ids=seqs).logits[:, :-1], targets)
            scores = self.engines["reward"](input_ids=seqs).logits[:, 0].float()
        with self.phase("train"):
            logps = selective_log_softmax(policy(input_ids=seqs).logits[:, :-1], targets)[:, -resp:]
            # A PPO-shaped loss (clipped ratio against the rollout's log-probs, KL-penalised score).
            adv = (scores - 0.05 * (logps.detach() - ref_logps[:, -resp:]).sum(-1)).unsqueeze(-1)
            ratio = torch.exp(logps - logps.detach())
            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            s.backward("policy", loss)
            s.step("policy")
            values = self.engines["value"](input_ids=seqs).logits[:, -resp:, 0].float()
            vloss = ((values - adv) ** 2).mean()
            s.backward("value", vloss)
            s.step("value")
        return {"loss": float(loss), "value_loss": float(vloss), "score": float(scores.mean())}

    def distill_step(self) -> dict[str, float]:
        mb, length = self.spec["micro_batch"], self.spec["seq_len"]
        ids = self.tokens(mb, length)
        with self.phase("teacher_forward"), torch.no_grad():
            t_logp = torch.log_softmax(self.engines["teacher"](input_ids=ids).logits.float(), -1)
        with self.phase("student_forward_backward"):
            s_logp = torch.log_softmax(self.engines["student"](input_ids=ids).logits.float(), -1)
            loss = torch.nn.functional.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
            self.session.backward("student", loss)
        with self.phase("optimizer_step"):
            self.session.step("student")
        return {"loss": float(loss)}

    def tokens_per_step(self) -> int:
        """Tokens one step processes on this rank (DPO counts chosen and rejected)."""
        mb, length = self.spec["micro_batch"], self.spec["seq_len"]
        return (2 if self.workload == "dpo" else 1) * mb * length


def profile_steps(step: Any, n: int, out_dir: Path, rank: int) -> None:
    """``n`` more steps under torch.profiler (not measured); rank 0 writes a gzipped Chrome trace
    and its kernel table to ``out_dir``."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    with profile(activities=activities) as prof:
        for i in range(n):
            with record_function(f"step_{i}"):
                step()
            if _cuda():
                torch.cuda.synchronize()
    if rank == 0:
        raw = out_dir / "trace-rank0.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(out_dir / "trace-rank0.json.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        raw.unlink()
        (out_dir / "kernels-rank0.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total" if _cuda() else "cpu_time_total", row_limit=40))


def frozen_canary(bench: Bench) -> dict[str, Any]:
    """The correctness canary (benchmarks/canary.py): each frozen role's outputs on a batch of the
    run's shape (micro batch x sequence length, where the forward's speed, and so any race in its
    gathering, is as in the steps) against its weights run unsharded. After the measured steps, so
    it changes no timing, and its memory is left out of the run's peak. A canary that cannot run leaves the row
    ``unchecked`` rather than losing its measurements.

    ``spec["canary_perturb"]`` (tests): add this to every weight of the frozen roles after the
    unsharded copy is taken, as a wrong gather would change what the forward sees."""
    from benchmarks import canary

    fold_peak()
    ids = bench.tokens(bench.spec["micro_batch"], bench.spec["seq_len"])
    diffs: dict[str, float] = {}
    scale = float(bench.spec.get("canary_perturb") or 0.0)
    try:
        for name in bench.frozen:
            perturb = None
            if scale:
                perturb = lambda name=name: bench.session.update_weights(name, lambda _, t: t.add_(scale))  # noqa: E731
            diffs[name] = canary.check(bench.engines[name], ids, bench.session.fast_frozen.get(name), perturb)
    except Exception as err:  # noqa: BLE001 - reported in the row
        return {"canary_error": f"{type(err).__name__}: {str(err)[:500]}"}
    finally:
        if _cuda():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return {"canary": diffs, "canary_tolerance": canary.TOLERANCE[bench.dtype]}


def run(spec: dict[str, Any], out_dir: Path | None = None) -> dict[str, Any]:
    """Set up, warm up, measure; the per-rank result (times in seconds, memory in GiB)."""
    t0 = time.perf_counter()
    bench = Bench(spec)
    bench.load_all()
    if _cuda():
        torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    res: dict[str, Any] = {"setup_s": setup_s, "role_memory_gib": bench.role_memory, "at_rest": mem_now()}
    step = getattr(bench, f"{bench.workload}_step")
    phase_times: list[dict[str, float]] = []
    losses: list[float] = []
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            bench.phase_peaks.clear()
        with bench.phases("step"):
            metrics = step()
        times = bench.phases.pop()
        if i >= spec["warmup"]:
            phase_times.append({k.removeprefix("time/"): v for k, v in times.items()})
            losses.append(metrics["loss"])
    res["step_times"] = phase_times  # per measured step: the step and its phases
    res["step_s"] = statistics.median(t["step"] for t in phase_times)
    res["phase_s"] = {k: statistics.median(t[k] for t in phase_times) for k in phase_times[0] if k != "step"}
    res.update(lower_quartiles(phase_times))
    res["tokens_per_step"] = bench.tokens_per_step()
    res["losses"] = losses
    res["phase_peak_gib"] = {k: max(v) for k, v in bench.phase_peaks.items()}
    res["world_size"] = bench.session.num_processes
    if bench.rollout is not None:
        res["rollout"] = bench.rollout.stats  # backend, fallback, captures, recaptures, capture_s
    if spec.get("profile_steps") and out_dir is not None:
        profile_steps(step, spec["profile_steps"], out_dir, bench.session.process_index)
    res.update(frozen_canary(bench))
    return res


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out_dir) / f"rank{rank}.json"
    result: dict[str, Any] = {"rank": rank, "status": "ok"}
    try:
        result.update(run(spec, Path(out_dir)))
    except BaseException as err:  # noqa: BLE001 - every failure is reported, OOM as such
        result["status"] = "oom" if is_oom(err) else "error"
        result["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if _cuda():
        fold_peak()
        result["peak_allocated_gib"] = PEAK["allocated"]
        result["peak_reserved_gib"] = PEAK["reserved"]
        result["device_total_gib"] = torch.cuda.get_device_properties(0).total_memory / GiB
    out.write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    if result["status"] != "ok":
        # Other ranks may be blocked in a collective: exit at once so torchrun ends the group.
        print(f"rank {rank}: {result['status']}: {result['error'][:300]}", file=sys.stderr, flush=True)
        os._exit(3)
    # The measurement is written; skip interpreter teardown, where DeepSpeed's and gloo's threads
    # can abort the process (seen on CPU: "terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
