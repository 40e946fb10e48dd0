"""Several of ppo_run.py's runs in one launch (one start-up): RUNS is JSON {name: overrides}, run in that order,
each a trainer of its own writing OUT_DIR/<name>.json as ppo_run.py would (rank 0)."""

import json
import sys
from pathlib import Path

# tests/dist is this script's directory: ppo_run.py's run is reused, not copied.
import ppo_run


def main(out_dir: str, runs: str) -> None:
    for name, overrides in json.loads(runs).items():
        ppo_run.main(str(Path(out_dir) / f"{name}.json"), json.dumps(overrides))


if __name__ == "__main__":
    main(*sys.argv[1:])
