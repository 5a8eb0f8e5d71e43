"""``report.md`` for a run directory: reward curve, eval before/after, sample grids (for video
models, frame strips: one row per video, frames left to right).

With ShapesWorld prompts the trainer keeps every evaluation's per-image records
(``eval_records/iter-N.json``); the report then shows the held-out table with 95 % bootstrap
intervals before and after training, the paired difference (same prompts and seeds) with its
interval and the outside-noise mark, and the generalisation probe before and after, apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffalign import runs


def _plot_curves(records: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    its = [r["iteration"] for r in records]
    axes[0].plot(its, [r.get("reward_mean") for r in records], marker="o", ms=3, label="train reward (mean)")
    axes[0].set_xlabel("iteration")
    axes[0].set_title("training reward")
    axes[0].grid(alpha=0.3)
    with_ci = [e for e in evals if all(isinstance(e.get(k), (int, float)) for k in
                                       ("eval/acc/overall", "eval/acc/overall_lo", "eval/acc/overall_hi"))]
    if with_ci and len(with_ci) == len(evals):
        x = [e["iteration"] for e in evals]
        y = [e["eval/acc/overall"] for e in evals]
        lo = [e["eval/acc/overall_lo"] for e in evals]
        hi = [e["eval/acc/overall_hi"] for e in evals]
        axes[1].fill_between(x, lo, hi, color="C1", alpha=0.2, lw=0, label="95 % interval (bootstrap over prompts)")
        axes[1].errorbar(x, y, yerr=[[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]], marker="o", ms=3,
                         color="C1", capsize=3, label="accuracy (mean of families)")
        axes[1].set_title("held-out accuracy")
        axes[1].legend(fontsize=7, loc="best")
    else:
        if evals:
            axes[1].plot([e["iteration"] for e in evals], [e.get("eval/reward_mean") for e in evals], marker="o", color="C1")
        axes[1].set_title("eval reward (held-out prompts)")
    axes[1].set_xlabel("iteration")
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_eval_records(run_dir: Path, iteration: int) -> dict | None:
    from diffalign.training.evaluator import eval_records_path

    path = eval_records_path(run_dir, iteration)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _interval_section(title: str, before: dict | None, after: dict | None, first_it: int, last_it: int,
                      note: str = "") -> list[str]:
    """A markdown table of one evaluation kind (``heldout`` / ``probe``): before and after with
    intervals and the paired difference, or one column when only one evaluation exists."""
    from diffalign.evaluation import Evaluation, metric_label, metric_order

    evs = [Evaluation.from_records(x["records"], meta=x.get("meta")) if x else None for x in (before, after)]
    ev_a, ev_b = evs
    lines = [f"## {title}", ""]
    if note:
        lines += [note, ""]
    if ev_a is None or ev_b is None or first_it == last_it:
        ev = ev_b or ev_a
        it = last_it if ev_b is not None else first_it
        lines += [f"| metric | iteration {it} |", "|---|---:|"]
        lines += [f"| {metric_label(k)} | {ev.intervals[k].format()} |" for k in metric_order(list(ev.intervals))]
        return lines + [""]
    try:
        diff = ev_b.compare(ev_a)
        paired = ""
    except ValueError:
        diff, paired = {}, " (not paired: the two evaluations used different prompt lists)"
    n = ev_b.meta.get("num_images", len(ev_b.records))
    lines += [f"{n} images, iteration {first_it} vs {last_it} on the same prompts and seed{paired}.", "",
              f"| metric | before (iteration {first_it}) | after (iteration {last_it}) | paired difference |",
              "|---|---:|---:|---:|"]
    for k in metric_order(list(ev_b.intervals)):
        a = ev_a.intervals.get(k)
        d = diff.get(k)
        lines.append(f"| {metric_label(k)} | {a.format() if a else '-'} | {ev_b.intervals[k].format()} | "
                     f"{d.format() if d else '-'} |")
    return lines + [""]


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    log = runs.MetricsLog(run_dir / "metrics.jsonl").read()
    records = [r for r in log if not r.get("eval")]
    evals = [r for r in log if r.get("eval")]
    (run_dir / "report").mkdir(exist_ok=True)
    lines = [f"# diffalign run report: `{run_dir.name}`", ""]
    meta_file = run_dir / "final" / "diffalign.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        lines += [f"- base model: `{meta.get('base_model')}` ({meta.get('family')})",
                  f"- algorithm: `{meta.get('algorithm')}`, reward: `{meta.get('reward')}`, iterations: {meta.get('iterations')}",
                  f"- weights: `final/` ({meta.get('format')}{', EMA' if meta.get('ema') else ''})", ""]
    if records:
        secs = sum(r.get("seconds", 0) for r in records)
        lines += [f"{len(records)} iterations in {secs / 60:.1f} min of training (this log).", ""]
        _plot_curves(records, evals, run_dir / "report" / "curves.png")
        lines += ["![reward curves](report/curves.png)", ""]
    if evals:
        from diffalign.evaluation import is_bound_key

        first, last = evals[0], evals[-1]
        rec_a, rec_b = _read_eval_records(run_dir, first["iteration"]), _read_eval_records(run_dir, last["iteration"])
        if (rec_a or rec_b) and (rec_a or rec_b).get("heldout"):
            lines += _interval_section("Held-out evaluation", (rec_a or {}).get("heldout"), (rec_b or {}).get("heldout"),
                                       first["iteration"], last["iteration"],
                                       "Held-out prompts never used in training, plus the in-distribution families.")
            if (rec_a or {}).get("probe") or (rec_b or {}).get("probe"):
                lines += _interval_section(
                    "Generalisation probe (reported apart)", (rec_a or {}).get("probe"), (rec_b or {}).get("probe"),
                    first["iteration"], last["iteration"],
                    "Prompts naming colour-shape pairs that never occur in training; not the headline.")
            from diffalign.evaluation import LEGEND

            lines += [LEGEND + " In-distribution families have every prompt in training; they are evaluated on fresh "
                      "seeds.", ""]
            a, b = first.get("eval/reward_mean"), last.get("eval/reward_mean")
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                lines += [f"Training reward on the held-out images: {a:.3f} -> {b:.3f} ({b - a:+.3f}).", ""]
        else:
            keys = [k for k in last if k.startswith("eval/") and k not in ("eval/seconds", "eval/num_images", "eval/frames")
                    and not is_bound_key(k) and isinstance(last[k], (int, float))]
            lines += [f"## Evaluation: iteration {first['iteration']} vs {last['iteration']}", "",
                      "| metric | before | after | change |", "|---|---:|---:|---:|"]
            for k in keys:
                a, b = first.get(k), last.get(k)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    lines.append(f"| {k[5:]} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
            lines.append("")
        grid_a = run_dir / "samples" / f"eval-iter-{first['iteration']:06d}.png"
        grid_b = run_dir / "samples" / f"eval-iter-{last['iteration']:06d}.png"
        frames = last.get("eval/frames")
        if grid_a.exists() and grid_b.exists() and grid_a != grid_b:
            lines += ["## Samples on eval prompts (same seeds)", ""]
            if frames:
                lines += [f"Videos of {frames} frames: one row per video, up to 8 frames evenly spaced from the first "
                          "to the last, left to right.", ""]
            lines += [f"Before (iteration {first['iteration']}):", "", f"![before](samples/{grid_a.name})", "",
                      f"After (iteration {last['iteration']}):", "", f"![after](samples/{grid_b.name})", ""]
            prompts_file = run_dir / "samples" / "eval-prompts.txt"
            if prompts_file.exists():
                names = prompts_file.read_text().splitlines()
                layout = "one video per row" if frames else "row by row, 8 per row"
                lines += [f"<details><summary>Prompts of the grids ({layout})</summary>", ""]
                lines += [f"{i + 1}. {p}" for i, p in enumerate(names)] + ["", "</details>", ""]
    path = run_dir / "report.md"
    runs.atomic_write_text(path, "\n".join(lines) + "\n")
    return path
