"""Run a Python command in a subprocess: one process, or ``nproc`` CPU processes over gloo
(torch.distributed.run on a free loopback port), or through accelerate's launcher: on one node, or
on several nodes simulated by one launcher each on 127.0.0.1."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cwd, extra: dict | None = None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(cwd), **(extra or {}))


def launch(args: list[str], cwd, nproc: int = 1, timeout: int = 600, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """``python ARGS`` (``-m module ...`` or ``script ...``), with ``env`` added to the environment;
    asserts exit code 0 and shows stderr if not (``check``). A run past ``timeout`` seconds (a hang)
    ends with all its processes and fails the assertion."""
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                               "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    proc = subprocess.Popen(cmd + list(args), cwd=cwd, env=_env(cwd, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own process group: ended with its workers
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{stderr[-3000:]}") from None
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert res.returncode == 0 or not check, res.stderr[-3000:]
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


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]  # ``accelerate launch`` of this interpreter


def accelerate_launch(launcher: list[str], args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """``accelerate launch LAUNCHER ARGS`` (``launcher``: its own flags, e.g. ``--config_file``) on one
    node; asserts exit code 0."""
    res = subprocess.run([*ACCELERATE, *launcher, *args], cwd=cwd, env=_env(cwd), capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def launch_nodes(config: str, args: list[str], cwd, logs: Path, nodes: int = 2, procs_per_node: int = 1,
                 timeout: int = 300) -> list[str]:
    """``nodes`` machines simulated on loopback: one ``accelerate launch --config_file CONFIG
    --num_machines NODES --machine_rank R --main_process_ip 127.0.0.1 ...`` per node, started together,
    each starting ``procs_per_node`` processes. Returns each node's output (stdout and stderr, also
    written to ``logs/nodeR.log``). A node that fails or a run past ``timeout`` seconds ends every
    node's process group (a node left alone waits for its peers) and fails the assertion."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, files = [], []
    for rank in range(nodes):
        cmd = [*ACCELERATE, "--config_file", config, "--num_machines", str(nodes), "--machine_rank", str(rank),
               "--num_processes", str(nodes * procs_per_node), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), *args]
        files.append(open(logs / f"node{rank}.log", "w"))
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=_env(cwd), stdout=files[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))  # its own process group: ended with its workers
    deadline, failed = time.monotonic() + timeout, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None or all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                failed = f"timeout after {timeout} s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()
    outputs = [(logs / f"node{rank}.log").read_text() for rank in range(nodes)]
    assert failed is None, f"{nodes}-node run failed ({failed}):\n" + "\n".join(f"--- node {r}:\n{o[-2000:]}" for r, o in enumerate(outputs))
    return outputs
