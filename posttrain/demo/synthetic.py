"""Synthetic tasks on the tiny corpus's vocabulary ("<subject> is <adj> and <adj> ."): prefer the
positive adjectives. Each generator is seeded, so a held-out split is just another seed."""

from __future__ import annotations

import random

from posttrain.demo import words


def prompts(n: int, seed: int = 0) -> list[str]:
    """Prompts that the corpus continues with adjectives: "<subject> is" or "<subject> felt"."""
    rng, w = random.Random(seed), words()
    return [f"{rng.choice(w['subjects'])} {rng.choice(['is', 'felt'])}" for _ in range(n)]


def _continuation(rng: random.Random, verb: str, adjs: list[str]) -> str:
    if verb == "is":
        a, b = rng.sample(adjs, 2)
        return f" {a} and {b} ."
    return f" {rng.choice(adjs)} today ."


def preference_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """TRL's standard preference format: prompt, chosen (positive), rejected (negative)."""
    rng, w = random.Random(seed), words()
    rows = []
    for _ in range(n):
        verb = rng.choice(["is", "felt"])
        prompt = f"{rng.choice(w['subjects'])} {verb}"
        rows.append({"prompt": prompt, "chosen": _continuation(rng, verb, w["positive"]),
                     "rejected": _continuation(rng, verb, w["negative"])})
    return rows


def sentiment_score(text: str) -> float:
    """The bundled reward function: positive adjectives minus negative ones, in [-2, 2]."""
    w = words()
    pos, neg = set(w["positive"]), set(w["negative"])
    tokens = text.replace(".", " ").split()
    score = sum(t in pos for t in tokens) - sum(t in neg for t in tokens)
    return float(max(-2, min(2, score)))


def sentiment_reward(completions: list[str], **_: object) -> list[float]:
    """``sentiment_score`` in the signature of a TRL reward function."""
    return [sentiment_score(c) for c in completions]
