"""The rollout engine with peft LoRA adapters (posttrain/rollout/adapters.py), CPU fp32: both modes
("merged" buffers, "live" low-rank terms) decode what a forward of the adapted peft model gives,
not what the base gives; disabled adapters give the base; in-place adapter updates are seen with
no recompile; what the engine cannot run falls back to ``generate``, counted."""

import copy

import pytest
import torch
from test_rollout import build, forward_logprobs, rollout

from posttrain.demo import tiny

MODES = ("merged", "live", "grouped")


@pytest.fixture(scope="module")
def tok():
    return tiny.load_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    enc = tok(["the cat sat on the", "a", "hello world how are you", "we went to"], return_tensors="pt",
              padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def with_adapters(base, extras: bool = False, **config):
    """``base`` (copied) with random non-zero LoRA adapters: all linear layers (r 4), or with
    ``extras`` q/v/lm_head LoRA with biases, a modules_to_save copy of the final norm and a second
    active adapter (rslora scaling)."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    if extras:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
                         lora_bias=True, modules_to_save=["norm"], **config)
    else:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", **config)
    peft_model = get_peft_model(model, cfg)
    if extras:
        peft_model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, use_rslora=True, lora_dropout=0.0,
                                                    target_modules=["k_proj", "down_proj"]))
        peft_model.base_model.set_adapter(["default", "second"])
    randomize(peft_model, 0, 0.15 if extras else 0.3)  # LoRA on the LM head moves logits more
    return peft_model.eval()


@torch.no_grad()
def randomize(peft_model, seed: int, scale: float = 0.3) -> None:
    """Non-zero adapters (peft starts lora_B at zero) and a changed modules_to_save copy, in place."""
    g = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_" in name or "modules_to_save" in name:
            p.copy_(p + scale * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def base(tok):
    return build("llama", tok)


@pytest.mark.parametrize("case", ["all-linear", "extras", "qwen2"])
@pytest.mark.parametrize("mode", MODES)
def test_adapted_rollout_equals_the_peft_forward_not_the_base(mode, case, base, tok, prompts):
    """Sampled log-probs equal a forward of the peft model within 1e-5 and greedy tokens equal
    peft's own generate; the base model decodes something else (so this can fail). qwen2: base
    q/k/v biases and tied embeddings under the adapters."""
    if case == "qwen2":
        base = build("qwen2", tok)
    model, (ids, mask) = with_adapters(base, case == "extras"), prompts
    r = rollout(model, tok, engine_options=dict(lora_mode=mode))
    torch.manual_seed(5)
    out = r.generate(ids, mask)
    assert r.stats["backend"] == "posttrain" and r.stats["fallback"] is None and r.stats["lora_mode"] == mode
    # Merged weights, or grouped's appended A rows and expand blocks; live reads the adapters themselves.
    assert (r.stats["lora_merged_bytes"] > 0) == (mode != "live")
    assert (forward_logprobs(model, out, mask) - out.logprobs).abs().max().item() < 1e-5
    greedy = rollout(model, tok, do_sample=False, engine_options=dict(lora_mode=mode)).generate(ids, mask)
    hf = rollout(model, tok, do_sample=False, backend="hf").generate(ids, mask)
    assert torch.equal(greedy.sequences, hf.sequences)
    assert (greedy.logprobs - hf.logprobs).abs().max().item() < 1e-5
    plain = rollout(base, tok, do_sample=False).generate(ids, mask)
    assert not torch.equal(plain.sequences, greedy.sequences)
    assert (forward_logprobs(base, greedy, mask) - greedy.logprobs).abs().max().item() > 1e-2
    if case == "extras":  # another active set, the same engine: what peft's forward now gives
        model.base_model.set_adapter("second")
        torch.manual_seed(5)
        other = r.generate(ids, mask)
        assert (forward_logprobs(model, other, mask) - other.logprobs).abs().max().item() < 1e-5
        assert (other.logprobs - out.logprobs).abs().max().item() > 1e-2


def test_grouped_reads_the_base_in_place_with_the_a_rows_appended(base, tok, prompts, tmp_path):
    """Mode "grouped": every frozen base weight is a view of its group's appended buffer (no second copy), the
    extra bytes are the adapters' (a sixth of merged's copies at this tiny width and r 4; about r / hidden at scale); samples for a fixed key equal merged's
    tokens, log-probs within 1e-5; the peft model trains and saves as before; a base weight re-allocated behind
    the engine's back is copied back in and re-pointed, counted."""
    from safetensors.torch import load_file

    from posttrain.models.lora import save_merged

    ids, mask = prompts
    torch.manual_seed(0)  # peft's lora_A initialisation: the same adapters in any test order
    model = with_adapters(base)
    before = model(input_ids=ids, attention_mask=mask).logits
    merged = rollout(model, tok, engine_options=dict(lora_mode="merged"))
    torch.manual_seed(5)
    want = merged.generate(ids, mask)
    r = rollout(model, tok, engine_options=dict(lora_mode="grouped"))
    torch.manual_seed(5)
    out = r.generate(ids, mask)
    assert torch.equal(out.sequences, want.sequences)
    assert (out.logprobs - want.logprobs).abs().max().item() < 1e-5
    layers = len(model.base_model.model.model.layers)
    assert r.stats["lora_appended_groups"] == 4 * layers and r.stats["lora_repointed"] == 0
    buffers = {a.weight.untyped_storage().data_ptr() for a in r.engine.adapters.appended.values()}
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert adapted and all(m.base_layer.weight.untyped_storage().data_ptr() in buffers for m in adapted)
    assert r.stats["lora_merged_bytes"] * 6 < merged.stats["lora_merged_bytes"]
    # The model's own forward reads the same weights, trains through them, and saves.
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    model.train()
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert all(m.lora_B["default"].weight.grad is not None and m.base_layer.weight.grad is None for m in adapted)
    model.zero_grad(set_to_none=True)
    model.eval()
    save_merged(model, model.state_dict(), tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.allclose(saved["model.layers.0.self_attn.q_proj.weight"],
                          q.base_layer.weight + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A["default"].weight,
                          atol=1e-6)
    # A weight replaced, not written in place: the next rollout copies it back and re-points it.
    with torch.no_grad():
        q.base_layer.weight.data = q.base_layer.weight.data.clone()
    torch.manual_seed(5)
    again = r.generate(ids, mask)
    assert r.stats["lora_repointed"] == 1 and torch.equal(again.sequences, want.sequences)
    assert q.base_layer.weight.untyped_storage().data_ptr() in buffers


def test_grouped_with_a_trainable_base_weight_runs_separate_products_counted(base, tok, prompts):
    """A base weight that trains belongs to the optimizer, so grouped leaves it where it is: its group runs
    separate low-rank products (still the peft forward), counted as a slow fallback in the metrics."""
    ids, mask = prompts
    torch.manual_seed(0)  # peft initialises lora_A from the global generator: the same adapters in any test order
    model = with_adapters(base)
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    r = rollout(model, tok, engine_options=dict(lora_mode="grouped"))
    torch.manual_seed(5)
    out = r.generate(ids, mask)
    assert (forward_logprobs(model, out, mask) - out.logprobs).abs().max().item() < 1e-5
    assert r.stats["lora_fallbacks"] == 1 and r.metrics()["rollout/lora_fallbacks"] == 1 and r.degraded
    assert r.stats["lora_appended_groups"] == 4 * len(model.base_model.model.model.layers) - 1


@pytest.mark.parametrize("mode", MODES)
def test_disabled_adapters_give_the_base_and_updates_need_no_recompile(mode, base, tok, prompts):
    """Traced as CUDA compiles it (fullgraph, aot_eager): adapters changed in place, then switched
    off (peft's disable_adapter), are each seen by the next rollout of the same engine, with no new
    graph and no fallback."""
    from torch._dynamo.utils import counters

    model, (ids, mask) = with_adapters(base), prompts
    torch._dynamo.reset()
    counters.clear()
    r = rollout(model, tok, do_sample=False, engine_options=dict(
        lora_mode=mode, compile_backend="aot_eager", smallest_bucket=2, length_bucket=8))
    first = r.generate(ids, mask)
    assert (forward_logprobs(model, first, mask) - first.logprobs).abs().max().item() < 1e-5
    graphs, engine = counters["stats"]["unique_graphs"], r.engine
    randomize(model, 1, scale=0.1)  # an optimizer step: in place
    second = r.generate(ids, mask)
    assert (forward_logprobs(model, second, mask) - second.logprobs).abs().max().item() < 1e-5
    assert not torch.equal(first.sequences, second.sequences)
    with model.disable_adapter():
        off = r.generate(ids, mask)
    want = rollout(base, tok, do_sample=False).generate(ids, mask)
    assert torch.equal(off.sequences, want.sequences)
    assert (off.logprobs - want.logprobs).abs().max().item() < 1e-5
    again = r.generate(ids, mask)  # adapters back on
    assert torch.equal(again.sequences, second.sequences)
    assert r.engine is engine and counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    # Switching adapters changes values (scalings, merged buffers), not tensors: nothing to recapture.
    assert r.stats["compiled"] and not r.degraded and r.stats["storage_moves"] == 0, r.stats
    torch._dynamo.reset()


def test_what_the_engine_cannot_run_falls_back_counted(base, tok, prompts):
    """DoRA: the whole role generates with peft's forward (backend_fallback, the reason named);
    adapters merged into the base and then disabled: that rollout generates (adapter_fallbacks)."""
    ids, mask = prompts
    dora = with_adapters(base, use_dora=True)
    r = rollout(dora, tok, do_sample=False)
    out = r.generate(ids, mask)
    assert r.stats["backend"] == "hf" and "DoRA" in r.stats["fallback"]
    assert r.metrics()["rollout/backend_fallback"] == 1.0
    assert (forward_logprobs(dora, out, mask) - out.logprobs).abs().max().item() < 1e-5

    model = with_adapters(base)
    r = rollout(model, tok, do_sample=False)
    adapted = r.generate(ids, mask)
    model.merge_adapter()
    merged = r.generate(ids, mask)  # merged and on: the base weights hold the adapters
    assert torch.equal(merged.sequences, adapted.sequences) and r.stats["adapter_fallbacks"] == 0
    with model.disable_adapter():
        off = r.generate(ids, mask)
    assert r.stats["adapter_fallbacks"] == 1 and r.metrics()["rollout/adapter_fallbacks"] == 1 and r.degraded
    assert torch.equal(off.sequences, rollout(base, tok, do_sample=False).generate(ids, mask).sequences)


def test_prompt_learning_and_embedding_lora_fall_back(base):
    from peft import LoraConfig, PrefixTuningConfig, get_peft_model

    from posttrain.rollout import adapters

    emb = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    assert "Embedding" in adapters.unsupported_reason(emb)
    prefix = get_peft_model(copy.deepcopy(base), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "prompt learning" in adapters.unsupported_reason(prefix)
    assert adapters.unsupported_reason(base) is None


@pytest.mark.parametrize("mode", MODES)
def test_fused_projections_with_adapters(mode, base, tok, prompts):
    """``fused``: q|k|v and gate|up copies hold the merged weights ("merged") or the base, the
    adapters' terms added to each part ("live"); "grouped"'s appended buffers fuse each group already (no
    copies); all decode the peft forward."""
    model, (ids, mask) = with_adapters(base, extras=True), prompts
    r = rollout(model, tok, engine_options=dict(lora_mode=mode, fused=True))
    torch.manual_seed(6)
    out = r.generate(ids, mask)
    assert (r.stats["fused_weight_bytes"] > 0) == (mode != "grouped") and r.stats["lora_mode"] == mode
    assert (forward_logprobs(model, out, mask) - out.logprobs).abs().max().item() < 1e-5
    if mode == "merged":
        # The adapted q/k/v's merged buffers are slices of the fused ones: not held twice (only the
        # LM head's and down_proj's own merged buffers remain), refreshed in place with them.
        adapters, fused = r.engine.adapters, r.engine.fused
        assert len(adapters.adopted) == 3 * len(fused)
        alone = [t for key, (w, b) in adapters.merged.items() if key not in adapters.adopted for t in (w, b)]
        assert r.stats["lora_merged_bytes"] == sum(t.numel() * t.element_size() for t in alone if t is not None)
        q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
        assert adapters.merged[id(q_proj)][0].data_ptr() == fused[0]["qkv"].data_ptr()
    randomize(model, 3, 0.1)  # the adapters trained in place: the next rollout decodes them
    torch.manual_seed(6)
    again = r.generate(ids, mask)
    assert (forward_logprobs(model, again, mask) - again.logprobs).abs().max().item() < 1e-5
    assert (again.logprobs - out.logprobs).abs().max().item() > 1e-3
