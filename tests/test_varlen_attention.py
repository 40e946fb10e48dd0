"""posttrain's "varlen" attention (posttrain/models/varlen_attention.py): on CPU its per-document path gives
sdpa's loss and gradients on the block mask (fp32, padding-free rows of mixed lengths) and a padded
batch's; the kernel call adapts to torch 2.10/2.11/2.12 signatures; SFT picks it for padding-free
rows on CUDA only."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from posttrain.data import sft as sft_data
from posttrain.demo import tiny
from posttrain.models import varlen_attention as va
from posttrain.trainers.sft import SFTConfig, SFTTrainer

LENGTHS = [5, 17, 3, 30, 11, 1]
BOUNDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def batches() -> tuple[dict, dict]:
    """The same token rows of mixed lengths: (padding-free, padded)."""
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(5, 400, (n,), generator=gen).tolist()), "labels": ids} for n in LENGTHS]
    tok = tiny.load_tokenizer()
    return sft_data.collator(tok, True)(rows), sft_data.collator(tok, False)(rows)


def loss_and_grads(attn: str, batch: dict, drop: tuple[str, ...] = ()) -> tuple[float, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    va.register()
    model = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_idx", *drop)}
    out = model(**inputs, labels=batch["labels"], use_cache=False)
    out.loss.backward()
    return out.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_varlen_equals_sdpa_block_mask_and_padded():
    """Loss and every gradient: varlen on a padding-free row (bounds from the collator, or from the
    position ids alone) = sdpa with transformers' block mask = a padded batch (varlen unpads it)."""
    flat, padded = batches()
    ref_loss, ref_grad = loss_and_grads("sdpa", flat)
    scale = ref_grad.abs().max().item()
    for attn, batch, drop in [("varlen", flat, ()), ("varlen", flat, BOUNDS), ("varlen", padded, ()),
                              ("sdpa", padded, ())]:
        loss, grad = loss_and_grads(attn, batch, drop)
        assert loss == pytest.approx(ref_loss, abs=1e-5), (attn, drop)
        assert (grad - ref_grad).abs().max().item() <= 1e-5 * max(scale, 1.0), (attn, drop)


def test_generate_equals_sdpa():
    """A left-padded batch with a cache (the prefill unpads, each decoded token takes the dense
    fallback): the same greedy tokens as sdpa."""
    from transformers import AutoModelForCausalLM

    va.register()
    tok = tiny.load_tokenizer()
    tok.padding_side = "left"
    enc = tok(["the cat sat on", "a dog"], return_tensors="pt", padding=True)
    outs = []
    for attn in ("sdpa", "varlen"):
        model = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32,
                                                     attn_implementation=attn)
        outs.append(model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id))
    assert torch.equal(outs[0], outs[1])


def _reference(q, k, v, cu, scale, causal):
    return va._per_document(q, k, v, cu, cu, scale, causal, 0.0)


@pytest.mark.parametrize("version", ["2.10", "2.11", "2.12"])
def test_kernel_call_adapts_to_the_signature(monkeypatch, version):
    """torch 2.10 (is_causal, no scale), 2.11 (window_size, scale, no GQA) and 2.12 (enable_gqa):
    each gets the arguments it takes, grouped-query heads repeated and a custom scale folded in
    where the kernel cannot take them. The fake kernels compute per-document SDPA with what they get."""
    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert key.shape[1] == query.shape[1]
        return _reference(query, key, value, cu_seq_q, query.shape[-1] ** -0.5, is_causal)

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1]
        return _reference(query, key, value, cu_seq_q, scale, tuple(window_size) == (-1, 0))

    def v212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert enable_gqa == (key.shape[1] != query.shape[1])
        return _reference(query, key, value, cu_seq_q, scale, tuple(window_size) == (-1, 0))

    fn = {"2.10": v210, "2.11": v211, "2.12": v212}[version]
    monkeypatch.setattr(va, "_kernel", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    for scale, causal in [(8 ** -0.5, True), (0.3, True), (0.3, False)]:
        got = va._kernel_attention(q, k, v, cu, cu, 12, 12, scale, causal)
        torch.testing.assert_close(got, _reference(q, k, v, cu, scale, causal), atol=1e-5, rtol=1e-5)


def test_per_document_is_block_diagonal_sdpa():
    """The CPU path against SDPA on an explicit block-diagonal causal mask, grouped-query heads."""
    torch.manual_seed(1)
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    cu = torch.tensor([0, 3, 4, 16], dtype=torch.int32)
    doc = torch.repeat_interleave(torch.arange(3), cu.diff())
    mask = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(va._per_document(q, k, v, cu, cu, 8 ** -0.5, True, 0.0), dense)


def test_sliding_window_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no sliding window.*attn_implementation 'sdpa'"):
        va.varlen_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=2)


def test_choose(monkeypatch):
    """posttrain's default: varlen for padding-free rows when the kernel runs, no attention was asked
    and the model has no sliding window, softcap or attention dropout; else the kwargs stay as given."""
    from transformers import LlamaConfig, MistralConfig

    llama = LlamaConfig()
    kwargs = {"dtype": "float32"}
    assert va.choose(kwargs, llama, True, "cpu") is None and kwargs == {"dtype": "float32"}  # no kernel on CPU
    monkeypatch.setattr(va, "kernel_available", lambda device: True)
    line = va.choose(kwargs, llama, True, "cuda")
    assert kwargs["attn_implementation"] == "varlen" and "attention 'varlen'" in line and "sdpa" in line
    for given, config, packed in [({"attn_implementation": "sdpa"}, llama, True), ({}, llama, False),
                                  ({}, MistralConfig(sliding_window=16), True),
                                  ({}, LlamaConfig(attention_dropout=0.1), True)]:
        before = dict(given)
        assert va.choose(given, config, packed, "cuda") is None and given == before
    assert va.unsupported(MistralConfig(sliding_window=16)) == "its sliding-window attention"
    assert va.unsupported(MistralConfig(sliding_window=None)) is None


def test_sft_trainer_with_varlen_equals_sdpa(tmp_path):
    """posttrain's SFTTrainer, padding-free, attn_implementation varlen in model_init_kwargs: the
    same step loss and eval loss as sdpa (fp32, CPU: the per-document path)."""
    rows = [{"text": line} for line in tiny.corpus()[:16]]
    results = {}
    for attn in ("sdpa", "varlen"):
        cfg = SFTConfig(output_dir=str(tmp_path / attn), padding_free=True, max_length=None, max_steps=1, seed=0,
                        model_init_kwargs={"attn_implementation": attn})
        trainer = SFTTrainer(str(tiny.model_path()), args=cfg, train_dataset=rows, eval_dataset=rows[:8])
        assert trainer.session.unwrap("policy").config._attn_implementation == attn
        step = trainer.optimizer_step([trainer.collate(trainer.train_rows[:8])])
        results[attn] = (step["loss"], trainer.evaluate()["eval/loss"])
    assert results["varlen"] == pytest.approx(results["sdpa"], abs=1e-5)
