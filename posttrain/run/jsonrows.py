"""Rows of ``metrics.jsonl``/``samples.jsonl``: strict JSON at full precision; non-finite floats kept."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

NONFINITE = "nonfinite"


def dumps_row(row: dict[str, Any]) -> str:
    """One line of strict JSON for ``row`` (non-finite floats as null, named under "nonfinite")."""
    out: dict[str, Any] = {}
    nonfinite: dict[str, str] = {}
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            nonfinite[key] = repr(value)  # "nan", "inf", "-inf": float() reads them back
        else:
            out[key] = value
    if nonfinite:
        out[NONFINITE] = nonfinite
    return json.dumps(out, allow_nan=False, default=_plain)


def loads_row(line: str) -> dict[str, Any]:
    """A row written by :func:`dumps_row` (or by an older posttrain, with bare NaN), floats restored."""
    row = json.loads(line)
    for key, text in row.pop(NONFINITE, {}).items():
        row[key] = float(text)
    return row


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every complete row of a ``.jsonl`` file ([] if none); a last line cut short is left out."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(loads_row(line))
            except json.JSONDecodeError:
                continue
    return rows


def _plain(value: Any) -> Any:
    # A 0-d tensor or NumPy scalar logged as is: its Python number (non-finite ones as null).
    if hasattr(value, "item"):
        number = value.item()
        return number if not isinstance(number, float) or math.isfinite(number) else None
    return str(value)
