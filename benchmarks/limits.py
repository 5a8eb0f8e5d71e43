"""What caps RL on a ShapesWorld base model: a few recipes that each test one explanation, every one
trained over several seeds to one budget and paired against the base model at its own
validation-best CFG scale.

    python benchmarks/limits.py [--rows main,raft,batch4x,reference,cfg_free] [--seeds 0,1,2]
        [--iterations 32 | --cpu-minutes M | --minutes M] [--scales 1,1.5,2,3,4] [--model shapes]
        [--images-per-family 96] [--out runs/limits] [key=value ...]
    python benchmarks/limits.py --table-only [--out runs/limits]

Rows (:data:`ROWS`; every one starts from ``configs/shapes/flow_grpo.yaml``, the main job, unless
it names another recipe)
    main       the main job as shipped.
    raft       RAFT (``configs/shapes/raft.yaml``): the best image of each group trained with the
               ordinary flow-matching loss; the same prompts, groups and images per iteration as
               ``main``, so the same image budget. If RL's gain is what supervised training on the
               model's own best samples gives, RAFT matches it.
    batch4x    4x the images per optimizer step: 32 prompts x 8 images per iteration and the same
               two optimizer steps, so as many updates as ``main``, each on 4x the images (4x the
               rollout cost). If gradient noise caps the gain, this row moves it.
    reference  the published Flow-GRPO recipe on this model: the SDE on every step with 9 of the
               10 steps drawn at random per image, PPO clip 1e-4, KL beta 0.04 in the reference
               code's scaling (``algorithm.kl_definition: reference``), batch-global advantage
               std, a LoRA of rank 32 / alpha 64 at lr 3e-4, at the main job's prompts and budget.
               Tests whether the main job's shortcuts (the fixed 4-step window, clip 0.2, no KL,
               full fine-tuning) are what limits it.
    cfg_free   trained and sampled without guidance (CFG 1: half the denoiser forwards of a CFG
               rollout; DiffusionNFT's claim that RL can replace guidance). Its weights are
               evaluated at CFG 1 only, against the base at its best scale.

Cells
    One (row, seed) cell is one ``benchmarks/leaderboard.py`` cell (:func:`leaderboard.run_cell`):
    the recipe trained for the budget (default ``--iterations 32``, the main job's; CPU and
    wall-clock time and rollout images are recorded whatever the budget), its final weights
    evaluated on the held-out prompts at the training scale, on the validation prompts at every
    ``--scales`` scale (the row's own scales for ``cfg_free``), and on the held-out prompts at the
    best validation scale (ties: the lower). The base model is evaluated the same way once, under
    ``OUT/base``. Every evaluation samples the same image list with the same seed, so image ``i``
    starts from the same noise in every cell and in the base's evaluations. Cells are written to
    ``OUT/cells/ROW/seedS.json`` when finished and skipped when present (a cell measured with other
    settings stops the run with an error naming the file), so the table fills over several
    sittings; ``--table-only`` rebuilds it from the stored cells without loading a model.

Intervals
    Per seed: the held-out per-image difference to the base at its best scale, with the paired 95 %
    bootstrap interval over prompts (``diffalign.stats.paired_difference``; prompt-sampling noise).
    Over seeds: the mean difference with its 95 % t-interval over the per-seed differences
    (retraining noise). ``*``: the interval excludes 0. The same against ``main``, paired by seed.

Output: the table as text, ``OUT/results.json`` and ``OUT/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import leaderboard as lb  # noqa: E402
from diffalign.errors import DiffalignError  # noqa: E402
from diffalign.import_noise import filter_known_import_messages  # noqa: E402

filter_known_import_messages()  # before diffusers loads: its dependencies' known import chatter, as the CLI does
from diffalign.stats import Difference  # noqa: E402

MAIN = "configs/shapes/flow_grpo.yaml"
REFERENCE_RECIPE = (
    "sampling.window_size=0",  # the SDE (and training) on every step
    "algorithm.timestep_selection=random", "algorithm.train_timestep_fraction=0.99",  # 9 of 10 steps, drawn per image
    "algorithm.clip_range=1e-4", "algorithm.beta=0.04", "algorithm.kl_definition=reference",
    "algorithm.advantage_std=global",
    "lora.enabled=true", "lora.rank=32", "lora.alpha=64", "optim.lr=3e-4",
)
ROWS: dict[str, lb.Method] = {
    "main": lb.Method(MAIN),
    "raft": lb.Method("configs/shapes/raft.yaml"),
    "batch4x": lb.Method(MAIN, ("rollout.prompts_per_iteration=32",)),  # 256 images, 2 optimizer steps: 128 per step
    "reference": lb.Method(MAIN, REFERENCE_RECIPE),
    "cfg_free": lb.Method(MAIN, ("sampling.guidance_scale=1",), scales=(1.0,)),
}
BASELINE = "main"  # the row every other one is also compared with
METRICS = (("acc/images", "per image"), ("partial", "partial credit"))


# --------------------------------------------------------------------------------------------
# Table math (pure: stored cells in, numbers out)
# --------------------------------------------------------------------------------------------


def records(compact: Mapping, prompts: Sequence[str]) -> list[dict]:
    """Compact cell records back to ``diffalign.stats`` records (prompt, family, passed, score)."""
    from diffalign.shapes.world import prompt_family

    scores = compact.get("score") or [float(p) for p in compact["passed"]]
    return [{"prompt": prompts[i], "family": prompt_family(prompts[i]), "passed": bool(p), "score": float(s)}
            for i, p, s in zip(compact["prompt"], compact["passed"], scores)]


def heldout_records(cell: Mapping, scale: str) -> list[dict]:
    return records(cell["marks"][-1]["heldout"][scale], cell["prompts"]["heldout"])


def _point(recs: Sequence[Mapping], metric: str) -> float:
    from diffalign.stats import point_estimates

    return point_estimates(recs)[metric]


def summarise(cells: Mapping[str, Mapping[int, Mapping]], base: Mapping, base_records: Sequence[Mapping]) -> dict:
    """Per row and metric: each seed's held-out value at its chosen scale and its paired difference
    to the base at the base's best scale (bootstrap over prompts), the mean over seeds with
    t-intervals, and the same difference against :data:`BASELINE` paired by seed."""
    from diffalign.stats import paired_difference

    main = cells.get(BASELINE, {})
    out = {}
    for name, by_seed in cells.items():
        seeds = sorted(by_seed)
        chosen = {s: heldout_records(by_seed[s], by_seed[s]["chosen_scale"]) for s in seeds}
        row: dict = {"seeds": seeds, "chosen_scales": [by_seed[s]["chosen_scale"] for s in seeds],
                     "training_scale": by_seed[seeds[0]]["training_scale"]}
        for metric, _ in METRICS:
            values = {s: _point(chosen[s], metric) for s in seeds}
            per_seed = {s: paired_difference(base_records, chosen[s])[metric] for s in seeds}
            diffs = [per_seed[s].value for s in seeds]
            res = {"value": {str(s): values[s] for s in seeds}, "mean": statistics.mean(values.values()),
                   "interval": lb._dict(lb._clipped(lb.seed_interval(list(values.values())))),
                   "vs_base": {str(s): per_seed[s].to_dict() for s in seeds},
                   "vs_base_mean": statistics.mean(diffs), "vs_base_interval": lb._dict(lb.seed_interval(diffs, Difference)),
                   "training_scale_value": statistics.mean(
                       _point(heldout_records(by_seed[s], row["training_scale"]), metric) for s in seeds)}
            common = [s for s in seeds if s in main]
            if name != BASELINE and common:
                vs_main = [values[s] - _point(heldout_records(main[s], main[s]["chosen_scale"]), metric) for s in common]
                res["vs_main_mean"] = statistics.mean(vs_main)
                res["vs_main_interval"] = lb._dict(lb.seed_interval(vs_main, Difference))
            row[metric] = res
        row["cost"] = {
            "iterations": statistics.mean(by_seed[s]["iterations"] for s in seeds),
            "images": statistics.mean(by_seed[s]["images"] for s in seeds),
            "train_minutes": statistics.mean(by_seed[s]["train_seconds"] for s in seeds) / 60,
            "train_cpu_minutes": statistics.mean(by_seed[s]["train_cpu_seconds"] for s in seeds) / 60,
            "nfe_per_image": statistics.mean(by_seed[s]["nfe_per_image"] for s in seeds),
            "busy": sum(bool(by_seed[s]["busy"]) for s in seeds),
        }
        out[name] = row
    return out


def _signed(d: Mapping | None, mean: float | None = None) -> str:
    if d is None:
        return "-" if mean is None else f"{mean:+.3f}"
    star = " *" if d["lo"] > 0 or d["hi"] < 0 else ""
    return f"{d['value'] if mean is None else mean:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]{star}"


def row_order(names) -> list[str]:
    return sorted(names, key=lambda n: (list(ROWS).index(n) if n in ROWS else len(ROWS), n))


def format_table(summary: Mapping[str, Mapping], base: Mapping, metric: str = "acc/images") -> str:
    """One markdown table: a row per recipe, the base at its best scale as the reference line."""
    label = dict(METRICS)[metric]
    base_value = base["heldout_metrics"][metric]
    lines = [f"held-out {label} at each model's validation-best CFG scale; base (CFG {base['best_scale']}): {base_value:.3f}",
             "", "| row | seeds | CFG | held-out | - base, per seed (paired, prompts) | - base, mean (t over seeds) "
             f"| - {BASELINE} (t over seeds) | at training CFG | images | train CPU min |",
             "|---|---:|---|---:|---|---|---|---:|---:|---:|"]
    for name in row_order(summary):
        r, k = summary[name], summary[name][metric]
        iv = k["interval"]
        held = f"{k['mean']:.3f}" + (f" [{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv else "")
        per_seed = "; ".join(f"s{s}: {_signed(k['vs_base'][str(s)])}" for s in r["seeds"])
        lines.append(f"| {name} | {len(r['seeds'])} | {'/'.join(r['chosen_scales'])} | {held} | {per_seed} "
                     f"| {_signed(k['vs_base_interval'], k['vs_base_mean'])} "
                     f"| {_signed(k.get('vs_main_interval'), k.get('vs_main_mean')) if name != BASELINE else '-'} "
                     f"| {k['training_scale_value']:.3f} (CFG {r['training_scale']}) | {r['cost']['images']:.0f} "
                     f"| {r['cost']['train_cpu_minutes']:.1f}{' (busy)' if r['cost']['busy'] else ''} |")
    lines.append("\n`*`: the 95 % interval excludes 0. Per seed: paired bootstrap over held-out prompts; mean: "
                 "t-interval over the per-seed differences (none for one seed).")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Stored cells -> results
# --------------------------------------------------------------------------------------------


def base_with_records(out: Path) -> tuple[dict, list[dict]]:
    from diffalign.shapes import prompt_set
    from diffalign.stats import point_estimates

    path = out / "base" / "summary.json"
    if not path.is_file():
        raise DiffalignError(f"{path}: no base evaluation stored yet (run benchmarks/limits.py first)")
    base = json.loads(path.read_text())
    recs = records(base["heldout"], prompt_set("heldout"))
    base["heldout_metrics"] = point_estimates(recs)
    return base, recs


def write_results(out: Path, settings: Mapping | None) -> dict:
    base, base_recs = base_with_records(out)
    cells = lb.stored_cells(out, settings)
    if not cells:
        raise DiffalignError(f"{out / 'cells'}: no finished cells yet")
    summary = summarise({n: cells[n] for n in row_order(cells)}, base, base_recs)
    tables = "\n\n".join(format_table(summary, base, m) for m, _ in METRICS)
    print(tables)
    results = {"settings": settings or next(iter(next(iter(cells.values())).values()))["settings"],
               "base": {k: v for k, v in base.items() if k != "heldout"}, "rows": summary,
               "cells": [f"{n}/seed{s}" for n in cells for s in sorted(cells[n])]}
    from diffalign.runs import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    atomic_write_text(out / "table.md", tables + "\n")
    print(f"saved {out / 'results.json'} and {out / 'table.md'}")
    return results


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    lb.add_cell_arguments(p, lb.Budget("iterations", 32.0))  # the main job's 32 iterations unless a budget flag says otherwise
    p.add_argument("--table-only", action="store_true", help="print the table from the stored cells; run nothing")
    p.add_argument("--out", default=str(ROOT / "runs" / "limits"))
    p.add_argument("overrides", nargs="*", help="key=value overrides for every row (a tiny model's sizes, say)")
    args = p.parse_args(argv)
    args.row_names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.row_names if r not in ROWS]
    if unknown or not args.row_names:
        raise DiffalignError(f"--rows: unknown {', '.join(unknown) or 'none given'}; known: {', '.join(ROWS)}")
    lb.check_cell_arguments(args)
    # what leaderboard.run_cell reads besides these: one mark (the end), no per-row extras, no judges
    args.marks, args.sets, args.judge_sets, args.prepare = [1.0], {}, {}, False
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        return write_results(out, None)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    spec = lb.EvalSpec(args.images_per_family, args.eval_steps, args.eval_seed, args.eval_batch_size, args.mixed_precision)
    settings = lb.run_settings(args, spec)
    lb.base_model(args, spec, out)
    for name in args.row_names:
        for seed in args.seeds:
            path = lb.cell_path(out, name, seed)
            if path.is_file():
                stored = json.loads(path.read_text())
                diff = lb.first_difference({"settings": stored["settings"], "overrides": stored["overrides"]},
                                           {"settings": settings, "overrides": list(ROWS[name].overrides)})
                if diff:
                    raise DiffalignError(f"{path} was measured with other settings ({diff}); use another --out or delete it")
                print(f"- {name} seed {seed}: done earlier ({path})", flush=True)
                continue
            print(f"- {name} seed {seed}: {args.budget} of training", flush=True)
            cell = lb.run_cell(name, seed, args, spec, out, method=ROWS[name])
            from diffalign.runs import atomic_write_text

            atomic_write_text(path, json.dumps(cell))
    return write_results(out, settings)


def cli(argv=None) -> int:
    return lb.run_cli(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
