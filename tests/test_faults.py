"""Fault injection: runs killed (SIGKILL) between any two file writes, checkpoints cut short, a
torn metrics line, a full disk, SIGTERM / SIGINT. After each, ``diffalign resume`` must end with
the weights and metrics of a run that was never interrupted.

Faults come from ``DIFFALIGN_FAULT`` (:mod:`diffalign.faults`). A killed run is a subprocess
killed by its own fault hook; the resume runs in process. Tiny models, three iterations, a
checkpoint after each.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffalign import faults, runs
from tests.helpers.tiny_run import FAST, ROOT, run_cli

ITERS = 2
COMMON = [f"max_iterations={ITERS}", "checkpoint.every=1", "checkpoint.keep_last=2", "train.ema.every=1", *FAST]
# (config, overrides that make it small); Flow-GRPO first, it gets the most kill points
RECIPES = {
    "flow_grpo": ("configs/tiny/flow_grpo_sd3.yaml", ["sampling.num_steps=3", "rollout.group_size=2"]),
    "branch_grpo": ("configs/tiny/branch_grpo_sd3.yaml", []),
    "stepwise_flow_grpo": ("configs/tiny/stepwise_flow_grpo_sd3.yaml", ["sampling.num_steps=3", "algorithm.tweedie_substeps=1"]),
    "spo": ("configs/tiny/spo_sd15.yaml", ["sampling.num_steps=4"]),
    "diffusion_nft": ("configs/tiny/diffusion_nft_sd3.yaml", ["sampling.num_steps=3"]),
    "sol_rl": ("configs/tiny/sol_rl_sd3.yaml", ["algorithm.audit_every=2"]),
}
TIMING = ("seconds", "time/")
_reference: dict[str, Path] = {}


def args_for(name: str, out: Path) -> list[str]:
    config, small = RECIPES[name]
    return ["train", config, f"output_dir={out}", *COMMON, *small]


def reference(name: str, tmp_path_factory) -> Path:
    """The uninterrupted run of a recipe (once per test process)."""
    if name not in _reference:
        out = tmp_path_factory.mktemp(f"ref-{name}") / "run"
        assert run_cli(*args_for(name, out)) == 0
        _reference[name] = out
    return _reference[name]


def records(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in runs.read_jsonl(run / "metrics.jsonl")]


def assert_same_run(a: Path, b: Path) -> None:
    wa = load_file(str(a / "final" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(b / "final" / "pytorch_lora_weights.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert records(a) == records(b)
    assert not list((b / "checkpoints").glob(".tmp-*"))


def run_with_fault(fault: str, argv: list[str]) -> int:
    """``diffalign ARGV`` in a subprocess with ``DIFFALIGN_FAULT=fault``: its exit code, or the
    negative signal number that killed it."""
    # the same thread count as this process: results of fixed-seed runs depend on the reduction order
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=str(ROOT), **{faults.ENV: fault})
    return subprocess.run([sys.executable, "-m", "diffalign.cli", *argv], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300).returncode


# Kill points: the N-th durable write of the run (1 config.yaml, 2 prompts.json, 3 iteration 0's
# metrics line, 4 and 5 the two files of the first checkpoint, ...). Flow-GRPO: write 4 (inside a
# checkpoint, whose temporary folder the resume must remove) and a point drawn with a fixed seed;
# the other recipes one drawn point each. Random moments rather than write boundaries:
# benchmarks/soak.py.
IN_CHECKPOINT = 4
_rng = random.Random(0)
KILLS = [("flow_grpo", IN_CHECKPOINT)] + [("flow_grpo", w) for w in _rng.sample([2, 3, *range(5, 10)], 1)]
KILLS += [(name, _rng.randint(2, 9)) for name in ("branch_grpo", "stepwise_flow_grpo", "spo", "diffusion_nft", "sol_rl")]


@pytest.mark.parametrize("name, write", KILLS, ids=[f"{n}-write{w}" for n, w in KILLS])
def test_sigkill_then_resume_equals_uninterrupted(name, write, tmp_path, tmp_path_factory, capsys):
    ref = reference(name, tmp_path_factory)
    out = tmp_path / "run"
    status = run_with_fault(f"kill-after-write={write}", args_for(name, out))
    assert status == -signal.SIGKILL, f"the run was not killed (status {status})"
    half_written = list((out / "checkpoints").glob(".tmp-*"))
    if write == IN_CHECKPOINT:
        assert half_written, f"write {IN_CHECKPOINT} is inside the first checkpoint"
    capsys.readouterr()
    assert run_cli("resume", str(out)) == 0
    err = capsys.readouterr().err
    assert all(f"removed {p.name}" in err for p in half_written)
    assert_same_run(ref, out)


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path, tmp_path_factory, capsys):
    ref = reference("flow_grpo", tmp_path_factory)
    out = tmp_path / "run"
    assert run_cli(*args_for("flow_grpo", out), "max_iterations=1") == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 1, "reward_me')  # a crash while appending
    capsys.readouterr()
    assert run_cli("resume", str(out), f"max_iterations={ITERS}") == 0
    err = capsys.readouterr().err
    assert "torn last line" in err
    assert_same_run(ref, out)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(damage, tmp_path, tmp_path_factory, capsys):
    ref = reference("flow_grpo", tmp_path_factory)
    out = tmp_path / "run"
    assert run_cli(*args_for("flow_grpo", out), "max_iterations=2") == 0
    shutil.rmtree(out / "final")  # stopped after its last checkpoint, before final/ (a finished run is left as it is)
    latest = runs.latest_checkpoint(out)
    tensors = latest / "tensors.safetensors"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    else:
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
    capsys.readouterr()
    assert run_cli("resume", str(out), f"max_iterations={ITERS}") == 0
    err = capsys.readouterr().err
    assert "falling back to iter-000001" in err
    assert_same_run(ref, out)


def test_full_disk_during_checkpoint_keeps_the_previous_one(tmp_path, tmp_path_factory, monkeypatch, capsys):
    ref = reference("flow_grpo", tmp_path_factory)
    out = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "enospc-in-checkpoint=2")
    faults.reset()
    capsys.readouterr()
    assert run_cli(*args_for("flow_grpo", out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot write checkpoint") and "No space left on device" in err[-1]
    assert "iter-000001 is intact" in err[-1] and "Traceback" not in "\n".join(err)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["iter-000001"]  # nothing half-written left
    runs.load_checkpoint(out / "checkpoints" / "iter-000001")
    monkeypatch.delenv(faults.ENV)
    assert run_cli("resume", str(out)) == 0
    assert_same_run(ref, out)


@pytest.mark.parametrize("sig, code", [("sigterm", 143), ("sigint", 130)])
def test_sigterm_and_sigint_checkpoint_then_exit(sig, code, tmp_path, tmp_path_factory, monkeypatch, capsys):
    """The signal arrives after write 3 (iteration 0's metrics line): the run ends iteration 0's
    bookkeeping, writes its checkpoint, exits 128 + signal; resume is exact."""
    ref = reference("flow_grpo", tmp_path_factory)
    out = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, f"{sig}-after-write=3")
    faults.reset()
    capsys.readouterr()
    assert run_cli(*args_for("flow_grpo", out), "checkpoint.every=0") == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: stopped by SIG") and "checkpoint at iteration 1 written" in err[-1]
    assert [p.name for p in runs.checkpoint_dirs(out)] == ["iter-000001"]
    monkeypatch.delenv(faults.ENV)
    assert run_cli("resume", str(out), "checkpoint.every=1") == 0
    assert_same_run(ref, out)


def test_allowed_config_change_is_logged_in_the_run(tmp_path, tmp_path_factory):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference("flow_grpo", tmp_path_factory), out)
    assert run_cli("resume", str(out), "prompts.train=[a horse]") == 2  # refused without the flag
    assert not (out / "config_changes.jsonl").exists()
    assert run_cli("resume", str(out), f"max_iterations={ITERS + 1}", "prompts.train=[a horse]", "--allow-config-change") == 0
    (change,) = runs.read_jsonl(out / "config_changes.jsonl")
    assert change["iteration"] == ITERS and change["changes"]["prompts"]["now"]["train"] == ["a horse"]


# Two processes where the reward fails on the second only, at its second call (iteration 1's: one
# call per process and iteration). reward.max_failures=1: failing once is retried, twice stops.
FAIL_ON_SECOND_PROCESS = "rank=1,reward-down-at=2,reward-down-for={n}"


@pytest.mark.parametrize("backend", [[], ["train.fsdp=true"]], ids=["ddp", "fsdp2"])
def test_reward_failing_on_one_process_stops_every_process(backend, repo_root, tmp_path):
    """Every process learns of the failure after the rollout, so both stop in iteration 1: one
    checkpoint at its start (under FSDP a collective), one error line, exit 2. The resumed run ends
    with the weights of a run whose reward failed the same way once and worked on the retry."""
    from tests.helpers.compare import FLOW_GRPO
    from tests.helpers.launch import launch
    from tests.helpers.tiny_run import train_records

    train = ["-m", "diffalign.cli", "train", *FLOW_GRPO, "rollout.prompts_per_iteration=1", "sampling.num_steps=3",
             "eval.num_prompts=1", "eval.samples_per_prompt=1", "checkpoint.every=0", "reward.max_failures=1", *backend]
    ref, out = tmp_path / "ref", tmp_path / "run"
    res = launch([*train, f"output_dir={ref}"], repo_root, nproc=2, env={faults.ENV: FAIL_ON_SECOND_PROCESS.format(n=1)})
    assert "scoring again (failure 1 of reward.max_failures=1)" in res.stderr
    res = launch([*train, f"output_dir={out}"], repo_root, nproc=2, env={faults.ENV: FAIL_ON_SECOND_PROCESS.format(n=2)},
                 timeout=300, check=False)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "on process 1;" in errors[0] and "checkpoint at iteration 1;" in errors[0], errors[0]
    assert "exitcode  : 2" in res.stderr  # the first process to end exits 2 (the launcher then ends the other)
    assert [p.name for p in runs.checkpoint_dirs(out)] == ["iter-000001"]
    assert [r["iteration"] for r in train_records(out)] == [0]
    launch(["-m", "diffalign.cli", "resume", str(out)], repo_root, nproc=2)
    wa = load_file(str(ref / "final" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["reward_mean"] for r in train_records(out)] == [r["reward_mean"] for r in train_records(ref)]
