"""Several machines: the same DPO run launched as two machines of one process each (torchrun's
static rendezvous, --nnodes 2 --node_rank 0/1, both on this host) gives the same losses as one
machine of two processes. Every process is its machine's local rank 0, so anything done "once per
machine" happens twice over one shared output dir here, as on a cluster with a shared filesystem."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, run_json

SCRIPT = ROOT / "tests" / "dist" / "two_machines.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_machines_equal_one_machine(tmp_path):
    one = run_json("two_machines.py", str(tmp_path / "one"), tmp_path=tmp_path, name="one.json")
    port, out = _free_port(), tmp_path / "two.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
         "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT), str(out), str(tmp_path / "two")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            pytest.fail(f"machine exited {p.returncode}:\n{log[-6000:]}")
    two = json.loads(out.read_text())
    assert one["world"] == two["world"] == 2
    assert len(one["losses"]) == 3 and one["losses"][-1] < one["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=0, abs=1e-6)
