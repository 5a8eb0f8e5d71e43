"""Run a Python command in a subprocess: one process, or ``nproc`` CPU processes over gloo
(torch.distributed.run on a free loopback port)."""

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], cwd, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` (``-m module ...`` or ``script ...``); asserts exit code 0 and shows stderr if not."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(cwd))
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                               "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    res = subprocess.run(cmd + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res
