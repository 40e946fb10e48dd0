"""tests/test_dpo.py's two-process checks in one launch (one start-up): the runs of dpo_parity.py, dpo_train.py
and dpo_sync.py one after another, each on its own Sessions, each writing OUT_DIR/<name>.json as its own launch
would (rank 0)."""

import sys
from pathlib import Path

# tests/dist is this script's directory: the three scripts' runs are reused, not copied.
import dpo_parity
import dpo_sync
import dpo_train


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, script in (("parity", dpo_parity), ("train", dpo_train), ("sync", dpo_sync)):
        script.main(str(out / f"{name}.json"), str(out / name))


if __name__ == "__main__":
    main(*sys.argv[1:])
