"""``report.md`` for a run directory: a verdict, reward curves, eval before/after, sample grids
(for video models, frame strips: one row per video, frames left to right).

The first line after the title is the verdict: what the last evaluation changed against the
first (the base model when the run evaluated it before training), inside or outside noise, and
at which guidance scale. With ShapesWorld prompts the trainer keeps every evaluation's per-image
records (``eval_records/iter-N.json``); the verdict is then the held-out accuracy (mean of the
families) with its 95 % paired bootstrap interval, and the report shows the held-out table with
intervals before and after training, the paired difference (same prompts and seeds) and the
generalisation probe, apart. Other runs keep per-image rewards there, and the verdict pairs the
eval reward image by image (:func:`diffalign.stats.paired_difference`); without them it is the
change of the mean, stated as without interval.

A training-reward drift (the last window of iterations below the best earlier window by more
than noise, :func:`reward_drift`) is flagged in one line below the verdict. A run with the
reward-hacking guard (``train.guard``) shows the learned reward and the verifier in the reward
panel (the verifier on its own axis, divergences marked) and says in one paragraph what the guard
saw (:func:`guard_summary`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from diffalign import runs, stats
from diffalign.best_scale import BestScaleComparison
from diffalign.evaluation import LEGEND, Evaluation, is_bound_key, metric_label, metric_order
from diffalign.runs import eval_records_path
from diffalign.stats import Difference

DRIFT_WINDOW = 8  # iterations per window of the drift check (a quarter of the run when shorter)
MIN_DRIFT_WINDOW = 2  # shorter runs (under 8 iterations) get no drift check
BAND_MIN_EVALS = 3  # an interval band needs at least 3 evaluations; fewer get error bars
_SKIP_KEYS = ("eval/seconds", "eval/num_images", "eval/frames")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def iterations_done(record: dict) -> int:
    """The iterations trained when a training record's iteration ended: its 0-based ``iteration``
    + 1. The report numbers everything this way, as the evaluations (iteration 0 = before training,
    N = after N iterations) and the training log's ``iteration k/N`` lines do."""
    return record["iteration"] + 1


# --------------------------------------------------------------------------------------------
# Training-reward drift
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardDrift:
    """The last window of iterations against the best earlier window (not overlapping it)."""

    window: int  # iterations per window
    best: tuple[int, int]  # first and last iteration of the best window (1 = the first iteration, :func:`iterations_done`)
    last: tuple[int, int]  # first and last iteration of the last window
    best_mean: float
    last_mean: float
    difference: Difference  # last_mean - best_mean, 95 % bootstrap over iterations

    @property
    def flagged(self) -> bool:
        """True when the last window is below the best one by more than noise."""
        return self.difference.hi < 0

    def format(self) -> str:
        d = self.difference
        return (f"**Training reward drift:** the mean training reward of the last {self.window} iterations "
                f"({self.last[0]}-{self.last[1]}) is {self.last_mean:.3f}, below the best {self.window} "
                f"({self.best[0]}-{self.best[1]}) at {self.best_mean:.3f}: {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}] "
                "(95 % bootstrap over iterations). Each iteration scores its own prompts with a changing policy; "
                "the held-out evaluation, not the training reward, is the measure.")


