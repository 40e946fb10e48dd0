"""The demo assets: the built-in tiny default (``tiny``: tokenizer, SFT policy, reward model) and
the bundled synthetic tasks on its text (``synthetic``). Not the core: only the scripts, the examples
and the tests import it (the scripts give its models and data when none is named). The bundled text is read here, so that ``tiny`` (whose
reward model learns ``synthetic``'s pairs) and ``synthetic`` (whose tasks use the text's words)
import it without importing each other both ways."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def corpus() -> list[str]:
    """The bundled text, one line a sentence."""
    return (DATA / "tiny_corpus.txt").read_text().splitlines()


def words() -> dict[str, list[str]]:
    """The text's positive and negative adjectives and its subjects."""
    out = {}
    for line in (DATA / "words.txt").read_text().splitlines():
        key, value = line.split(": ", 1)
        out[key] = value.split("|") if key == "subjects" else value.split()
    return out
