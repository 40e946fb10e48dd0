"""posttrain's Triton sampler (posttrain/rollout/kernels/sample.py), run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1, set by conftest before Triton is imported): the tokens of
``sampling.choose_tokens`` and its log-probs, whatever the chunking; compiled for an H200 with
logical shifts (the noise hash's bits are the 64-bit one's)."""

import pytest
import torch

from posttrain.rollout.kernels import sample as triton_sample
from posttrain.rollout.sampling import choose_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, stops, do_sample, min_new, temperature, block", [
    (4, 3000, None, 1.0, 0, 1.0, 1024),  # one chunk, the last block partial
    (4, 3000, None, 1.0, 0, 1.0, 128),  # six chunks
    (3, 5000, [1, 7, 4095], 1.0, 5, 0.7, 128),  # stop tokens barred on rows before min_new, not after
    (5, 2500, [2], 0.0, 0, 1.3, 128),  # greedy: the argmax of the scaled logits
    (2, 1024, None, 1.0, 0, 1.0, 512),
])
def test_the_kernel_samples_what_choose_tokens_samples(dtype, rows, vocab, stops, do_sample, min_new, temperature,
                                                       block, monkeypatch):
    monkeypatch.setattr(triton_sample, "BLOCK_V", block)
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    stop_ids = torch.tensor(stops) if stops else None
    stop_mask = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, stop_ids, True) if stops else None
    if stops:
        logits[:, stops[0]] = 50.0  # rows past min_new choose it
    step = torch.tensor([0, 3, 7, 9, 12][:rows])
    seq = torch.tensor([5, 0, 2, 9, 1][:rows])
    key = torch.tensor(2**40 + 1234567)  # above 2**32: the kernel keeps the low bits, as the hash does
    knobs = dict(temperature=torch.tensor(temperature), do_sample=torch.tensor(do_sample))
    want, want_logp = choose_tokens(logits, step, key, seq=seq, min_new_tokens=torch.tensor(min_new),
                                    stop_ids=stop_ids, use_top_p=False, **knobs)
    tokens, logp = triton_sample.choose_tokens(logits, step, key, seq, knobs["temperature"], knobs["do_sample"],
                                               torch.tensor(min_new), stop_mask)
    assert torch.equal(tokens, want)
    assert (logp - want_logp).abs().max().item() < 1e-5
    if stops:
        early = step < min_new
        assert not torch.isin(tokens[early], stop_ids).any() and (tokens[~early] == stops[0]).all()


def test_ties_go_to_the_first_index_across_blocks_and_chunks(monkeypatch):
    """Greedy over logits whose maximum repeats in later blocks and chunks: ``argmax``'s first."""
    monkeypatch.setattr(triton_sample, "BLOCK_V", 16)
    logits = torch.zeros(2, 200)
    logits[0, [37, 90, 150]] = 1.0
    logits[1, [5, 6]] = 2.0
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    tokens, _ = triton_sample.choose_tokens(logits, torch.zeros(2, dtype=torch.long), torch.tensor(0),
                                            torch.arange(2), one, zero, zero.long(), None)
    assert tokens.tolist() == [37, 5] and triton_sample.chunks_for(200) == 4
    monkeypatch.setattr(triton_sample, "chunks_for", lambda vocab: 1)  # one chunk of 13 blocks
    tokens, _ = triton_sample.choose_tokens(logits, torch.zeros(2, dtype=torch.long), torch.tensor(0),
                                            torch.arange(2), one, zero, zero.long(), None)
    assert tokens.tolist() == [37, 5]


AHEAD_OF_TIME = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from posttrain.rollout.kernels import sample as ts

fn = ts._partial
c = dict(CHUNKS=8, BLOCK_V=1024, HAS_STOP=True)
kinds = {"logits_ptr": "*bf16", "key_ptr": "*i64", "step_ptr": "*i64", "seq_ptr": "*i64", "min_new_ptr": "*i64",
         "index_ptr": "*i64", "stop_ptr": "*i1"}
sig = {n: "constexpr" if n in c else kinds.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(sorted(set(re.findall(r"\bshr\.[su]32", k.asm["ptx"]))))
"""


def test_the_sampler_compiles_for_an_h200_with_logical_shifts(tmp_path):
    """The hash's right shifts are logical (uint32), as the masked 64-bit hash's are: an
    arithmetic shift would change the noise's bits on the GPU, which the interpreter (numpy's
    uint32) would not show."""
    from conftest import compile_ahead_of_time

    out = compile_ahead_of_time(AHEAD_OF_TIME, tmp_path)
    assert out.strip().splitlines()[-1] == "['shr.u32']", out


def test_cublaslt_is_preferred_only_inside_the_engines_scope(monkeypatch):
    """``engine.preferred_blas``: set for the engine's compile, warm-up and capture, the previous
    library back after (an error inside too); None leaves it alone. The engine asks for it on CUDA
    only; on the CPU its stats say "default"."""
    from test_rollout import build, rollout

    from posttrain.demo import tiny
    from posttrain.rollout.engine import preferred_blas

    current = ["cublas"]
    calls = []

    def library(backend=None):
        if backend is not None:
            calls.append(backend)
            current[0] = backend
        return current[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    with preferred_blas("cublaslt"):
        assert current == ["cublaslt"]
    assert current == ["cublas"]
    with pytest.raises(ValueError), preferred_blas("cublaslt"):
        raise ValueError
    assert current == ["cublas"] and calls == ["cublaslt", "cublas", "cublaslt", "cublas"]
    with preferred_blas(None):
        pass
    assert len(calls) == 4
    tok = tiny.load_tokenizer()
    r = rollout(build("llama", tok), tok)
    enc = tok(["the cat sat"], return_tensors="pt")
    r.generate(enc["input_ids"], enc["attention_mask"])
    assert r.engine.blas is None and r.stats["blas"] == "default" and len(calls) == 4


def test_a_key_per_row_samples_each_row_as_its_own_key_would():
    """The engine's step passes each slot's own key (a stream's rows come from batches with different keys):
    row i's token is the one the kernel (and ``choose_tokens``) draws for row i with key i alone."""
    torch.manual_seed(1)
    logits = torch.randn(3, 3000) * 3
    step, seq = torch.tensor([0, 4, 9]), torch.tensor([2, 0, 1])
    keys = torch.tensor([11, 2**33 + 5, 77])
    knobs = (torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0), None)
    tokens, logp = triton_sample.choose_tokens(logits, step, keys, seq, *knobs)
    want, want_logp = choose_tokens(logits, step, keys, seq=seq, temperature=torch.tensor(1.0),
                                    do_sample=torch.tensor(1.0), use_top_p=False)
    assert torch.equal(tokens, want) and (logp - want_logp).abs().max().item() < 1e-5
    for i in range(3):
        alone, _ = triton_sample.choose_tokens(logits[i:i + 1], step[i:i + 1], keys[i], seq[i:i + 1], *knobs)
        assert alone.item() == tokens[i].item()
    assert len({triton_sample.choose_tokens(logits[:1], step[:1], k, seq[:1], *knobs)[0].item()
                for k in (keys[0], keys[1], keys[2])}) > 1  # the key matters
