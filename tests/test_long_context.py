"""Long completions: log-probs through the output layer in chunks (never the [tokens, vocab] logits) equal the
full logits' values, entropies and gradients (fp32 CPU, within 1e-5), and activation checkpointing on a packed
row of a few thousand tokens equals the forward without it."""

import pytest
import torch
from test_padding_free import assert_grads_close, grads

from posttrain.demo import tiny

TOL = 1e-5


def causal_lm(fused: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.sft_model_path(), dtype=torch.float32,
                                                 max_position_embeddings=4096)
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    return model


def batch(rows: int, prompt: int, completion: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded, completions right-padded to ``completion`` (one full, one empty): ids, mask, and
    the completion mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 540, (rows, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : (r * 3) % prompt] = 0  # left padding
        mask[r, prompt + max(0, completion - r * (completion // rows + 1)):] = 0  # right padding
    mask[-1, prompt:] = 0  # a completion masked out whole
    ids = ids * mask
    return ids, mask, mask[:, prompt:]




@pytest.mark.parametrize("padding_free", [False, True])
def test_chunked_head_equals_the_full_logits(monkeypatch, padding_free):
    """The scoring path of a frozen reference (and any unfused forward in float32): tiles of 7 tokens and 96
    vocabulary entries, so every row spans several; the output layer is never given a token to project."""
    import trl.kernels.chunked_logprob as kernel

    from posttrain.data.prompts import position_ids
    from posttrain.models import chunked_head
    from posttrain.trainers.online import completion_logps

    monkeypatch.setattr(kernel, "TOKEN_CHUNK_SIZE", 7)
    monkeypatch.setattr(chunked_head, "VOCAB_CHUNK", 96)
    model, temperature, k = causal_lm(), 0.9, 12
    ids, mask, cmask = batch(4, 10, k)
    weights = torch.linspace(0.5, 1.5, k)

    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -k - 1:-1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    full = logp.gather(-1, ids[:, -k:, None])[..., 0] * cmask
    full_ent = -(logp.exp() * logp).sum(-1).detach() * cmask
    (full * weights).sum().backward()
    full_grads = grads(model)

    projected = []
    model.lm_head.register_forward_hook(lambda m, a, out: projected.append(out.shape[1]))
    lp, ent = completion_logps(model, ids, mask, k, temperature, compute_entropy=True, batch_size=3,
                               padding_free=padding_free)
    (lp * weights).sum().backward()
    assert projected == [0, 0]  # two row chunks, no logits
    torch.testing.assert_close(lp.detach(), full.detach(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(ent, full_ent, atol=TOL, rtol=TOL)
    assert full.abs().sum() > 1.0 and lp.requires_grad and not ent.requires_grad
    assert_grads_close(grads(model), full_grads)


def test_a_logit_transform_keeps_the_logits():
    """A model that transforms its logits after the output layer (softcapping, scaling) scores from its logits."""
    from posttrain.models.chunked_head import output_layer

    model = causal_lm()
    assert output_layer(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert output_layer(model) is None


def test_checkpointing_on_a_long_packed_row():
    """GRPO's training forward (TRL's fused head, padding-free) over about 2,500 tokens with posttrain's activation
    checkpointing: each decoder layer runs again in backward, and log-probs and gradients equal the forward
    without checkpointing."""
    from posttrain.models.setup import enable_gradient_checkpointing
    from posttrain.trainers.online import completion_logps

    ids, mask, cmask = batch(4, 24, 1100, seed=1)
    out, calls = {}, []
    for checkpointing in (False, True):
        model = causal_lm(fused=True)
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        for layer in model.model.layers:  # counted inside the layer: the recompute runs no module hooks
            mlp = layer.mlp.forward
            layer.mlp.forward = lambda *a, f=mlp, c=checkpointing: (calls.append(c), f(*a))[1]
        lp, _ = completion_logps(model, ids, mask, 1100, 0.9, fused=True, padding_free=True)
        (lp * cmask).sum().backward()
        out[checkpointing] = lp.detach(), grads(model)
    assert int(mask.sum()) > 2500  # one packed row
    assert calls.count(False) == 2 and calls.count(True) == 4  # recomputed in backward
    torch.testing.assert_close(out[True][0], out[False][0], atol=TOL, rtol=TOL)
    assert_grads_close(out[True][1], out[False][1])


# -- the planner: the longest completion that fits ------------------------------------------------------------
LORA = dict(world_size=1, micro_batch=1, gradient_checkpointing=True, generation_batch=8, gradient_accumulation_steps=8)


def long_plan(length: int, gib: float = 139.0, prompt: int = 128, **kw):
    from posttrain.planner import memory

    lora = memory.Lora(16, ("all-linear",), 0.05)
    return memory.plan("grpo", "8b", "zero2-zero3", seq_len=prompt + length, response_len=length, lora=lora,
                       gpu_memory_gib=gib, **{**LORA, **kw})


def test_the_planner_counts_the_fused_head_not_the_logits():
    """GRPO trains and scores through TRL's fused LM head: a tile at a time and a few bytes per hidden unit
    per token, never the logits. Against the 8B LoRA race on one H200 within 3%: decoding merged (33.69 GiB,
    results/2026-12-01-1xH200-races) and grouped (20.76 GiB, results/2026-12-05-1xH200-tools-streaming-lora/lora)."""
    import json
    from pathlib import Path

    from posttrain.planner import memory

    m = memory.model_size("8b")
    logits = memory.train_activation_bytes(m, 1000, checkpointing=True)
    fused = memory.train_activation_bytes(m, 1000, checkpointing=True, chunked_head=True)
    assert logits - fused == 1000 * (memory.HEAD_TRAIN_V * m.vocab - memory.FUSED_HEAD_TRAIN_H * m.hidden) \
        - memory.HEAD_TILE_BYTES
    results = Path(__file__).resolve().parents[1] / "benchmarks/results"
    for run, side, mode in (("2026-12-01-1xH200-races", "posttrain-lora", "merged"),
                            ("2026-12-05-1xH200-tools-streaming-lora/lora", "posttrain-lora-grouped", "grouped")):
        rows = map(json.loads, (results / run / "grpo_lora_race.jsonl").read_text().splitlines())
        row = next(r for r in rows if r.get("side") == side)
        plan = memory.plan("grpo", "8b", "zero2-zero3", world_size=1, micro_batch=16, seq_len=384, response_len=256,
                           gradient_checkpointing=True, lora=memory.Lora(16, ("all-linear",), 0.05), lora_mode=mode)
        assert abs(plan.peak / memory.GiB - row["peak_allocated_gib"]) / row["peak_allocated_gib"] < 0.03, (mode, plan.peak)


def test_the_planner_against_the_long_context_rows():
    """The 8B LoRA long-context rows measured on one H200 (results/2026-12-05-1xH200-remeasure): 8 completions
    of 2,048, 6,144, 7,168 and 16,384 tokens, peaks within 3%, the planner on the safe side (by 0.02, 0.44, 0.47
    and 0.39 GiB; the 6,144 and 7,168 rows ran one step, before Adam's states exist: benchmarks/NOTES.md)."""
    import json
    from pathlib import Path

    from posttrain.planner import memory

    results = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-05-1xH200-remeasure"
    rows = [json.loads(line) for run in ("long-context", "planner-check")
            for line in (results / run / "grpo_long_context.jsonl").read_text().splitlines()]
    measured = {r["length"]: r["peak_allocated_gib"] for r in rows if r.get("status") == "ok"}
    assert sorted(measured) == [2048, 6144, 7168, 16384]
    for length in (2048, 6144, 7168, 16384):
        predicted = long_plan(length).peak / memory.GiB
        assert 0 < predicted - measured[length] < 0.03 * measured[length], (length, predicted, measured[length])


def test_longest_completion_fits_and_the_next_does_not():
    from posttrain.planner.longest import longest_completion

    found = {gib: longest_completion(lambda n, g=gib: long_plan(n, g), 1024) for gib in (80.0, 139.0, 200.0)}
    best = found[139.0]
    assert best.length % 1024 == 0 and best.length >= 16384 and best.next_length == best.length + 1024
    assert long_plan(best.length).fits and not long_plan(best.next_length).fits
    assert best.plan.peak == long_plan(best.length).peak
    assert found[80.0].length < best.length < found[200.0].length  # monotonic in the GPU's memory
    fewer = longest_completion(lambda n: long_plan(n, kv_slots=1), 1024)  # generation_kv_slots 1: KV for one
    assert fewer.length > best.length
    assert long_plan(4096, kv_slots=1).roles[0].kv_cache * 8 == long_plan(4096).roles[0].kv_cache
    none = longest_completion(lambda n: long_plan(n, 14.0), 1024)  # under the 8B base's 15 GiB
    assert none.length is None and not none.next_plan.fits and "no max_completion_length fits" in none.line()


def test_sleep_mode_counts_the_engine_cache_while_generating_only(capsys):
    """vllm_enable_sleep_mode: the engine's KV cache and graph pool leave the plan's at-rest bytes for its generate
    phase, so the longest completion that fits grows (the cache no longer sits beside the training activations)."""
    from posttrain import cli
    from posttrain.planner import memory
    from posttrain.planner.longest import longest_completion

    awake, asleep = long_plan(16384), long_plan(16384, sleep_mode=True)
    moved = awake.at_rest - asleep.at_rest
    cache = awake.roles[0].kv_cache + memory.GRAPH_POOL_BYTES_PER_ROW_VOCAB * 8 * awake.roles[0].size.vocab
    assert moved == cache and asleep.phases["generate"] == awake.phases["generate"] + cache
    assert asleep.phases["train"] == awake.phases["train"] and asleep.peak < awake.peak
    assert longest_completion(lambda n: long_plan(n, sleep_mode=True)).length > longest_completion(long_plan).length
    assert cli.main(["plan", "--workload", "grpo", "--shape", "8b", "--world-size", "1", "--micro-batch", "8",
                     "--seq-len", "640", "--response-len", "512", "--async-generation", "--vllm-enable-sleep-mode"]) == 2
    assert "without --async-generation" in capsys.readouterr().err


def test_plan_longest_completion_command(capsys):
    from posttrain import cli

    base = ["plan", "--workload", "grpo", "--shape", "8b", "--world-size", "1", "--micro-batch", "1",
            "--generation-batch-size", "8", "--seq-len", "16512", "--response-len", "16384", "--use-peft",
            "--lora-target-modules", "all-linear", "--gradient-checkpointing", "--mix", "zero2-zero3",
            "--master-weights", "fp32"]
    assert cli.main([*base, "--longest-completion", "--length-step", "2048"]) == 0
    out = capsys.readouterr().out
    from posttrain.planner.longest import longest_completion

    expected = longest_completion(lambda n: long_plan(n), 2048)
    assert f"longest max_completion_length that fits: {expected.length:,} tokens" in out
    assert f"{expected.next_length:,} does not" in out and "in steps of 2048 tokens" in out
    refusals = {("--workload", "dpo", "--longest-completion"): "dpo generates nothing",
                ("--workload", "grpo", "--micro-batch", "2", "--generation-batch-size", "7"):
                    "--generation-batch-size must be a multiple of --micro-batch x --world-size (4)",
                ("--workload", "grpo", "--generation-kv-slots", "0"): "--generation-kv-slots must be 1 or more",
                ("--workload", "grpo", "--longest-completion", "--length-step", "0"): "--length-step must be 1",
                ("--workload", "grpo", "--longest-completion", "--seq-len", "64", "--response-len", "64"):
                    "keeps the prompt"}
    for args, message in refusals.items():
        assert cli.main(["plan", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_the_planner_counts_the_engines_kv_slots():
    """``generation_kv_slots``: the engine's cache holds that many sequences, whatever the rows; the planner
    (bf16) counts the same cache as the engine allocates for the tiny default (fp32 on the CPU: twice)."""
    from test_rollout import build, rollout

    from posttrain.planner import memory

    tok = tiny.load_tokenizer()
    model = build("llama", tok)
    ids = tok(["the cat sat on the", "a", "hello world"], return_tensors="pt", padding=True,
              padding_side="left")["input_ids"].repeat_interleave(2, 0)
    mask = (ids != tok.pad_token_id).long()
    spec = str(tiny.sft_model_path())
    for slots in (None, 2):
        r = rollout(model, tok, max_batch=6, kv_slots=slots, max_new_tokens=16, min_new_tokens=16)
        out = r.generate(ids, mask)
        assert out.completion_mask.sum() == 6 * 16  # every row streamed through
        p, new = r.engine.prompt_len, r.engine.max_new
        plan = memory.plan("grpo", spec, "zero2-zero3", world_size=1, micro_batch=6, seq_len=p + new,
                           response_len=new, kv_slots=slots)
        assert r.engine.cache_nbytes == r.stats["kv_cache_bytes"] == 2 * plan.roles[0].kv_cache
        assert plan.roles[0].kv_cache == memory.kv_cache_bytes(memory.model_size(spec), slots or 6, p + new)
