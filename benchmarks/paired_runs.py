"""Paired difference of two runs' last evaluations, from their per-image records (no resampling).

    python benchmarks/paired_runs.py RUN_A RUN_B [--iteration N]
    python benchmarks/paired_runs.py RUN          # every evaluation of one run against its first

Both runs must have evaluated the same prompts with the same seed (any two runs of one config
family with the same ``eval.*`` and ``prompts.evaluate_on`` do): the records are then paired image
by image and every metric gets ``B - A`` with its paired 95 % bootstrap interval over prompts.
Prints the table of ``diffalign eval`` (``*``: outside noise). With one run (evaluated with
``eval.every``), each of its evaluations is paired with the run's first (the model before training).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def evaluation_paths(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "eval_records").glob("iter-*.json"))


def load_evaluation(path: Path):
    from diffalign.evaluation import Evaluation

    return Evaluation.from_records(json.loads(path.read_text())["heldout"]["records"])


def last_evaluation(run_dir: Path, iteration: int | None):
    paths = evaluation_paths(run_dir)
    if iteration is not None:
        paths = [p for p in paths if p.name == f"iter-{iteration:06d}.json"]
    if not paths:
        raise SystemExit(f"{run_dir}: no eval_records/iter-*.json{'' if iteration is None else f' for iteration {iteration}'}")
    return load_evaluation(paths[-1])


def main(argv=None) -> int:
    from diffalign.evaluation import LEGEND, comparison_columns, format_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path, nargs="?", help="omitted: every evaluation of RUN_A against its first")
    p.add_argument("--iteration", type=int, default=None, help="this evaluation of both runs instead of the last")
    args = p.parse_args(argv)
    if args.run_b is None:
        paths = evaluation_paths(args.run_a)
        if len(paths) < 2:
            raise SystemExit(f"{args.run_a}: fewer than two eval_records/iter-*.json to pair")
        names = {f"iteration {int(path.stem.split('-')[1])}": load_evaluation(path) for path in paths}
        print(format_table(comparison_columns(names, next(iter(names)))))
        print(LEGEND)
        return 0
    a, b = (last_evaluation(r, args.iteration) for r in (args.run_a, args.run_b))
    if [r["prompt"] for r in a.records] != [r["prompt"] for r in b.records]:
        raise SystemExit("the two evaluations sampled different prompts: they cannot be paired")
    names = {args.run_a.name: a, args.run_b.name: b} if args.run_a.name != args.run_b.name else {"A": a, "B": b}
    first = next(iter(names))
    print(format_table(comparison_columns(names, first)))
    print(LEGEND)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
