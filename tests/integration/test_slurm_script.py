"""docs/slurm.md's job script, run as written: stand-ins for ``scontrol`` and ``srun`` make this machine two nodes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vpipe_lab.telemetry import runlog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]

SCONTROL = """#!/bin/bash
# `scontrol show hostnames LIST`: one host name per line (both "nodes" are this machine)
[ "$1 $2" = "show hostnames" ] || { echo "unexpected: scontrol $*" >&2; exit 2; }
echo 127.0.0.1
echo 127.0.0.1
"""
SRUN = """#!/bin/bash
# srun: the command once per node, in parallel, each with its node's SLURM_PROCID; fails if any fails
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_PROCID=$i SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_script() -> str:
    text = (ROOT / "docs" / "slurm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if "#SBATCH" in b)


def test_the_documented_job_script_trains_unattended(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".vpipe-lab.key").write_text("ab" * 32)
    (tmp_path / "job.sh").write_text(job_script())
    run_dir = tmp_path / "runs" / "vpipe"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(home),
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "vpipe", "RUN_DIR": str(run_dir), "ITERATIONS": "4", "DEVICE": "cpu",
           "RDZV_PORT": str(_port()), "CONTROL_PORT": str(_port()), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "rank 0 served tcp://127.0.0.1:" in done.stdout
    frame = runlog.read(run_dir)
    assert list(frame["iteration"]) == [0, 1, 2, 3] and frame["grad_norm"].notna().all()
    assert (run_dir / "checkpoints" / "latest").read_text() == "ckpt-00000004-0-0"
