"""Several two-process check scripts of tests/dist in one launch (one start-up), for conftest.launched_together:
``together.py OUT_DIR SCRIPT...`` runs each script's ``main(OUT_DIR/SCRIPT.json, OUT_DIR/SCRIPT)`` in turn, each its
own trainers and JSON, as its own launch would."""

import importlib
import sys
from pathlib import Path


def main(out_dir: str, *scripts: str) -> None:
    out = Path(out_dir)
    for name in scripts:
        importlib.import_module(name).main(str(out / f"{name}.json"), str(out / name))


if __name__ == "__main__":
    main(*sys.argv[1:])
