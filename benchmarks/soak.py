"""Soak test of crash safety: SIGKILL a training run at random moments, resume it until it
finishes, and compare it with a run that was never interrupted.

    python benchmarks/soak.py --minutes 30                 # the shipped model's Flow-GRPO config
    python benchmarks/soak.py --minutes 5 --config configs/tiny/flow_grpo_sd3.yaml

One uninterrupted reference run first (its wall-clock time T sets the kill window), then runs
killed with SIGKILL after a uniform random time in (0, T) - during sampling, an update, an
evaluation or a checkpoint write - and resumed (``diffalign resume``), each resume killed again
with probability ``--kill-prob``, until the run completes. A run is identical when its final
weights and its metrics (timings aside) equal the reference's. Prints kills survived and runs
identical; exits 1 if any run differs or fails.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Small enough that one run takes a minute or two on a CPU: few iterations, a checkpoint after each,
# a small evaluation without the probe.
SMALL = ["max_iterations=4", "checkpoint.every=1", "log.progress_bar=false", "log.report=false", "eval.at_start=false",
         "eval.images_per_family=4", "eval.probe=false", "rollout.prompts_per_iteration=2", "rollout.group_size=4"]
TIMING = ("seconds", "time/")


def launch(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen([sys.executable, "-m", "diffalign.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(argv: list[str]) -> None:
    proc = launch(argv)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"soak: {' '.join(argv[:2])} failed with exit code {proc.returncode}: {err.strip().splitlines()[-1:]}")


def run_until(argv: list[str], seconds: float) -> bool:
    """Run ``argv``; SIGKILL it after ``seconds``. True when it finished on its own (exit 0)."""
    proc = launch(argv)
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        return False
    if proc.returncode != 0:
        raise SystemExit(f"soak: {' '.join(argv[:2])} failed with exit code {proc.returncode}: {err.strip().splitlines()[-1:]}")
    return True


def fingerprint(run: Path) -> tuple[dict, list[dict]]:
    from safetensors.torch import load_file

    from diffalign import runs

    final = run / "final"
    weights = {}
    for f in sorted(final.rglob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            weights[f"{f.relative_to(final)}:{k}"] = v
    records = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in runs.read_jsonl(run / "metrics.jsonl")]
    return weights, records


def same(a: tuple[dict, list[dict]], b: tuple[dict, list[dict]]) -> bool:
    import torch

    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="time budget after the reference run")
    ap.add_argument("--config", default="configs/shapes/flow_grpo.yaml")
    ap.add_argument("--kill-prob", type=float, default=0.5, help="chance that a resume is killed again")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    ap.add_argument("--work-dir", default=None, help="where runs go (default: a temporary folder, removed)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for the runs")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="diffalign-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = [*SMALL, *args.overrides]
    t0 = time.perf_counter()
    ref = work / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    finish(["train", args.config, f"output_dir={ref}", *overrides])
    span = time.perf_counter() - t0
    expected = fingerprint(ref)
    print(f"reference run: {span:.0f} s", flush=True)

    deadline = time.perf_counter() + 60 * args.minutes
    kills = runs_done = identical = 0
    while time.perf_counter() < deadline:
        out = work / f"run-{runs_done:03d}"
        shutil.rmtree(out, ignore_errors=True)
        done = run_until(["train", args.config, f"output_dir={out}", *overrides], rng.uniform(0.05, 1.0) * span)
        kills += not done
        while not done:
            limit = rng.uniform(0.05, 1.0) * span if rng.random() < args.kill_prob else 10 * span
            # killed before it wrote config.yaml (while importing): nothing to resume, start it again
            again = ["resume", str(out)] if (out / "config.yaml").is_file() else ["train", args.config, f"output_dir={out}", *overrides]
            done = run_until(again, limit)
            kills += not done
        runs_done += 1
        ok = same(fingerprint(out), expected)
        identical += ok
        print(f"run {runs_done}: {'identical' if ok else 'DIFFERENT'} (kills so far {kills})", flush=True)
        if ok:
            shutil.rmtree(out, ignore_errors=True)
    print(f"kills survived: {kills}; runs identical: {identical} of {runs_done}")
    if args.work_dir is None and identical == runs_done:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if identical == runs_done else 1


if __name__ == "__main__":
    sys.exit(main())
