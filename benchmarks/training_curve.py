"""A run's training rollouts, window by window: reward, pass rate and each family's pass rate.

    python benchmarks/training_curve.py RUN [--window 16]

Reads ``RUN/metrics.jsonl`` (the per-iteration records every trainer writes) and prints, for each
window of ``--window`` consecutive iterations, the mean of the rollouts' reward, their pass rate
(``reward/acc/images``), the pass rate of every family the rewards reported (the mean over the
window's iterations that drew the family) and the share of zero-std groups. Shows whether the
policy still improves on the prompts it is trained on when a held-out or validation curve
stalls. The numbers are of SDE rollouts at the training steps, not of the evaluation's ODE samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAMILY_PREFIX = "reward/acc/"
SUMMARY = ("overall", "images")


def windows(records: list[dict], window: int) -> list[dict]:
    """One row per window of ``window`` training records (the last one may be shorter)."""
    train = [r for r in records if not r.get("eval")]
    families = sorted({k[len(FAMILY_PREFIX):] for r in train for k in r
                       if k.startswith(FAMILY_PREFIX) and k[len(FAMILY_PREFIX):] not in SUMMARY})
    rows = []
    for lo in range(0, len(train), window):
        part = train[lo:lo + window]

        def mean(key: str) -> float | None:
            values = [r[key] for r in part if key in r]
            return sum(values) / len(values) if values else None

        rows.append({"first": part[0]["iteration"], "last": part[-1]["iteration"], "reward": mean("reward_mean"),
                     "images": mean(FAMILY_PREFIX + "images"), "zero_std": mean("zero_std_frac"),
                     "families": {f: mean(FAMILY_PREFIX + f) for f in families}})
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: list[dict]) -> str:
    families = list(rows[0]["families"]) if rows else []
    head = f"{'iterations':>12}  {'reward':>6}  {'pass':>5}  " + "  ".join(f"{f:>13}" for f in families) + "  zero-std"
    lines = [head]
    for r in rows:
        cells = "  ".join(f"{_cell(v, 2):>13}" for v in r["families"].values())
        lines.append(f"{r['first']:>5} - {r['last']:<4}  {_cell(r['reward'], 3):>6}  {_cell(r['images'], 3):>5}  {cells}"
                     f"  {_cell(r['zero_std'], 3):>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--window", type=int, default=16, help="iterations per row")
    args = p.parse_args(argv)
    if args.window < 1:
        raise SystemExit("--window must be >= 1")
    path = args.run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = windows(records, args.window)
    if not rows:
        raise SystemExit(f"{path}: no training iterations")
    print(f"training rollouts of {args.run}, means over windows of {args.window} iterations")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
