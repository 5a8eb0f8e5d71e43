"""report.md of a run: the verdict, the drift flag, the curves, grids by family; for ShapesWorld
intervals before/after, the paired difference, the probe."""

import json

import numpy as np
import pytest

from diffalign.evaluation import Evaluation, interval_record
from diffalign.report import curve_figure, reward_drift, write_report
from diffalign.training.evaluator import eval_records_path, grid_rows


def fake_records(passes: dict[str, list[list[bool]]]) -> list[dict]:
    """passes: family -> per prompt, per image outcomes."""
    return [{"prompt": f"{fam} prompt {i}", "family": fam, "passed": ok, "score": 1.0 if ok else 0.25}
            for fam, prompts in passes.items() for i, outcomes in enumerate(prompts) for ok in outcomes]


def write_eval(run, iteration, heldout, probe=None):
    ev = Evaluation.from_records(heldout, meta={"num_images": len(heldout)})
    record = {"iteration": iteration, "eval": True, "eval/reward_mean": ev.metrics["partial"], "eval/num_images": len(heldout),
              **interval_record(ev.intervals, "eval/")}
    saved = {"iteration": iteration, "heldout": ev.to_json()}
    if probe is not None:
        pev = Evaluation.from_records(probe, meta={"num_images": len(probe)})
        record.update(interval_record(pev.intervals, "eval/probe/"))
        saved["probe"] = pev.to_json()
    path = eval_records_path(run, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved))
    return record