def reward_drift(records: Sequence[dict], window: int = DRIFT_WINDOW) -> RewardDrift | None:
    """The drift of the per-iteration ``reward_mean`` of training records (iteration order):
    the mean of the last ``w`` iterations against the best mean of ``w`` consecutive iterations
    that end before the last window starts, ``w = min(window, n // 4)``. None when fewer than
    :data:`MIN_DRIFT_WINDOW` iterations per window are possible. The interval resamples the
    iterations of each window (:func:`diffalign.stats.bootstrap_mean_difference`); the best
    window is chosen on the same numbers, so the check leans towards flagging."""
    points = [(iterations_done(r), float(r["reward_mean"])) for r in records if _number(r.get("reward_mean"))]
    n = len(points)
    w = min(window, n // 4)
    if w < MIN_DRIFT_WINDOW:
        return None
    values = [v for _, v in points]
    means = [sum(values[s:s + w]) / w for s in range(n - 2 * w + 1)]
    s = max(range(len(means)), key=lambda i: (means[i], -i))  # the first of equal bests
    last_mean = sum(values[n - w:]) / w
    diff = stats.bootstrap_mean_difference(values[s:s + w], values[n - w:])
    return RewardDrift(w, (points[s][0], points[s + w - 1][0]), (points[n - w][0], points[-1][0]), means[s], last_mean,
                       diff)


# --------------------------------------------------------------------------------------------
# Curves
# --------------------------------------------------------------------------------------------


def _accuracy_points(evals: Sequence[dict]) -> list[tuple[int, float, float, float]] | None:
    """``(iteration, acc/overall, lo, hi)`` of every evaluation, or None unless all have them."""
    keys = ("eval/acc/overall", "eval/acc/overall_lo", "eval/acc/overall_hi")
    if not evals or not all(all(_number(e.get(k)) for k in keys) for e in evals):
        return None
    return [(e["iteration"], *(float(e[k]) for k in keys)) for e in evals]


def curve_figure(records: Sequence[dict], evals: Sequence[dict], drift: RewardDrift | None = None):
    """The training reward per iteration (left; a flagged drift shades its two windows) and the
    held-out curve (right), on one integer iteration axis (:func:`iterations_done`): a marker at every evaluation; ShapesWorld accuracy with its 95 %
    interval as a band from :data:`BAND_MIN_EVALS` evaluations on, as error bars below that."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    # one iteration axis for both panels: evaluations at 0 (before training) .. N, iteration k's reward at k
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharex=True)
    its = [iterations_done(r) for r in records]
    guarded = [r for r in records if "guard/verifier" in r]
    if guarded:  # the reward-hacking guard: the learned reward the method trains on, and the verifier
        axes[0].plot([iterations_done(r) for r in guarded], [r.get("guard/learned") for r in guarded], marker="o", ms=3,
                     label="learned reward (trained on)")
    else:
        axes[0].plot(its, [r.get("reward_mean") for r in records], marker="o", ms=3, label="train reward (mean)")
    if drift is not None and drift.flagged:
        for (a, b), colour, name in ((drift.best, "C2", "best window"), (drift.last, "C3", "last window")):
            axes[0].axvspan(a - 0.5, b + 0.5, color=colour, alpha=0.12, lw=0, label=name)
    if guarded:
        _plot_verifier(axes[0], guarded)
    elif drift is not None and drift.flagged:
        axes[0].legend(fontsize=7, loc="best")
    axes[0].set_xlabel("iteration")
    axes[0].set_title("learned reward and verifier" if guarded else "training reward")
    axes[0].grid(alpha=0.3)
    ax = axes[1]
    points = _accuracy_points(evals)
    if points:
        x, y, lo, hi = (list(v) for v in zip(*points))
        if len(points) >= BAND_MIN_EVALS:
            ax.fill_between(x, lo, hi, color="C1", alpha=0.2, lw=0, label="95 % interval (bootstrap over prompts)")
            ax.plot(x, y, marker="o", ms=4, color="C1", label="accuracy (mean of families)")
        else:
            ax.errorbar(x, y, yerr=[[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]], marker="o", ms=4,
                        color="C1", capsize=4, label="accuracy, 95 % interval")
        ax.set_title("held-out accuracy")
        ax.legend(fontsize=7, loc="best")
    else:
        shown = [e for e in evals if _number(e.get("eval/reward_mean"))]
        if shown:
            ax.plot([e["iteration"] for e in shown], [e["eval/reward_mean"] for e in shown], marker="o", ms=4, color="C1")
        ax.set_title("eval reward (held-out prompts)")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _plot_verifier(ax, guarded: Sequence[dict]) -> None:
    """The guard's verifier on a second axis of the training-reward panel (its own units), with the
    iterations where the two curves diverged marked, and one legend for both axes."""
    twin = ax.twinx()
    x = [iterations_done(r) for r in guarded]
    twin.plot(x, [r.get("guard/verifier") for r in guarded], marker="s", ms=3, color="C4", label="verifier (right axis)")
    bad = [r for r in guarded if r.get("guard/diverged")]
    if bad:
        twin.plot([iterations_done(r) for r in bad], [r["guard/verifier"] for r in bad], "x", ms=7, color="C3",
                  label="diverged (guard)")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=7, loc="best")


def guard_summary(records: Sequence[dict], config: dict) -> str | None:
    """One paragraph on the reward-hacking guard (``train.guard``): the verifier's first and last
    score beside the learned reward's, the iterations where the two diverged and what the guard did
    (numbered as the curves, :func:`iterations_done`); None when the run had no verifier."""
    guarded = [r for r in records if _number(r.get("guard/verifier")) and _number(r.get("guard/learned"))]
    if not guarded:
        return None
    guard = ((config.get("train") or {}).get("guard") or {})
    first, last = guarded[0], guarded[-1]
    text = (f"**Reward-hacking guard:** verifier `{guard.get('verifier', '?')}` on the rollouts' final images "
            f"{first['guard/verifier']:.3f} -> {last['guard/verifier']:.3f} (iterations {iterations_done(first)}-{iterations_done(last)}) "
            f"while the learned reward went {first['guard/learned']:.3f} -> {last['guard/learned']:.3f}.")
    diverged = [iterations_done(r) for r in records if r.get("guard/diverged")]
    if diverged:
        drops = [iterations_done(r) for r in records if r.get("guard/lr_drop")]
        text += (f" The learned reward rose while the verifier fell (train.guard's rule) at iterations "
                 f"{', '.join(map(str, diverged))}")
        text += f"; the learning rate was lowered at {', '.join(map(str, drops))}." if drops else "."
        if any(r.get("guard/stop") for r in records):
            text += f" The guard stopped the run after iteration {diverged[-1]}."
    else:
        text += " The two never diverged by the guard's rule."
    return text


def _plot_curves(records: list[dict], evals: list[dict], path: Path, drift: RewardDrift | None) -> None:
    import matplotlib.pyplot as plt

    fig = curve_figure(records, evals, drift)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _marks_note(evals: Sequence[dict]) -> str:
    """One line under the curves: where the held-out marks are and how to get more."""
    its = [e["iteration"] for e in evals]
    what = "held-out accuracy" if _accuracy_points(evals) else "eval reward"
    if len(its) >= BAND_MIN_EVALS:
        band = ", the band its 95 % interval" if what == "held-out accuracy" else ""
        return f"The {what} curve has a mark at each of {len(its)} evaluations (iterations {', '.join(map(str, its))}){band}."
    bars = " with 95 % error bars" if what == "held-out accuracy" else ""
    at = " and ".join(map(str, its))
    return (f"The {what} curve has {len(its)} mark{'s' if len(its) != 1 else ''}{bars} (iteration{'s' if len(its) != 1 else ''} "
            f"{at}), too few for a band; `eval.every=N` evaluates every N iterations as well (each costs one "
            "evaluation's time, without the probe).")


# --------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------


def _run_config(run_dir: Path) -> dict:
    """The run's ``config.yaml`` as a mapping ({} when missing or unreadable: the report still renders)."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _against(first_iteration: int, guidance_scale) -> str:
    scale = f" (CFG {guidance_scale:g})" if _number(guidance_scale) else ""
    if first_iteration == 0:
        return f"against the base at the same guidance scale{scale}"
    return f"against iteration {first_iteration} at the same guidance scale{scale} (the base was not evaluated)"


def _reward_records(saved: dict) -> list[dict] | None:
    """Per-image eval rewards as :mod:`diffalign.stats` records (one family; the reward as ``score``,
    so the ``partial`` metric is the mean reward), or None when not recorded."""
    rewards = (saved or {}).get("rewards") or {}
    prompts, values = rewards.get("prompts"), rewards.get("values")
    if not isinstance(prompts, list) or not isinstance(values, list) or len(prompts) != len(values):
        return None
    return [{"prompt": p, "family": "all", "passed": False, "score": v} for p, v in zip(prompts, values)]


def _paired_reward(rec_a: dict | None, rec_b: dict | None) -> Difference | str | None:
    """The paired difference of the mean eval reward (images whose reward is not finite in either
    evaluation left out of both), a reason when the two cannot be paired, None without records."""
    a, b = _reward_records(rec_a), _reward_records(rec_b)
    if a is None or b is None:
        return None
    if [r["prompt"] for r in a] != [r["prompt"] for r in b]:
        return "not paired: the two evaluations used different prompts"
    keep = [i for i, (x, y) in enumerate(zip(a, b)) if _number(x["score"]) and _number(y["score"])]
    if not keep:
        return "no image with a finite reward in both evaluations"
    return stats.paired_difference([a[i] for i in keep], [b[i] for i in keep],
                                   resamples=stats.DEFAULT_RESAMPLES, seed=stats.DEFAULT_SEED)["partial"]


def _noise(d: Difference) -> str:
    return "outside noise" if d.outside_noise else "within noise"


def verdict(evals: Sequence[dict], rec_a: dict | None, rec_b: dict | None, config: dict) -> str:
    """The report's first line: the first and the last evaluation of ``evals`` compared.
    ``rec_a`` / ``rec_b``: their ``eval_records`` files (None when absent); ``config``: the run's
    ``config.yaml``."""
    if not evals:
        return "**Verdict:** none: this log holds no evaluation (the run ended before its first one, or eval.at_start=false)."
    first, last = evals[0], evals[-1]
    held_a, held_b = (rec_a or {}).get("heldout"), (rec_b or {}).get("heldout")
    scale = next((x["meta"]["guidance_scale"] for x in (held_b, held_a) if x and _number(x.get("meta", {}).get("guidance_scale"))),
                 (config.get("sampling") or {}).get("guidance_scale"))
    against = _against(first["iteration"], scale)
    if len(evals) == 1 or first["iteration"] == last["iteration"]:
        points = _accuracy_points([last])
        value = (f"held-out accuracy {points[0][1]:.3f} [{points[0][2]:.3f}, {points[0][3]:.3f}]" if points
                 else f"eval reward {last.get('eval/reward_mean', float('nan')):.3f}")
        return f"**Verdict:** one evaluation only (iteration {last['iteration']}): {value}; nothing to compare it with."
    if held_a and held_b:
        ev_a, ev_b = (Evaluation.from_records(x["records"]) for x in (held_a, held_b))
        a, b = ev_a.intervals["acc/overall"].value, ev_b.intervals["acc/overall"].value
        try:
            diff = ev_b.compare(ev_a)
        except ValueError:
            return (f"**Verdict:** held-out accuracy {a:.3f} -> {b:.3f} ({b - a:+.3f}; not paired: the two evaluations "
                    f"used different prompt lists) {against}.")
        d = diff["acc/overall"]
        families = [f"{k[4:]} {diff[k].value:+.3f}" for k in metric_order(list(diff))
                    if k.startswith("acc/") and k not in ("acc/overall", "acc/images") and diff[k].outside_noise]
        by_family = f"outside noise by family: {', '.join(families)}" if families else "no family outside noise"
        return (f"**Verdict:** held-out accuracy {a:.3f} -> {b:.3f} ({d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}], "
                f"{_noise(d)}) {against}; {by_family}.")
    reward = (config.get("reward") or {}).get("name")
    name = f"eval reward ({reward})" if reward else "eval reward"
    a, b = first.get("eval/reward_mean"), last.get("eval/reward_mean")
    if not (_number(a) and _number(b)):
        return f"**Verdict:** none: the evaluations at iterations {first['iteration']} and {last['iteration']} hold no mean reward."
    paired = _paired_reward(rec_a, rec_b)
    if isinstance(paired, Difference):
        return (f"**Verdict:** {name} {a:.3f} -> {b:.3f} ({paired.value:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}], "
                f"{_noise(paired)}; 95 % paired bootstrap over prompts) {against}.")
    why = paired or "no per-image rewards recorded"
    return f"**Verdict:** {name} {a:.3f} -> {b:.3f} ({b - a:+.3f}, without interval: {why}) {against}."


def best_scale_line(rec_b: dict | None) -> str | None:
    """The line under the verdict when the last evaluation compared the base and the trained
    weights each at its validation-best CFG scale (``eval.best_scale``); None when it did not."""
    summary = (rec_b or {}).get("best_scale")
    if not summary:
        return None
    try:
        comparison = BestScaleComparison.from_json(summary["comparison"])
    except (KeyError, TypeError, ValueError):
        return None
    rates = lambda model: ", ".join(f"CFG {k} {v:.3f}" for k, v in summary[model]["validation"].items())
    return (f"**{comparison.sentence()}** (held-out prompts, 95 % paired bootstrap over prompts; the scales chosen on "
            f"validation prompts by per-image pass rate: base {rates('base')}; trained {rates('trained')}).")


def _read_eval_records(run_dir: Path, iteration: int) -> dict | None:
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


def evaluation_summary(run_dir: str | Path) -> list[str] | None:
    """The verdict and, for ShapesWorld runs, the held-out table with intervals and paired
    differences, as markdown lines (what a model card quotes); None when the run logged no
    evaluation."""
    run_dir = Path(run_dir)
    evals = [r for r in runs.MetricsLog(run_dir / "metrics.jsonl").read() if r.get("eval")]
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    rec_a, rec_b = _read_eval_records(run_dir, first["iteration"]), _read_eval_records(run_dir, last["iteration"])
    lines = [verdict(evals, rec_a, rec_b, _run_config(run_dir)), ""]
    best = best_scale_line(rec_b)
    if best:
        lines += [best, ""]
    if (rec_a or rec_b or {}).get("heldout"):
        section = _interval_section("Held-out evaluation", (rec_a or {}).get("heldout"), (rec_b or {}).get("heldout"),
                                    first["iteration"], last["iteration"])
        lines += section[2:] + [LEGEND, ""]  # without the section's own heading
    return lines


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    log = runs.MetricsLog(run_dir / "metrics.jsonl").read()
    records = [r for r in log if not r.get("eval")]
    evals = [r for r in log if r.get("eval")]
    config = _run_config(run_dir)
    (run_dir / "report").mkdir(exist_ok=True)
    first, last = (evals[0], evals[-1]) if evals else (None, None)
    rec_a = _read_eval_records(run_dir, first["iteration"]) if first else None
    rec_b = _read_eval_records(run_dir, last["iteration"]) if last else None
    drift = reward_drift(records)
    lines = [f"# diffalign run report: `{run_dir.name}`", "", verdict(evals, rec_a, rec_b, config), ""]
    best = best_scale_line(rec_b)
    if best:
        lines += [best, ""]
    if drift is not None and drift.flagged:
        lines += [drift.format(), ""]
    guard = guard_summary(records, config)
    if guard is not None:
        lines += [guard, ""]
    meta_file = run_dir / "final" / "diffalign.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        lines += [f"- base model: `{meta.get('base_model')}` ({meta.get('family')})",
                  f"- algorithm: `{meta.get('algorithm')}`, reward: `{meta.get('reward')}`, iterations: {meta.get('iterations')}",
                  f"- weights: `final/` ({meta.get('format')}{', EMA' if meta.get('ema') else ''})", ""]
    if records:
        secs = sum(r.get("seconds", 0) for r in records)
        lines += [f"{len(records)} iterations in {secs / 60:.1f} min of training (this log).", ""]
        _plot_curves(records, evals, run_dir / "report" / "curves.png", drift)
        lines += ["![reward curves](report/curves.png)", ""]
        if evals:
            lines += [_marks_note(evals), ""]
    shapes = bool((rec_a or rec_b or {}).get("heldout"))
    if evals:
        if shapes:
            lines += _interval_section("Held-out evaluation", (rec_a or {}).get("heldout"), (rec_b or {}).get("heldout"),
                                       first["iteration"], last["iteration"],
                                       "Held-out prompts never used in training, plus the in-distribution families. "
                                       + ("The base model may do better at another guidance scale: the line under the "
                                          "verdict compares both models, each at its validation-best CFG scale."
                                          if best else
                                          "The base model may do better at another guidance scale: "
                                          f"`diffalign eval {run_dir} --best-scale` evaluates each model at its "
                                          "validation-best CFG scale and pairs the run against the base there "
                                          "(`eval.best_scale: true` does it at the end of a run)."))
            if (rec_a or {}).get("probe") or (rec_b or {}).get("probe"):
                lines += _interval_section(
                    "Generalisation probe (reported apart)", (rec_a or {}).get("probe"), (rec_b or {}).get("probe"),
                    first["iteration"], last["iteration"],
                    "Prompts naming colour-shape pairs that never occur in training; not the headline.")

            lines += [LEGEND + " In-distribution families have every prompt in training; they are evaluated on fresh "
                      "seeds.", ""]
            a, b = first.get("eval/reward_mean"), last.get("eval/reward_mean")
            if _number(a) and _number(b):
                lines += [f"Training reward on the held-out images: {a:.3f} -> {b:.3f} ({b - a:+.3f}).", ""]
        else:
            keys = [k for k in last if k.startswith("eval/") and k not in _SKIP_KEYS
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
            elif shapes:
                lines += ["One row per GenEval family, in the order of the held-out table, the same images before and "
                          "after: each labelled with its prompt and pass (green) or fail (red) under ShapesEval.", ""]
            else:
                lines += ["The first eval images, the same before and after: each labelled with its prompt and reward.", ""]
            lines += [f"Before (iteration {first['iteration']}):", "", f"![before](samples/{grid_a.name})", "",
                      f"After (iteration {last['iteration']}):", "", f"![after](samples/{grid_b.name})", ""]
            prompts_file = run_dir / "samples" / "eval-prompts.txt"
            if prompts_file.exists():
                names = prompts_file.read_text().splitlines()
                layout = "one video per row" if frames else "row by row, left to right"
                lines += [f"<details><summary>Prompts of the grids ({layout})</summary>", ""]
                lines += [f"{i + 1}. {p}" for i, p in enumerate(names)] + ["", "</details>", ""]
    path = run_dir / "report.md"
    runs.atomic_write_text(path, "\n".join(lines) + "\n")
    return path
