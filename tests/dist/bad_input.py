"""Bad input on two ranks, one launch (tests/test_bad_input.py). Usage: OUT RUN_DIR MODEL NO_CONFIG_MODEL.

Each rank runs a few bad command lines in process (their sentences recorded in OUT.<rank>.json; any
model load fails the run), then a last one through the script's own exit, as a user's run ends:
the launcher's output must show that sentence once, and RUN_DIR (a finished run the last command
would overwrite) must be intact."""

import json
import os
import sys
import time

from transformers import PreTrainedModel

from posttrain import cli
from posttrain.scripts import args


def refuse(*a, **k):
    raise AssertionError("a model was loaded before the bad input was reported")


def main(out: str, run: str, model: str, no_config: str) -> int:
    PreTrainedModel.from_pretrained = classmethod(refuse)
    PreTrainedModel._from_config = classmethod(refuse)
    scratch = f"{out}-scratch"
    cases = [["dpo", "--output_dir", scratch, "--learning_rate", "-1e-3"],
             ["dpo", "--output_dir", scratch, "--model_name_or_path", no_config],
             ["ppo", "--output_dir", scratch, "--model_name_or_path", model]]
    said, report = [], args.report_error
    args.report_error = lambda err: said.append(str(err)) or 2
    codes = [cli.main(c) for c in cases]
    args.report_error = report
    assert codes == [2] * len(cases) and not os.path.exists(scratch), (codes, said)
    with open(f"{out}.{os.environ['RANK']}.json", "w") as f:
        json.dump(said, f)
    # The last case exits at once, and torchrun then stops every other rank: wait until each rank has
    # written its record (a file barrier: no process group exists before the script's checks).
    others = [f"{out}.{r}.json" for r in range(int(os.environ["WORLD_SIZE"]))]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    return cli.main(["dpo", "--output_dir", run, "--overwrite_output_dir", "true", "--mix", "zero2-zero4"])


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
