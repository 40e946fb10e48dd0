"""The ``deepspeed`` case of ``rollout_bench.py`` (issue 39; see its docstring): DeepSpeed's own
rollout engine, ``deepspeed.runtime.rollout.HybridEngineRollout``, beside posttrain's engine on one
greedy workload (the ``full`` case's rows x prompt + new tokens, every row to the end).

DeepSpeed's engine is built as its documentation says: ``deepspeed.initialize`` wraps the model
(bf16, ZeRO stage 0, no optimizer: a rollout needs none) and ``HybridEngineRollout(engine,
tokenizer, HybridEngineRolloutConfig(...))`` drives ``engine.module``. Its paths, one row each:

- ``ds-generate``: ``generate`` without options: transformers' ``generate`` on the wrapped module.
- ``ds-graph``: ``use_graph_capture=True``: a static KV cache, the decode forward captured into a
  CUDA graph once per call and replayed (greedy only).
- ``ds-continuous``: ``SamplingConfig.continuous_batch_size`` = rows: its continuous-batching
  scheduler over a static cache, eager (greedy only, one sample per prompt).
- ``ds-continuous-graph``: both: continuous batching with one fixed-capacity captured decode.
- ``ds-hybrid-kernels``: the engine built with ``hybrid_engine.enabled`` (DeepSpeedHybridEngine,
  ``engine.eval()``: its inference kernels injected into the decoder layers, its ``generate``),
  the ``generate`` path only (the static-cache paths call the layers with a transformers cache
  that injected layers do not take); ``inference_containers`` says how many layers it replaced.

The first four share one copy of the model (the same seed: the same weights as posttrain's), the
last gets its own (injection rewrites the layers' forwards). Each path: one call (``first_s``:
includes capture), then ``repeats`` timed calls; tokens per second over the generated tokens; its
token ids against posttrain's greedy ones (``equal_sequences``: the fraction of rows equal in
every token, ``mean_common_prefix``: tokens before the first difference; bf16 greedy parts ways
after near-ties, so this is reported, not asserted) and against ``ds-generate``. A path that
raises records ``error`` (and where) instead of its figures.

DeepSpeed 0.19.8's static cache (``deepspeed/utils/static_cache.py``, used by every path but
``generate``) has no ``get_query_offset``, which transformers 5.24's mask code asks every cache
for: as shipped, those paths raise AttributeError. When one does, the case adds the method (the
query's position: the write position DeepSpeed set before the forward), records why under
``compat`` and runs the path again; every later row says ``query_offset_added``. With it, the
continuous path's greedy tokens equal ``generate``'s in float32 on the tiny shape (left-padded
prompts, fewer slots than rows included).
"""

from __future__ import annotations

import gc
import os
import socket
import traceback
from types import SimpleNamespace
from typing import Any

import torch

# name: (hybrid_engine enabled, HybridEngineRolloutConfig options, continuous batching)
PATHS: dict[str, tuple[bool, dict[str, Any], bool]] = {
    "ds-generate": (False, {}, False),
    "ds-graph": (False, {"use_graph_capture": True}, False),
    "ds-continuous": (False, {}, True),
    "ds-continuous-graph": (False, {"use_graph_capture": True}, True),
    "ds-hybrid-kernels": (True, {}, False),
}


def single_process_env() -> None:
    """The variables a launcher would set, for one process (``deepspeed.initialize`` inits torch.distributed)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def ds_engine(model: Any, hybrid: bool, max_out_tokens: int) -> Any:
    """``model`` wrapped by ``deepspeed.initialize`` (no optimizer), in eval mode."""
    import deepspeed

    single_process_env()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
              "zero_optimization": {"stage": 0},
              "hybrid_engine": {"enabled": hybrid, "max_out_tokens": max_out_tokens}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Rows equal in every token, and the mean count of tokens before the first difference."""
    n = min(tokens.shape[1], reference.shape[1])
    same = tokens[:, :n].cpu() == reference[:, :n].cpu()
    prefix = torch.cumprod(same.long(), dim=1).sum(1).float()
    equal = same.all(1) & (tokens.shape[1] == reference.shape[1])
    return {"equal_sequences": equal.float().mean().item(), "mean_common_prefix": prefix.mean().item()}


