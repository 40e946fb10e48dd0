"""A random-weight model whose turns have a fixed length, for the multi-turn benchmarks (issue 38).

With random weights a model never ends a turn or calls a tool by itself. The turn structure is therefore
put where both trainers read it the same way, without touching either trainer's generation loop:

- **The turn length is in the weights.** Every layer's output projections (attention ``o_proj`` and MLP
  ``down_proj``) are zero, so the residual stream at the head is the input token's embedding and the
  next token depends on the last token alone; the attention and MLP still run in full (their compute and
  memory are the random model's). The embeddings of a chain of tokens are orthogonal basis vectors and the
  head maps the generation prompt's last token (``<|assistant|>``) to ``width`` equally likely tokens of a
  first set, each set to the next (``width`` choices each, so completions and rewards differ), and the
  last set to the EOS token: every turn is exactly ``turn_tokens`` sampled tokens ending in EOS, whichever
  sampler draws them (TRL's ``generate`` or posttrain's engine). A tool result ends in the generation
  prompt, so the next turn runs the same chain.
- **The tool call is in the response parser.** A character-level vocabulary cannot spell a tool call as a
  first-order chain (its characters repeat), so ``trl.chat_template_utils.parse_response`` — the one
  function both TRL's ``_tool_call_loop`` and posttrain's ``tools.ToolUse.on_turn_end`` call on each ended
  turn — is wrapped to add one fixed call of :func:`probe` to each parsed assistant turn. Each side's
  ``max_tool_calling_iterations = calls`` then ends every sequence after exactly ``calls`` tool calls.
- **The tool** (:func:`probe`) returns text whose rendered result (TRL's ``_get_tool_suffix_ids``) is
  ``result_tokens`` long (:func:`probe_text` calibrates it on the tokenizer).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

EOS, ASSISTANT = 1, 4  # the tiny tokenizer's <|endoftext|> and <|assistant|> ids
FIRST_CHAIN_ID = 100  # chain tokens: plain characters of the tiny vocabulary
PROBE_TEXT = {"text": "ok"}  # set by install(): what probe() returns
CALL = {"type": "function", "function": {"name": "probe", "arguments": {"turn": 1}}}


def probe(turn: int) -> str:
    """Looks something up for the current turn.

    Args:
        turn: the turn the model is in.
    """
    return PROBE_TEXT["text"]


def tokenizer() -> Any:
    from posttrain.demo import tiny, tool_chat

    return tool_chat.with_tools(tiny.load_tokenizer())


def suffix_ids(tok: Any, text: str) -> list[int]:
    """The tokens a tool result ``text`` appends (TRL's ``_get_tool_suffix_ids`` rendering)."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(dummy + [{"role": "tool", "name": "probe", "content": text}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    eos = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
    return list(full[eos[-1] + 1 if eos else len(prefix):])


def suffix_len(tok: Any, text: str) -> int:
    return len(suffix_ids(tok, text))


def probe_text(tok: Any, result_tokens: int) -> str:
    """A tool result rendering to ``result_tokens`` tokens (or the nearest above)."""
    words = "the tool found these values for the turn ".split()
    text = ""
    k = 0
    while suffix_len(tok, text) < result_tokens:
        text += ("" if not text else " ") + words[k % len(words)]
        k += 1
    while text and suffix_len(tok, text[:-1]) >= result_tokens:
        text = text[:-1]
    return text


def chain_ids(turn_tokens: int, width: int) -> list[list[int]]:
    """The sets of tokens at each position of a turn but its last (EOS)."""
    return [[FIRST_CHAIN_ID + k * width + j for j in range(width)] for k in range(turn_tokens - 1)]


@torch.no_grad()
def script_weights(model: torch.nn.Module, turn_tokens: int, width: int, logit: float = 40.0) -> None:
    """Make ``model`` (a Llama) end every turn after ``turn_tokens`` tokens (module docstring)."""
    sets = chain_ids(turn_tokens, width)
    chain = [ASSISTANT, EOS, *[t for s in sets for t in s]]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    d = embed.shape[1]
    if len(chain) > d or max(chain) >= embed.shape[0]:
        raise ValueError(f"a turn of {turn_tokens} tokens x {width} choices needs {len(chain)} orthogonal "
                         f"embeddings; the model has {d} dimensions and {embed.shape[0]} ids")
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    basis = {t: i for i, t in enumerate(chain)}
    for t, i in basis.items():
        embed[t].zero_()
        embed[t, i] = d ** 0.5  # the final RMSNorm makes it the unit vector times sqrt(d)
    scale = logit / d ** 0.5
    order = [[ASSISTANT], *sets, [EOS]]
    for prev, nxt in zip(order, order[1:]):
        row = torch.zeros(d, dtype=head.dtype, device=head.device)
        for t in prev:
            row[basis[t]] = scale
        for t in nxt:
            head[t] = row


def model_dir(shape: str, dtype: torch.dtype, turn_tokens: int, width: int) -> Path:
    """The preset's random model (benchmarks/harness/bench_models.py) with scripted turns, saved once,
    with the tool-calling tokenizer."""
    from filelock import FileLock

    from benchmarks.harness import bench_models
    from posttrain.planner import shapes

    base = bench_models.model_dir(shape, dtype)
    path = base.parent / f"{base.name}-turns{turn_tokens}x{width}"
    with FileLock(str(path.parent / f"{path.name}.lock")):
        if not (path / "config.json").exists():
            model = shapes.model_class("causal").from_pretrained(str(base), dtype=dtype)
            script_weights(model, turn_tokens, width)
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(str(tmp))
            tokenizer().save_pretrained(str(tmp))
            tmp.rename(path)
            del model
    return path


def install(result_tokens: int) -> str:
    """Wrap ``parse_response`` (both trainers' tool-call parser) and calibrate :func:`probe`; the tool text."""
    import trl.chat_template_utils as ctu
    import trl.trainer.grpo_trainer as trl_grpo

    PROBE_TEXT["text"] = probe_text(tokenizer(), result_tokens)
    real = getattr(ctu.parse_response, "__wrapped__", ctu.parse_response)

    def parse_response(*args: Any, **kwargs: Any) -> dict:
        message = dict(real(*args, **kwargs))
        message["tool_calls"] = [dict(CALL)]
        return message

    parse_response.__wrapped__ = real
    ctu.parse_response = parse_response
    trl_grpo.parse_response = parse_response
    return PROBE_TEXT["text"]

