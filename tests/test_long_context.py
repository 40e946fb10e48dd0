"""Long completions: log-probs through the output layer in chunks (never the [tokens, vocab] logits) equal the
full logits' values, entropies and gradients (fp32 CPU, within 1e-5), and activation checkpointing on a packed
row of a few thousand tokens equals the forward without it."""

import pytest
import torch

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


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=TOL * max(1.0, b[name].abs().max().item()), rtol=1e-4,
                                   msg=name)


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
