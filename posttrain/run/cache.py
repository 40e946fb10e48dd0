"""Where posttrain keeps what it builds (the tiny default's assets, DeepSpeed's JIT-compiled ops), never
inside the installed package. Imports nothing heavy: ``posttrain/__init__`` uses it first."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def source_checkout() -> Path | None:
    """The repository root when posttrain runs from a clone (editable install or PYTHONPATH), else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def cache_dir() -> Path:
    """``$POSTTRAIN_CACHE``, else ``<clone>/.cache/posttrain``, else the XDG/``~/.cache`` posttrain dir."""
    if os.environ.get("POSTTRAIN_CACHE"):
        return Path(os.environ["POSTTRAIN_CACHE"]).expanduser()
    checkout = source_checkout()
    if checkout is not None:
        return checkout / ".cache" / "posttrain"
    user_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(user_cache).expanduser() / "posttrain"


def torch_extensions_dir() -> Path:
    """Where torch builds DeepSpeed's ops: a user-set ``TORCH_EXTENSIONS_DIR``, else inside ``cache_dir()``."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    # A per-environment folder, or two venvs sharing the cache rebuild over each other's ops.
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    # "+" is replaced: the folder name goes into compiler command lines.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_version.replace('+', '_')}"
    return cache_dir() / "torch_extensions" / tag
