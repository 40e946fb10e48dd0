"""Where posttrain deliberately differs from TRL: the position ids of left-padded prompts.

posttrain's GRPO/RLOO forwards pass ``position_ids`` from the attention mask (as generation
does); TRL 1.16's ``_get_per_token_logps_and_entropies`` passes none, so a model with learned
absolute positions (GPT-2) sees a shorter prompt's tokens at positions shifted by its left
padding, which depends on the other prompts of the batch (and so on the number of ranks). Here a
tiny GPT-2: posttrain's log-probs and loss do not change with extra left padding; TRL's forward
does (rotary models such as the tiny default are unaffected either way)."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from posttrain.demo import tiny
from posttrain.trainers.grpo import GRPOConfig, completion_logps, grpo_loss

T = 0.9


@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config
    from trl.trainer.utils import add_fused_lm_head

    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    add_fused_lm_head(model, temperature=T, outputs=("log_probs", "entropy"))  # as both trainers' policy
    return model, tok


def batch(tok, extra: int):
    """Two prompts of different lengths, left-padded to the longest plus ``extra`` columns, and
    their completions right-padded."""
    prompts = [tok("the cat is")["input_ids"], tok("my old friend felt very")["input_ids"]]
    completions = [[40, 41, 42, tok.eos_token_id], [50, 51, tok.eos_token_id]]
    width, n = max(map(len, prompts)) + extra, max(map(len, completions))
    ids = torch.full((2, width + n), tok.pad_token_id)
    mask = torch.zeros((2, width + n), dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, width - len(p) : width], mask[r, width - len(p) : width] = torch.tensor(p), 1
        ids[r, width : width + len(c)], mask[r, width : width + len(c)] = torch.tensor(c), 1
    return ids, mask, n


def trl_logps(model, ids, mask, n):
    from trl import GRPOTrainer

    forward = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__  # TRL's own forward, no position ids
    logps, _, _ = forward(SimpleNamespace(accelerator=SimpleNamespace(autocast=nullcontext)), model, ids, mask, n)
    return logps


def test_left_padding_does_not_move_posttrains_loss(gpt2):
    model, tok = gpt2
    cfg = GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, temperature=T)
    advantages = torch.tensor([0.7, -0.7])
    ours, theirs, losses = [], [], []
    for extra in (0, 3):
        ids, mask, n = batch(tok, extra)
        cmask = mask[:, -n:]
        with torch.no_grad():
            logps, _ = completion_logps(model, ids, mask, n, T, fused=True)
            old = logps + 0.05 * cmask
            loss, _ = grpo_loss(cfg, logps, old, None, advantages, cmask, num_items_in_batch=cmask.sum())
            ours.append(logps)
            theirs.append(trl_logps(model, ids, mask, n) * cmask)
            losses.append(loss.item())
    assert torch.allclose(ours[0], ours[1], atol=1e-5)
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    # TRL's forward: the same rows give other log-probs once the batch is padded further.
    assert (theirs[0] - theirs[1]).abs().max() > 1e-2
    # Without extra padding the longest prompt starts at position 0 either way: there both agree.
    assert torch.allclose(ours[0][1], theirs[0][1], atol=1e-5)
