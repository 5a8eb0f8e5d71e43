"""``report.md`` for a run directory: reward curve, eval before/after, sample grids."""

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
    if evals:
        axes[1].plot([e["iteration"] for e in evals], [e.get("eval/reward_mean") for e in evals], marker="o", color="C1")
    axes[1].set_xlabel("iteration")
    axes[1].set_title("eval reward (held-out prompts)")
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        first, last = evals[0], evals[-1]
        keys = [k for k in last if k.startswith("eval/") and k not in ("eval/seconds", "eval/num_images") and isinstance(last[k], (int, float))]
        lines += [f"## Evaluation: iteration {first['iteration']} vs {last['iteration']}", "",
                  "| metric | before | after | change |", "|---|---:|---:|---:|"]
        for k in keys:
            a, b = first.get(k), last.get(k)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                lines.append(f"| {k[5:]} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
        lines.append("")
        grid_a = run_dir / "samples" / f"eval-iter-{first['iteration']:06d}.png"
        grid_b = run_dir / "samples" / f"eval-iter-{last['iteration']:06d}.png"
        if grid_a.exists() and grid_b.exists() and grid_a != grid_b:
            lines += ["## Samples on eval prompts (same seeds)", "",
                      f"Before (iteration {first['iteration']}):", "", f"![before](samples/{grid_a.name})", "",
                      f"After (iteration {last['iteration']}):", "", f"![after](samples/{grid_b.name})", ""]
            prompts_file = run_dir / "samples" / "eval-prompts.txt"
            if prompts_file.exists():
                names = prompts_file.read_text().splitlines()
                lines += ["<details><summary>Prompts of the grids (row by row, 8 per row)</summary>", ""]
                lines += [f"{i + 1}. {p}" for i, p in enumerate(names)] + ["", "</details>", ""]
    path = run_dir / "report.md"
    runs.atomic_write_text(path, "\n".join(lines) + "\n")
    return path
