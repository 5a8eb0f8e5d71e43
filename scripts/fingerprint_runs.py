"""Fingerprints of short runs of every shipped recipe: the per-iteration metrics (timings left out)
and a hash of the weights each run ends with, one JSON file per config.

A refactoring that must change no numbers is checked by fingerprinting before and after it, on
the same machine with the same thread count, and comparing::

    python scripts/fingerprint_runs.py --out /tmp/fp-before          # at the old commit
    python scripts/fingerprint_runs.py --out /tmp/fp-after           # at the new one
    python scripts/fingerprint_runs.py --compare /tmp/fp-before /tmp/fp-after

Every ``configs/tiny/*.yaml`` runs as written for two iterations; every ``configs/shapes/*.yaml``
runs two small iterations of the shipped model (its auxiliary judge, where it has one, trained
first for a few steps by ``train-reward`` / ``train-spm``, and fingerprinted too). Results are
written per config and skipped when present, so an interrupted sitting resumes. Exit code 1 when
``--compare`` finds a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["log.progress_bar=false", "log.report=false"]
# small sizes for the shipped-model recipes: two iterations of 2 prompts x 4 images, a tiny evaluation
SHAPES = ["max_iterations=2", "eval.at_start=true", "eval.every=0", "eval.images_per_family=2",
          "eval.probe=false", "sampling.eval_num_steps=2", "checkpoint.every=1"]
ROLLOUT = ["rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sample_batch_size=8", "train.batch_size=8"]
JUDGE_PROMPTS = ["prompts.source=list", 'prompts.train=["a photo of a red circle","a photo of two squares"]',
                 'prompts.eval=["a photo of a green triangle"]']
PER_RECIPE = {
    "drm_step_grpo": ["rollout.prompts_per_iteration=1", "rollout.group_size=2", "rollout.sample_batch_size=2",
                      "train.batch_size=4", "algorithm.num_candidates=2", "sampling.num_steps=3"],
    "branch_grpo": ["rollout.prompts_per_iteration=1", "rollout.group_size=8", "rollout.sample_batch_size=8", "train.batch_size=8"],
    "branch_grpo_mix": ["rollout.prompts_per_iteration=1", "rollout.group_size=8", "rollout.sample_batch_size=8", "train.batch_size=8"],
    # the generated pairs are drawn with sampling.eval_num_steps: enough steps for rewards that differ
    "diffusion_dpo": ["train.batch_size=4", "train.optimizer_steps_per_iteration=1", "algorithm.generate_images_per_prompt=4",
                      "sampling.eval_num_steps=8", "prompts.families=[counting]"],
    "spo": ["rollout.prompts_per_iteration=1", "rollout.group_size=2", "rollout.sample_batch_size=2", "train.batch_size=4",
            "algorithm.num_candidates=2", "sampling.num_steps=4"],
}
JUDGES = {
    "drm_step_grpo": ("train-reward", "reward.kwargs.path", [
        "train.steps=2", "train.batch_size=2", "pairs.samples_per_prompt=4", "pairs.num_steps=8",
        "pairs.num_train_prompts=2", "pairs.num_eval_prompts=1", "eval.t_grid=[0.0,0.5]"]),
    "spo": ("train-spm", "algorithm.spm_kwargs.model", [
        "train.steps=2", "train.batch_size=2", "pairs.images_per_prompt=4", "pairs.num_steps=8",
        "eval.every=0", "eval.taus=[0.5]", "eval.curve_points=2", *JUDGE_PROMPTS]),
}
TIMING = re.compile(r"(second|time|_s$|/s$|per_s|throughput|memory|mem_|rss|elapsed|eta|speed|wall|date)", re.I)


def configs() -> list[Path]:
    return sorted((ROOT / "configs" / "tiny").glob("*.yaml")) + sorted((ROOT / "configs" / "shapes").glob("*.yaml"))


def numbers(record: dict) -> dict:
    """The record without its timings (they differ between sittings)."""
    return {k: v for k, v in record.items() if not TIMING.search(k) and not isinstance(v, str)}


def weights_hash(folder: Path) -> dict:
    """sha256 of every tensor file under ``folder`` (its safetensors content, names and bytes)."""
    out = {}
    for path in sorted(folder.rglob("*.safetensors")) if folder.is_dir() else []:
        out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [numbers(json.loads(line)) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def cli(args: list[str], log: Path, threads: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONHASHSEED="0")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        return subprocess.call([sys.executable, "-m", "diffalign", *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def fingerprint(config: Path, work: Path, threads: int) -> dict:
    name = f"{config.parent.name}/{config.stem}"
    run = work / config.parent.name / config.stem
    overrides = [f"output_dir={run}", "seed=0", *QUIET]
    result: dict = {"config": name}
    if config.parent.name == "tiny":
        overrides.append("max_iterations=2")
    else:
        overrides += SHAPES + PER_RECIPE.get(config.stem, ROLLOUT)
        if config.stem in JUDGES:
            command, key, extra = JUDGES[config.stem]
            judge = work / "judges" / config.stem
            code = cli([command, str(config.relative_to(ROOT)), f"output_dir={judge}", *extra],
                       work / f"{config.stem}.judge.log", threads)
            result["judge"] = {"exit_code": code, "metrics": read_metrics(judge), "weights": weights_hash(judge)}
            overrides.append(f"{key}={judge}")
    t0 = time.perf_counter()
    code = cli(["train", str(config.relative_to(ROOT)), *overrides], work / f"{config.parent.name}_{config.stem}.log", threads)
    result.update(exit_code=code, metrics=read_metrics(run), weights=weights_hash(run / "final"),
                  seconds=round(time.perf_counter() - t0, 1))
    return result


def compare(a: Path, b: Path) -> int:
    differ = 0
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    for name in names:
        pa, pb = a / name, b / name
        if not (pa.is_file() and pb.is_file()):
            print(f"{name}: only in {'A' if pa.is_file() else 'B'}")
            differ += 1
            continue
        ra, rb = json.loads(pa.read_text()), json.loads(pb.read_text())
        ra.pop("seconds", None), rb.pop("seconds", None)
        if ra == rb:
            print(f"{name}: identical ({len(ra['metrics'])} metric records, {len(ra['weights'])} weight files, exit {ra['exit_code']})")
            continue
        differ += 1
        for key in sorted(set(ra) | set(rb)):
            if ra.get(key) != rb.get(key):
                print(f"{name}: {key} differs")
                if key == "metrics":
                    for i, (x, y) in enumerate(zip(ra[key], rb[key])):
                        for k in sorted(set(x) | set(y)):
                            if x.get(k) != y.get(k):
                                print(f"    record {i} {k}: {x.get(k)} != {y.get(k)}")
    print(f"{len(names) - differ} of {len(names)} fingerprints identical")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for the fingerprints (one JSON per config)")
    ap.add_argument("--only", default="", help="comma-separated config names (tiny/flow_grpo_sd3, shapes/spo, ...)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run (default 1)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two fingerprint folders")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        ap.error("--out or --compare is required")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "runs"
    only = {s for s in args.only.split(",") if s}
    for config in configs():
        name = f"{config.parent.name}/{config.stem}"
        target = args.out / f"{config.parent.name}_{config.stem}.json"
        if (only and name not in only) or target.is_file():
            continue
        result = fingerprint(config, work, args.threads)
        target.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"{name}: exit {result['exit_code']}, {len(result['metrics'])} records, {result['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
