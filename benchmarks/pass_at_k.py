"""How far could sharpening a model's own samples take it? pass@k from an evaluation's records.

A policy-gradient method such as Flow-GRPO reinforces the samples that pass, so on a prompt it can at
most make the model produce, every time, what it already produces some of the time. pass@k (the
chance that at least one of k samples passes, with the unbiased estimator of Chen et al. 2021,
``1 - C(n - c, k) / C(n, k)`` for a prompt with c passing images of n) bounds that from the stored
per-image records of one evaluation: pass@1 is the pass rate, and a family whose pass@k stays close
to its pass@1 has little a sharpened model could gain there. Per family, and the mean over families
(GenEval's overall); k is capped per family at its fewest images per prompt.

    python benchmarks/pass_at_k.py RUN [--iteration N] [--split heldout|probe] [--k 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from math import comb
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from c passes among n samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def family_table(records: list[dict], ks: list[int]) -> dict[str, dict]:
    """{family: {"prompts", "min_images", "pass@k" for each k <= min_images}}, prompts weighted equally."""
    counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        cell = counts[r["family"]][r["prompt"]]
        cell[0] += 1
        cell[1] += bool(r["passed"])
    table = {}
    for family, prompts in counts.items():
        n_min = min(n for n, _ in prompts.values())
        row = {"prompts": len(prompts), "min_images": n_min}
        for k in ks:
            if k <= n_min:
                row[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in prompts.values()) / len(prompts)
        table[family] = row
    return table


def load_records(run: Path, iteration: int | None, split: str) -> tuple[int, list[dict]]:
    files = sorted((run / "eval_records").glob("iter-*.json"))
    if not files:
        raise SystemExit(f"{run}: no eval_records/iter-*.json")
    if iteration is not None:
        files = [f for f in files if f.name == f"iter-{iteration:06d}.json"]
        if not files:
            raise SystemExit(f"{run}: no evaluation at iteration {iteration}")
    data = json.loads(files[-1].read_text())
    if not data.get(split):
        raise SystemExit(f"{files[-1]}: no {split!r} records")
    return int(data["iteration"]), data[split]["records"]


def main(argv=None) -> int:
    from diffalign.shapes.world import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory (or a folder of its records) with eval_records/")
    p.add_argument("--iteration", type=int, default=None, help="this evaluation (default: the last)")
    p.add_argument("--split", default="heldout", choices=("heldout", "probe"))
    p.add_argument("--k", default="1,2,3", help="comma-separated k values")
    args = p.parse_args(argv)
    try:
        ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    except ValueError:
        raise SystemExit(f"--k: comma-separated integers, got {args.k!r}") from None
    if not ks or ks[0] < 1:
        raise SystemExit(f"--k: positive integers, got {args.k!r}")
    iteration, records = load_records(Path(args.run), args.iteration, args.split)
    table = family_table(records, ks)
    families = [f for f in FAMILIES if f in table]
    print(f"{args.run}: {args.split} evaluation at iteration {iteration}, {len(records)} images; "
          "pass@k per family (prompts weighted equally)")
    print(f"{'family':<20} {'prompts':>7} {'images/prompt':>13} " + " ".join(f"{'pass@' + str(k):>8}" for k in ks))
    for f in families:
        row = table[f]
        cells = " ".join(f"{row[f'pass@{k}']:8.3f}" if f"pass@{k}" in row else f"{'-':>8}" for k in ks)
        print(f"{f:<20} {row['prompts']:7d} {row['min_images']:13d} {cells}")
    means = []
    for k in ks:
        values = [table[f].get(f"pass@{k}") for f in families]
        means.append(f"{sum(values) / len(values):8.3f}" if None not in values else f"{'-':>8}")
    print(f"{'mean of families':<20} {'':>7} {'':>13} " + " ".join(means))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
