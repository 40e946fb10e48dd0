"""GRPO with a tool on the tiny default, one process on CPU (the code: posttrain/scripts/grpo.py with
`--tools`, also installed as `posttrain grpo --tools posttrain.demo.tool_task:add`).

    python examples/grpo_tools.py                      # the tiny default's tool task, then its figure
    python examples/grpo_tools.py --max_steps 10       # any flag of `posttrain grpo`

The task (posttrain/demo/tool_task.py): "add A and B" for digits A and B, reward 1 where the last answer is
the sum, which the tiny model can only get through the `add` tool. The policy is the tiny default
warm-started (once, cached) on demonstrations where 3 answers in 10 call the tool and the rest guess; GRPO
then learns to call it. The run ends with `tool_learning.png` in its output dir: steps against reward and
tool calls per completion, from its metrics.jsonl.
"""

import json
import sys
from pathlib import Path

from posttrain.scripts.args import run_script
from posttrain.scripts.grpo import main

TOOLS = ["--tools", "posttrain.demo.tool_task:add"]


def figure(output_dir: str) -> Path | None:
    """Steps against reward and tool calls per completion, from the run's metrics.jsonl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra
        return None
    rows = [json.loads(line) for line in Path(output_dir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tools/call_frequency" in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [r["reward"] for r in rows], label="reward (1 per answered call, +1 for the sum)")
    ax.plot(steps, [r["tools/call_frequency"] for r in rows], label="tool calls per completion")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.05, 1.3)
    ax.legend(loc="upper left")
    ax.set_title("tiny default learning to call `add` (CPU)")
    fig.tight_layout()
    path = Path(output_dir, "tool_learning.png")
    fig.savefig(path, dpi=110)
    return path


def run(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    main(TOOLS + argv)
    output_dir = argv[argv.index("--output_dir") + 1] if "--output_dir" in argv else "runs/grpo_tools"
    path = figure(output_dir)
    if path is not None:
        print(f"  figure: {path}")


if __name__ == "__main__":
    raise SystemExit(run_script(run))
