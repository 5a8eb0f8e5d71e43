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


def start_run(args: list[str], out) -> None:
    """The initial weights of ``launch(args)``'s run, written to ``out`` by the same command with
    ``max_iterations=0``, run in this process: a run that trains nothing is almost all imports,
    which this process has already made (a subprocess spends ~10 s on them). ``args`` is a
    ``-m diffalign.cli train ...`` command or ``tests/fsdp_worker.py`` and its overrides (no run
    directory)."""
    if args[:3] == ["-m", "diffalign.cli", "train"]:
        from diffalign.cli import main

        assert main([*args[2:], f"output_dir={out}", "max_iterations=0"]) == 0
    elif args[0] == "tests/fsdp_worker.py":
        from tests import fsdp_worker

        fsdp_worker.main(str(out), *args[1:], "max_iterations=0")
    else:
        raise ValueError(f"not a training command: {args[:3]}")