def failure(err: BaseException) -> dict[str, str]:
    """A row's ``error`` and the frame that raised it."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return {"status": "error", "error": f"{type(err).__name__}: {err}"[:1000],
            "at": f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"}


def add_query_offset() -> bool:
    """Give DeepSpeed's static cache the ``get_query_offset`` that transformers' mask code asks every
    cache for (its own caches: the position of the query); False where it already has one."""
    from deepspeed.utils.static_cache import DeepSpeedStaticCache

    if hasattr(DeepSpeedStaticCache, "get_query_offset"):
        return False

    def get_query_offset(self: Any, layer_idx: int = 0) -> Any:
        # DeepSpeed sets the write position before the forward, so its length counts the query.
        length = self.get_seq_length(layer_idx)
        return length - 1 if isinstance(length, torch.Tensor) or length else 0

    DeepSpeedStaticCache.get_query_offset = get_query_offset
    return True


def bench_deepspeed(res: dict[str, Any], model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *,
                    paths: list[str], repeats: int, build_copy: Any, timed: Any, profiled_rollouts: Any,
                    engine_summary: Any, budget_left: Any, save: Any) -> None:
    """The case (see the module docstring) into ``res``: posttrain's greedy row, then one row per
    DeepSpeed path in ``paths`` (``save()`` after each)."""
    import deepspeed
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    from posttrain.rollout import Rollout, SamplingParams

    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"--ds-paths: unknown {sorted(unknown)}; use some of {', '.join(PATHS)}")
    rows, p = ids.shape
    res.update(rows=rows, prompt_len=p, new_tokens=new_tokens, deepspeed=deepspeed.__version__)
    greedy = SamplingParams(max_new_tokens=new_tokens, pad_token_id=0, do_sample=False, min_new_tokens=new_tokens)
    r = Rollout(None, "policy", greedy, max_batch=rows, max_prompt_len=p, model=model, kv_slots=rows)
    first, s, times, out, _ = profiled_rollouts(r, ids, mask, repeats)
    tokens = int(out.completion_mask.sum().item())
    reference = out.completion_ids.cpu()
    res["posttrain"] = {"s": s, "all_s": times, "first_s": first, "tokens": tokens, "tokens_per_s": tokens / s,
                        **engine_summary(r)}
    del r, out
    save()
    # A random-weight model has no tokenizer; eos None runs every row to the end, as min_new_tokens does above.
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    request = RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)
    engines: dict[bool, Any] = {}
    ds_generate: torch.Tensor | None = None

    def measure(name: str, hybrid: bool, options: dict[str, Any], continuous: bool) -> dict[str, Any]:
        if hybrid not in engines:
            engines.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            engines[hybrid] = ds_engine(build_copy(), hybrid, p + new_tokens)
        engine = engines[hybrid]
        rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(**options))
        sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0,
                                  continuous_batch_size=rows if continuous else None)
        first, _, _ = timed(lambda: rollout.generate(request, sampling), 1)
        s, times, batch = timed(lambda: rollout.generate(request, sampling), repeats)
        completion = batch.input_ids[:, p:]
        lengths = batch.attention_mask[:, p:].sum(1) if continuous else torch.full((rows,), completion.shape[1])
        tokens = int(lengths.sum().item())
        row = {"s": s, "all_s": times, "first_s": first, "tokens": tokens, "tokens_per_s": tokens / s,
               "response_width": completion.shape[1], **agreement(completion, reference),
               "inference_containers": len(getattr(engine, "_inference_containers", [])), "status": "ok"}
        if ds_generate is not None and name != "ds-generate":
            row["equal_to_ds_generate"] = agreement(completion, ds_generate)["equal_sequences"]
        stats = rollout.get_last_continuous_stats() if continuous else None
        if stats:
            row["continuous_stats"] = {k: stats[k] for k in ("cache_capacity", "peak_cache_length", "decode_steps",
                                                              "cache_memory_bytes") if k in stats}
        row["completion"] = completion.cpu()
        return row

    for name in paths:
        hybrid, options, continuous = PATHS[name]
        row: dict[str, Any] = {"hybrid_engine": hybrid, **options,
                               "continuous_batch_size": rows if continuous else None}
        if budget_left() <= 0:
            res[name] = {**row, "status": "skipped", "error": "skipped: --budget-s spent"}
            continue
        try:
            try:
                row.update(measure(name, hybrid, options, continuous))
            except AttributeError as err:
                # DeepSpeed's static cache predates transformers' get_query_offset: run again with
                # it added, and say so in the case.
                if "get_query_offset" not in str(err) or not add_query_offset():
                    raise
                res["compat"] = {"added": "DeepSpeedStaticCache.get_query_offset (the write position)",
                                 "because": f"{name} as shipped: {type(err).__name__}: {err}"}
                traceback.print_exc()
                row.update(measure(name, hybrid, options, continuous))
        except Exception as err:  # noqa: BLE001 - a path that cannot run here is a row saying why
            row.update(failure(err))
            traceback.print_exc()
        completion = row.pop("completion", None)
        if name == "ds-generate" and completion is not None:
            ds_generate = completion
        row["query_offset_added"] = "compat" in res
        res[name] = row
        save()
    engines.clear()
