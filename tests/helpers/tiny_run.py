"""One real run directory per test session (tiny SD3, one Flow-GRPO iteration), shared by the
export and demo tests so that the ~10 s of training happen once."""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny/flow_grpo_sd3.yaml"
# EMA off and a larger learning rate: one iteration must move the LoRA well away from its zero-init B
# (the EMA's first average keeps a tenth of the initial weights), so that "the export reproduces
# the trained model" cannot pass with a nearly empty LoRA.
OVERRIDES = [
    "max_iterations=1", "log.progress_bar=false", "log.report=false", "eval.at_start=true",
    "sampling.eval_num_steps=2", "eval.samples_per_prompt=1", "train.ema.enabled=false", "optim.lr=1e-2",
]
# what a test run does not need: progress bars, the report, the evaluation before training, long eval sampling
FAST = ["log.progress_bar=false", "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2", "eval.samples_per_prompt=1"]
# FAST, evaluating on one prompt only
FAST_ONE_PROMPT = [*FAST, "eval.num_prompts=1"]
_cache: dict[str, Path] = {}


def run_cli(*args) -> int:
    """``diffalign ARGS`` from the repository root (configs are given relative to it); the exit code.
    Arguments that are not strings (paths, numbers) are passed as ``str(arg)``."""
    from diffalign.cli import main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main([str(a) for a in args])
    finally:
        os.chdir(cwd)


def train_records(out: Path) -> list[dict]:
    """The training (non-evaluation) records of run directory ``out``'s metrics.jsonl."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]


def trained_run(tmp_path_factory) -> Path:
    """Path of the session's run directory, trained on first use under pytest's session temp dir."""
    if "run" not in _cache:
        out = tmp_path_factory.mktemp("tiny-run") / "tiny_sd3_run"
        rc = run_cli("train", CONFIG, f"output_dir={out}", *OVERRIDES)
        assert rc == 0, f"training the tiny run failed with exit code {rc}"
        _cache["run"] = out
    return _cache["run"]


# ---- diffalign as a user runs it: a subprocess from a folder of their own ------------------------
# the main job (configs/shapes/flow_grpo.yaml) made quick: 2 iterations of 4 images, 2 denoising steps,
# 2 held-out images per family; the same files and output layout as the real run
QUICK_SHAPES = ["max_iterations=2", "rollout.prompts_per_iteration=2", "rollout.group_size=2", "sampling.num_steps=2",
                "sampling.window_size=2", "sampling.eval_num_steps=2", "eval.images_per_family=2", "train.batch_size=4"]


def user_env() -> dict:
    """The environment of a ``diffalign`` subprocess: this checkout's package, one thread, offline."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def diffalign(*args, cwd, timeout: int = 300, env: dict | None = None):
    """``diffalign ARGS`` in a subprocess started in ``cwd``; the CompletedProcess (text output)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "diffalign.cli", *map(str, args)], cwd=cwd, env=env or user_env(),
                          capture_output=True, text=True, timeout=timeout)


def shapes_run(tmp_path_factory) -> Path:
    """A user's folder holding ``runs/shapes_flow_grpo``: the main job's recipe trained by ``diffalign
    train shapes/flow_grpo`` with :data:`QUICK_SHAPES`, once per pytest process, and what the command
    printed (``train.stdout``, ``train.stderr``). Tests only read it."""
    if "shapes" not in _cache:
        home = tmp_path_factory.mktemp("user")
        done = diffalign("train", "shapes/flow_grpo", *QUICK_SHAPES, cwd=home, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (home / "train.stdout").write_text(done.stdout)  # what the user saw, for the tests that read it
        (home / "train.stderr").write_text(done.stderr)
        _cache["shapes"] = home
    return _cache["shapes"]
