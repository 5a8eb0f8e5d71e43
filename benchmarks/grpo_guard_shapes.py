"""GRPO-Guard on and off on the shipped ShapesWorld model: per-step ratio statistics and held-out accuracy.

    python benchmarks/grpo_guard_shapes.py [--config configs/shapes/flow_grpo.yaml]
        [--out benchmarks/results/grpo_guard_shapes] [--seed 0] [key=value ...]

Trains the main job's config twice with the same seed and budget (its ``max_iterations``):

- ``off``: as shipped, with ``algorithm.guard_diagnostics=true`` (statistics only; the update is
  the plain Flow-GRPO one);
- ``on``: ``guard_ratio_norm=true``, ``guard_step_reweight=true`` (``guard_norm_mode: auto``),
  diagnostics on.

Each run evaluates after training on the held-out evaluation (same prompts, same seeds); ``off``
also evaluates the shipped model before training (``on`` would sample the same images again). A finished run (its ``result.json``) is skipped, so an interrupted benchmark resumes.
Then it prints, per trained step, the importance ratio's mean and std before normalisation (and,
for ``on``, after it) averaged over the iterations, and the held-out table: each run before/after
and the paired difference ``on - off`` on the final models, with 95 % intervals over prompts.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

VARIANTS = {
    "off": ["algorithm.guard_diagnostics=true"],
    "on": ["algorithm.guard_ratio_norm=true", "algorithm.guard_step_reweight=true", "algorithm.guard_diagnostics=true",
           "eval.at_start=false"],  # the base model's evaluation is the same images as off's: evaluated once
}
STAT = re.compile(r"^guard/(ratio|norm_ratio)_(mean|std)/step_(\d+)$")


def train(config: str, run_dir: Path, seed: int, overrides: list[str]) -> dict:
    """Train one variant to completion (resuming a partial run) and record its wall time."""
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    result = run_dir / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    cfg = load_config(config, [f"output_dir={run_dir}", f"seed={seed}", *overrides])
    start = time.perf_counter()
    build_trainer(cfg).train()
    info = {"overrides": overrides, "seed": seed, "seconds": round(time.perf_counter() - start, 1)}
    result.write_text(json.dumps(info, indent=1))
    return info


def step_statistics(run_dir: Path) -> dict[tuple[str, str, int], float]:
    """Mean over iterations of every ``guard/*/step_NN`` scalar in ``metrics.jsonl``."""
    values: dict[tuple[str, str, int], list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for key, value in row.items():
            m = STAT.match(key)
            if m and value is not None:
                values.setdefault((m.group(1), m.group(2), int(m.group(3))), []).append(float(value))
    return {k: statistics.fmean(v) for k, v in values.items()}


def evaluations(run_dir: Path):
    """The run's first and last held-out evaluations (the same one when it evaluated once)."""
    from diffalign.evaluation import Evaluation

    paths = sorted((run_dir / "eval_records").glob("iter-*.json"))
    if not paths:
        raise SystemExit(f"{run_dir}: no evaluation in eval_records/")
    first, last = (Evaluation.from_records(json.loads(p.read_text())["heldout"]["records"]) for p in (paths[0], paths[-1]))
    return first, last


def main(argv=None) -> int:
    from diffalign.evaluation import LEGEND, comparison_columns, format_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/shapes/flow_grpo.yaml"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/grpo_guard_shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="config overrides applied to both variants")
    args = p.parse_args(argv)

    infos = {}
    for name, extra in VARIANTS.items():
        run_dir = args.out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] training {args.config} -> {run_dir}", flush=True)
        infos[name] = train(args.config, run_dir, args.seed, [*args.overrides, *extra])
        print(f"[{name}] done in {infos[name]['seconds']} s", flush=True)

    stats = {name: step_statistics(args.out / name) for name in VARIANTS}
    steps = sorted({k[2] for s in stats.values() for k in s})
    print("\nImportance ratio per trained step, mean over iterations (before normalisation; 'on' also after)")
    header = f"{'step':>5}{'off mean':>11}{'off std':>11}{'on mean':>11}{'on std':>11}{'on norm mean':>14}{'on norm std':>13}"
    print(header)
    for step in steps:
        cells = [stats["off"].get(("ratio", "mean", step)), stats["off"].get(("ratio", "std", step)),
                 stats["on"].get(("ratio", "mean", step)), stats["on"].get(("ratio", "std", step)),
                 stats["on"].get(("norm_ratio", "mean", step)), stats["on"].get(("norm_ratio", "std", step))]
        widths = (11, 11, 11, 11, 14, 13)
        print(f"{step:>5}" + "".join(f"{'-' if c is None else f'{c:.6f}':>{w}}" for c, w in zip(cells, widths)))

    (off_before, off_after), (_, on_after) = evaluations(args.out / "off"), evaluations(args.out / "on")
    if [r["prompt"] for r in off_after.records] != [r["prompt"] for r in on_after.records]:
        raise SystemExit("the two runs evaluated different prompts: they cannot be paired")
    print("\nHeld-out evaluation (same prompts and seeds); paired differences against the first column")
    print(format_table(comparison_columns({"shipped": off_before, "guard off": off_after}, "shipped")))
    print()
    print(format_table(comparison_columns({"shipped": off_before, "guard on": on_after}, "shipped")))
    print()
    print(format_table(comparison_columns({"guard off": off_after, "guard on": on_after}, "guard off")))
    print(LEGEND)
    print("\ntraining wall time: " + ", ".join(f"{n} {i['seconds']} s" for n, i in infos.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