def test_report_shows_intervals_paired_difference_and_probe(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # 8 prompts per family, 4 images each; after training every prompt of "colors" gains one image
    before = {"single_object": [[True, False, False, False]] * 3, "colors": [[j < i % 4 for j in range(4)] for i in range(8)]}
    after = {"single_object": before["single_object"], "colors": [[j < i % 4 + 1 for j in range(4)] for i in range(8)]}
    probe = {"color_attr": [[False, False]] * 5}
    log = [write_eval(run, 0, fake_records(before), fake_records(probe)),
           {"iteration": 0, "reward_mean": 0.3, "seconds": 1.0},
           {"iteration": 1, "reward_mean": 0.4, "seconds": 1.0},
           write_eval(run, 1, fake_records(before)),  # an intermediate evaluation: no probe
           write_eval(run, 2, fake_records(after), fake_records(probe))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    text = write_report(run).read_text()
    assert "## Held-out evaluation" in text and "## Generalisation probe (reported apart)" in text
    assert "| metric | before (iteration 0) | after (iteration 2) | paired difference |" in text
    colors = next(line for line in text.splitlines() if line.startswith("| acc/colors |"))
    assert colors.endswith("| +0.250 [+0.250, +0.250] * |")  # one more image of four on every prompt
    single = next(line for line in text.splitlines() if line.startswith("| acc/single_object (in-distribution) |"))
    assert single.endswith("| +0.000 [+0.000, +0.000] |")
    probe_rows = text.split("## Generalisation probe")[1]
    assert "| acc/color_attr | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | +0.000 [+0.000, +0.000] |" in probe_rows
    assert "stratified bootstrap" in text and "(report/curves.png)" in text
    assert (run / "report" / "curves.png").stat().st_size > 1000


def test_report_without_records_keeps_the_plain_table(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = [{"iteration": 0, "eval": True, "eval/reward_mean": 0.2, "eval/num_images": 4},
           {"iteration": 0, "reward_mean": 0.3, "seconds": 1.0},
           {"iteration": 1, "eval": True, "eval/reward_mean": 0.5, "eval/num_images": 4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    text = write_report(run).read_text()
    assert "| reward_mean | 0.200 | 0.500 | +0.300 |" in text and "paired difference" not in text


# --------------------------------------------------------------------------------------------
# The verdict line
# --------------------------------------------------------------------------------------------


def write_run(run, log, config="sampling:\n  guidance_scale: 4.0\n"):
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return write_report(run).read_text().splitlines()


def test_verdict_outside_noise_names_the_families_that_moved(tmp_path):
    # single_object: 4 prompts, 1 pass of 4 images each (0.25), unchanged; colors: 8 prompts of 5
    # images, i % 4 passes before (12 / 40 = 0.3) and one more after (20 / 40 = 0.5). Every prompt
    # resample keeps colors +0.2 and single_object 0, so overall (their mean) is +0.1 exactly.
    before = {"single_object": [[True, False, False, False]] * 4, "colors": [[j < i % 4 for j in range(5)] for i in range(8)]}
    after = {**before, "colors": [[j < i % 4 + 1 for j in range(5)] for i in range(8)]}
    run = tmp_path / "run"
    lines = write_run(run, [write_eval(run, 0, fake_records(before)), {"iteration": 0, "reward_mean": 0.3},
                            write_eval(run, 1, fake_records(after))])
    assert lines[0] == "# diffalign run report: `run`" and lines[1] == ""
    assert lines[2] == ("**Verdict:** held-out accuracy 0.275 -> 0.375 (+0.100 [+0.100, +0.100], outside noise) against "
                        "the base at the same guidance scale (CFG 4); outside noise by family: colors +0.200.")


def test_verdict_within_noise(tmp_path):
    # single_object: one image per prompt, two prompts swap pass and fail (difference 0, resamples
    # of -1, +1, 0, 0 straddle it); colors unchanged. Overall 0.4 before and after.
    colors = [[j < i % 4 for j in range(5)] for i in range(8)]
    before = {"single_object": [[True], [False], [True], [False]], "colors": colors}
    after = {"single_object": [[False], [True], [True], [False]], "colors": colors}
    run = tmp_path / "run"
    lines = write_run(run, [write_eval(run, 3, fake_records(before)), {"iteration": 3, "reward_mean": 0.3},
                            write_eval(run, 4, fake_records(after))])
    verdict = lines[2]
    assert verdict.startswith("**Verdict:** held-out accuracy 0.400 -> 0.400 (+0.000 [-")
    assert verdict.endswith("], within noise) against iteration 3 at the same guidance scale (CFG 4) (the base was not "
                            "evaluated); no family outside noise.")


def reward_eval(run, iteration, prompts, values):
    path = eval_records_path(run, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"iteration": iteration, "rewards": {"prompts": prompts, "values": values}}))
    finite = [v for v in values if v is not None]
    return {"iteration": iteration, "eval": True, "eval/reward_mean": sum(finite) / len(finite), "eval/num_images": len(values)}


def test_verdict_of_another_reward_pairs_per_image_rewards(tmp_path):
    prompts = ["a cat", "a dog", "a fox", "a cow", "an owl"]
    config = "sampling:\n  guidance_scale: 4.5\nreward:\n  name: pickscore\n"
    run = tmp_path / "run"
    # every image gains 0.2; the fifth has no finite reward after training and is left out of both
    log = [reward_eval(run, 0, prompts, [0.1, 0.2, 0.3, 0.4, 0.9]), {"iteration": 0, "reward_mean": 0.3},
           reward_eval(run, 1, prompts, [0.3, 0.4, 0.5, 0.6, None])]
    log[0]["eval/reward_mean"] = 0.25  # the mean the trainer logs: finite rewards of the first four
    assert write_run(run, log, config)[2] == (
        "**Verdict:** eval reward (pickscore) 0.250 -> 0.450 (+0.200 [+0.200, +0.200], outside noise; 95 % paired "
        "bootstrap over prompts) against the base at the same guidance scale (CFG 4.5).")
    other = tmp_path / "plain"  # no per-image rewards: the change of the mean, without interval
    log = [{"iteration": 0, "eval": True, "eval/reward_mean": 0.25}, {"iteration": 0, "reward_mean": 0.3},
           {"iteration": 1, "eval": True, "eval/reward_mean": 0.45}]
    assert write_run(other, log, config)[2] == (
        "**Verdict:** eval reward (pickscore) 0.250 -> 0.450 (+0.200, without interval: no per-image rewards recorded) "
        "against the base at the same guidance scale (CFG 4.5).")


# --------------------------------------------------------------------------------------------
# Training-reward drift
# --------------------------------------------------------------------------------------------


def train_log(values):
    return [{"iteration": i, "reward_mean": v, "seconds": 1.0} for i, v in enumerate(values)]


def test_drift_is_flagged_when_the_last_window_falls_outside_noise(tmp_path):
    # 24 iterations at 0.8 +- 0.01, then 8 at 0.6 +- 0.01: windows of 8; every earlier window has
    # mean 0.8 (the first one wins the tie), the last 0.6
    values = [0.8 + (0.01 if i % 2 else -0.01) for i in range(24)] + [0.6 + (0.01 if i % 2 else -0.01) for i in range(8)]
    drift = reward_drift(train_log(values))
    # numbered as the log's `iteration k/N` lines and the evaluations: the first iteration is 1
    assert (drift.window, drift.best, drift.last) == (8, (1, 8), (25, 32)) and drift.flagged
    assert drift.best_mean == pytest.approx(0.8) and drift.last_mean == pytest.approx(0.6)
    assert drift.difference.value == pytest.approx(-0.2) and -0.22 <= drift.difference.lo < drift.difference.hi <= -0.18
    run = tmp_path / "run"
    lines = write_run(run, train_log(values))
    assert lines[4].startswith("**Training reward drift:** the mean training reward of the last 8 iterations (25-32) is "
                               "0.600, below the best 8 (1-8) at 0.800: -0.200 [-0.")
    assert lines[4].endswith("the held-out evaluation, not the training reward, is the measure.")


def test_no_drift_flag_on_a_rising_noisy_or_short_curve(tmp_path):
    rising = [0.3 + 0.01 * i for i in range(32)]
    assert not reward_drift(train_log(rising)).flagged
    # the last window 0.02 below the rest, with iteration-to-iteration swings of +-0.2: within noise
    noisy = [0.5 + (0.2 if i % 2 else -0.2) for i in range(24)] + [0.48 + (0.2 if i % 2 else -0.2) for i in range(8)]
    drift = reward_drift(train_log(noisy))
    assert drift.difference.value == pytest.approx(-0.02) and drift.difference.lo < 0 < drift.difference.hi
    assert not drift.flagged
    assert reward_drift(train_log([0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1])) is None  # windows of 1: no check
    assert "Training reward drift" not in "\n".join(write_run(tmp_path / "run", train_log(noisy)))


# --------------------------------------------------------------------------------------------
# Sample grids by family
# --------------------------------------------------------------------------------------------


def test_grid_rows_spread_over_distinct_prompts_then_other_seeds():
    families = ["a"] * 5 + ["b"] * 10
    prompts = ["p0", "p1", "p0", "p1", "p0"] + [f"q{i}" for i in range(10)]
    # a: 2 distinct prompts, then the next images of them; b: 4 of 10 distinct, j * 10 // 4 = 0, 2, 5, 7
    assert grid_rows(families, prompts, per_family=4) == [[0, 1, 2, 3], [5, 7, 10, 12]]


def test_shapes_grid_draws_every_family_with_pass_and_fail_labels(tmp_path):
    import numpy as np
    import torch
    from PIL import Image

    from diffalign.images import FAIL_COLOR, PASS_COLOR
    from diffalign.shapes import FAMILIES, evaluation_prompts, prompt_family, split_prompts
    from diffalign.training.evaluator import GRID_PER_FAMILY, _save_grid

    prompts = evaluation_prompts(split_prompts().evaluation(), 10)  # 10 images per family, family after family
    records = [{"prompt": p, "family": prompt_family(p), "passed": i % 3 == 0, "score": 0.0} for i, p in enumerate(prompts)]
    images = torch.zeros(len(prompts), 3, 8, 8)
    _save_grid(tmp_path, 0, images, prompts, torch.zeros(len(prompts)), records)
    shown = (tmp_path / "samples" / "eval-prompts.txt").read_text().splitlines()
    assert [prompt_family(p) for p in shown] == [f for f in FAMILIES for _ in range(GRID_PER_FAMILY)]
    path = tmp_path / "samples" / "eval-iter-000000.png"
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    for colour in (PASS_COLOR, FAIL_COLOR):  # both marks are drawn
        assert (pixels == colour).all(axis=1).any()
    assert path.stat().st_size < 300_000
    # another reward: the first images, labelled with their reward
    _save_grid(tmp_path, 1, images[:3], prompts[:3], torch.tensor([0.1, 0.2, 0.3]), None)
    assert (tmp_path / "samples" / "eval-prompts.txt").read_text().splitlines() == prompts[:3]


# --------------------------------------------------------------------------------------------
# The held-out curve: a band from 3 evaluations, error bars with 2
# --------------------------------------------------------------------------------------------


def accuracy_evals(iterations):
    return [{"iteration": it, "eval": True, "eval/acc/overall": 0.5 + 0.05 * k, "eval/acc/overall_lo": 0.45 + 0.05 * k,
             "eval/acc/overall_hi": 0.55 + 0.05 * k} for k, it in enumerate(iterations)]


def test_curve_with_three_evaluations_draws_a_band_and_markers():
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    fig = curve_figure(train_log([0.1, 0.2, 0.3, 0.4]), accuracy_evals([0, 2, 4]))
    ax = fig.axes[1]
    assert any(isinstance(c, PolyCollection) for c in ax.collections) and not ax.containers
    (line,) = ax.get_lines()
    assert line.get_marker() == "o" and list(line.get_xdata()) == [0, 2, 4]
    plt.close(fig)


def test_both_panels_count_iterations_alike_with_integer_ticks():
    """Training record ``iteration`` 0 (logged as `iteration 1/2`) is plotted at 1; evaluations at 0
    (before training) and 2 (after two iterations); one shared axis with whole-number ticks."""
    import matplotlib.pyplot as plt

    fig = curve_figure(train_log([0.1, 0.2]), accuracy_evals([0, 2]))
    train_ax, eval_ax = fig.axes
    assert list(train_ax.get_lines()[0].get_xdata()) == [1, 2]
    assert list(eval_ax.containers[0].lines[0].get_xdata()) == [0, 2]
    assert train_ax.get_xlim() == eval_ax.get_xlim()
    fig.canvas.draw()
    for ax in (train_ax, eval_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


def test_curve_with_two_evaluations_draws_error_bars_and_says_how_to_get_more(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer

    fig = curve_figure(train_log([0.1, 0.2]), accuracy_evals([0, 2]))
    ax = fig.axes[1]
    assert not any(isinstance(c, PolyCollection) for c in ax.collections)
    (bars,) = ax.containers
    assert isinstance(bars, ErrorbarContainer)
    data_line = bars.lines[0]
    assert data_line.get_marker() == "o" and list(data_line.get_xdata()) == [0, 2]
    segments = np.asarray(bars.lines[2][0].get_segments())  # (points, 2 ends, xy)
    low, high = segments[:, 0, 1], segments[:, 1, 1]
    assert low == pytest.approx([0.45, 0.50]) and high == pytest.approx([0.55, 0.60])
    plt.close(fig)
    text = "\n".join(write_run(tmp_path / "run", train_log([0.1, 0.2]) + accuracy_evals([0, 2])))
    assert "2 marks with 95 % error bars (iterations 0 and 2), too few for a band; `eval.every=N`" in text


# --------------------------------------------------------------------------------------------
# The best-scale line (eval.best_scale)
# --------------------------------------------------------------------------------------------


def test_best_scale_line_sits_under_the_verdict(tmp_path):
    from diffalign.best_scale import BestScale, compare_best_scales

    # held-out: base passes 1 of 4 images per prompt, trained 2 of 4, on every prompt: +0.25 exactly
    base_held = fake_records({"colors": [[True, False, False, False]] * 4})
    trained_held = fake_records({"colors": [[True, True, False, False]] * 4})
    validation = lambda rate: Evaluation.from_records(fake_records({"colors": [[j < rate for j in range(4)]] * 2}))
    base = BestScale(2.0, {1.5: validation(1), 2.0: validation(2)}, Evaluation.from_records(base_held))
    trained = BestScale(1.5, {1.5: validation(3), 2.0: validation(3)}, Evaluation.from_records(trained_held))
    run = tmp_path / "run"
    log = [write_eval(run, 0, base_held), {"iteration": 0, "reward_mean": 0.3}, write_eval(run, 1, trained_held)]
    path = eval_records_path(run, 1)
    saved = json.loads(path.read_text())
    saved["best_scale"] = {"base": base.to_json(), "trained": trained.to_json(),
                           "comparison": compare_best_scales(trained, base).to_json()}
    path.write_text(json.dumps(saved))
    lines = write_run(run, log)
    assert lines[2].startswith("**Verdict:**") and lines[3] == ""
    assert lines[4] == ("**At each model's validation-best CFG scale (base CFG 2, trained CFG 1.5): +0.250 [+0.250, +0.250] "
                        "per image, outside noise** (held-out prompts, 95 % paired bootstrap over prompts; the scales chosen "
                        "on validation prompts by per-image pass rate: base CFG 1.5 0.250, CFG 2 0.500; trained CFG 1.5 "
                        "0.750, CFG 2 0.750).")
    assert "the line under the verdict compares both models" in "\n".join(lines)


def test_without_best_scale_the_report_points_to_eval_best_scale(tmp_path):
    run = tmp_path / "run"
    colors = {"colors": [[True, False]] * 4}
    lines = write_run(run, [write_eval(run, 0, fake_records(colors)), {"iteration": 0, "reward_mean": 0.3},
                            write_eval(run, 1, fake_records(colors))])
    text = "\n".join(lines)
    assert "At each model's validation-best" not in text and "guidance_scales.py" not in text
    assert f"`diffalign eval {run} --best-scale`" in text and "eval.best_scale: true" in text
