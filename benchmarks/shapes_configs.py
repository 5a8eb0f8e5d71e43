"""Does every ShapesWorld config still run on the shipped model? One iteration of each.

Runs ``diffalign train`` on every ``configs/shapes/*.yaml`` (or the ones named) for one iteration
at the config's own rollout and update sizes, with a short evaluation after it (``eval.num_prompts``
images, no evaluation before training, no probe, no report). SPO and DRM Step-GRPO first train
their judge at small settings (``train-spm`` / ``train-reward``: few pairs, few steps): enough to
run, not to judge. Prints one line per config (exit code, wall time, the iteration's train reward
and the evaluation's pass rate) and exits 1 when any config failed. Numbers here only show that a
method runs; its accuracy is measured by its own benchmark.

    python benchmarks/shapes_configs.py [--configs flow_grpo,spo] [--out runs/shapes_configs] [--eval-images 12] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Small judge training: enough pairs and steps to write a model the run can load (train-spm and
# train-reward read the run config's algorithm.spm_train / drm_train section; their overrides
# address that section's keys).
SPM_SMALL = ["pairs.images_per_prompt=2", "pairs.num_steps=4", "train.steps=10"]
DRM_SMALL = ["pairs.samples_per_prompt=2", "pairs.num_steps=4", "train.steps=10"]
# config -> (command that trains its judge, small settings, the run's key that names the judge's folder)
JUDGES = {"spo": ("train-spm", SPM_SMALL, "algorithm.spm_kwargs.model"),
          "drm_step_grpo": ("train-reward", DRM_SMALL, "reward.kwargs.path")}


def run_config(name: str, out: Path, eval_images: int, overrides: list[str]) -> dict:
    from diffalign.cli import main as cli

    config = str(ROOT / "configs" / "shapes" / f"{name}.yaml")
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    prep = []
    if name in JUDGES:
        command, small, key = JUDGES[name]
        judge = str(out / f"{name}_judge")
        shutil.rmtree(judge, ignore_errors=True)
        code = cli([command, config, "--quiet", f"output_dir={judge}", *small])
        if code:
            return {"config": name, "exit": code, "seconds": time.perf_counter() - t0, "stage": command}
        prep = [f"{key}={judge}"]
    code = cli(["train", config, "--quiet", f"output_dir={run_dir}", "max_iterations=1", "eval.at_start=false",
                "eval.probe=false", f"eval.num_prompts={eval_images}", "checkpoint.every=0", "log.report=false", *prep, *overrides])
    result = {"config": name, "exit": code, "seconds": time.perf_counter() - t0, "stage": "train"}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train = [r for r in rows if "reward_mean" in r and not r.get("eval")]
        evals = [r for r in rows if r.get("eval")]
        if train:
            result["train_reward"] = train[-1]["reward_mean"]
        if evals:
            result["eval_pass_rate"] = evals[-1].get("eval/acc/images", evals[-1].get("eval/reward_mean"))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="", help="comma-separated names in configs/shapes (default: all)")
    p.add_argument("--out", default=str(ROOT / "runs/shapes_configs"))
    p.add_argument("--eval-images", type=int, default=12, help="images of the evaluation after the iteration")
    p.add_argument("overrides", nargs="*", help="key=value applied to every training run (e.g. model.id=...)")
    args = p.parse_args(argv)
    known = sorted(f.stem for f in (ROOT / "configs" / "shapes").glob("*.yaml"))
    names = [n for n in args.configs.split(",") if n] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(known)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        r = run_config(name, out, args.eval_images, list(args.overrides))
        results.append(r)
        reward = f"{r['train_reward']:.3f}" if "train_reward" in r else "-"
        acc = f"{r['eval_pass_rate']:.3f}" if "eval_pass_rate" in r else "-"
        status = "ran" if r["exit"] == 0 else f"FAILED in {r['stage']} (exit {r['exit']})"
        print(f"{name:<22} {status:<10} {r['seconds']:7.1f} s   train reward {reward}   eval {acc}", flush=True)
    failed = [r["config"] for r in results if r["exit"]]
    print(f"{len(results) - len(failed)} of {len(results)} configs ran" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
