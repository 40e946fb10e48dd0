"""Demo assets, not the core (only scripts, examples and tests import them): the tiny default models
(``tiny``) and synthetic tasks on the bundled text (``synthetic``), which is read here."""

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
