"""A tiny tool task for the tiny default: "add A and B" for digits A and B, with an ``add`` tool. The reward
counts a call the tool answers, and the right sum as the last answer (the tiny model cannot add or copy
well). ``warm_start`` fine-tunes the tiny default briefly on demonstrations where a share ``call_rate`` of
the answers call the tool and the rest guess, so a tool call is within the policy's reach; GRPO with
``tools=[add]`` then has to learn to call it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from posttrain.demo import tiny
from posttrain.demo.tool_chat import with_tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows: a conversational prompt and its digits (columns the reward reads)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": [{"role": "user", "content": f"add {a} and {b}"}], "a": a, "b": b})
    return rows


class Calculator:
    """The task as an environment (``environment_factory=``): ``add`` is its tool and ``get_reward`` counts
    calls with the prompt's digits, the environment's own reward (TRL's)."""

    def reset(self, a: int = 0, b: int = 0, **row: Any) -> None:
        self.digits, self.right = {a, b}, 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.right += {a, b} == self.digits
        return a + b

    def get_reward(self) -> float:
        return float(self.right > 0)


def final_answer(completion: list[dict]) -> str:
    """The conversation's last assistant text."""
    said = [m for m in completion if m["role"] == "assistant"]
    return str(said[-1]["content"]).strip() if said else ""


def answer_reward(completions: list[list[dict]], a: list[int], b: list[int], **kwargs: Any) -> list[float]:
    """1 where the tool answered a call (a well-formed call to ``add`` with fitting arguments), and 1 more
    where the last assistant message is the sum."""
    out = []
    for c, x, y in zip(completions, a, b, strict=True):
        answered = any(m["role"] == "tool" and "error" not in str(m["content"]) for m in c)
        out.append(float(answered) + float(final_answer(c) == str(x + y)))
    return out


def demonstrations(n: int, call_rate: float, seed: int = 0) -> list[dict[str, str]]:
    """Rendered conversations (``text`` rows): with probability ``call_rate`` the assistant calls ``add``
    and repeats its result, else it guesses a number."""
    tok = with_tools(tiny.load_tokenizer())
    rng = random.Random(seed)
    rows = []
    for row in prompts(n, seed):
        a, b = row["a"], row["b"]
        if rng.random() < call_rate:
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
            turns = [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "add", "content": str(a + b)},
                     {"role": "assistant", "content": str(a + b)}]
        else:
            turns = [{"role": "assistant", "content": str(rng.randrange(19))}]
        rows.append({"text": tok.apply_chat_template(row["prompt"] + turns, tools=[add], tokenize=False)})
    return rows


CALL_RATE, WARM_STEPS = 0.3, 150  # the warm start's share of tool-calling demonstrations and its steps


def policy_path(seed: int = 0) -> Path:
    """The warm-started policy GRPO starts from (built once into posttrain's cache, as the tiny default)."""
    return tiny._resolve(f"tools-sft-s{seed}-n{WARM_STEPS}", lambda path: warm_start(path, seed=seed),
                         "the tiny default warm-started on tool demonstrations")


def warm_start_trainer(workdir: str | Path, call_rate: float = CALL_RATE, steps: int = WARM_STEPS, seed: int = 0
                       ) -> Any:
    """posttrain's SFTTrainer from the tiny default on :func:`demonstrations` (the demo recipe), not yet run."""
    from posttrain.demo.recipes import RECIPE
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    cfg = SFTConfig(output_dir=str(Path(workdir) / "run"), seed=seed, max_steps=steps, max_length=128,
                    overwrite_output_dir=True, **RECIPE)
    rows = demonstrations(RECIPE["per_device_train_batch_size"] * steps, call_rate, seed)
    return SFTTrainer(str(tiny.sft_model_path()), args=cfg, train_dataset=rows,
                      processing_class=with_tools(tiny.load_tokenizer()))


def warm_start(output_dir: str | Path, call_rate: float = CALL_RATE, steps: int = WARM_STEPS, seed: int = 0
               ) -> Path:
    """Train :func:`warm_start_trainer` and save the policy with its tokenizer and its losses (as the tiny
    default's assets, checked by tests/test_grpo_tools.py); its folder."""
    import json
    import tempfile

    from posttrain.demo.recipes import final_loss

    output_dir = Path(output_dir)
    with tempfile.TemporaryDirectory(prefix="posttrain-tools-sft-") as work:
        trainer = warm_start_trainer(work, call_rate, steps, seed)
        trainer.train()
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        model = trainer.session.unwrap("policy")
        final = final_loss(model, trainer)
        model.save_pretrained(output_dir)
        with_tools(tiny.load_tokenizer()).save_pretrained(output_dir)
        trainer.end()
    (output_dir / "train_losses.json").write_text(json.dumps({"losses": losses, "final_first_batch": final}))
    return output_dir
