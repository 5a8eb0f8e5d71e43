"""diffalign.best_scale: the choice of a CFG scale on validation prompts (ties: the lower scale),
stored evaluations reused and refused, the paired comparison at each model's own scale; and the
three ways in: ``diffalign eval --best-scale``, ``eval.best_scale`` in a run, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffalign.best_scale import (BestScale, BestScaleSpec, cached_evaluation, check_scales, choose_scale,
                                  compare_best_scales, evaluate_best_scale, parse_scales)
from diffalign.errors import DiffalignError
from diffalign.evaluation import Evaluation
from diffalign.shapes import prompt_family
from tests.helpers.tiny_run import ROOT, run_cli

PROMPTS = ["a red cube", "a blue cube", "two red balls", "two blue balls"]


def records(prompts, passed) -> list[dict]:
    """ShapesEval-like records: ``passed[i]`` for image ``i`` of ``prompts`` (families made up)."""
    return [{"prompt": p, "family": "fam " + p.split()[1], "passed": bool(ok), "score": float(ok)}
            for p, ok in zip(prompts, passed)]


def evaluation(passed, prompts=PROMPTS, **meta) -> Evaluation:
    return Evaluation.from_records(records(prompts, passed), meta=meta, resamples=200)


# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------


def test_choose_scale_takes_the_highest_pass_rate_and_the_lower_scale_on_a_tie():
    by_scale = {1.0: evaluation([1, 0, 0, 0]), 1.5: evaluation([1, 1, 1, 0]), 2.0: evaluation([0, 1, 1, 1]),
                4.0: evaluation([1, 1, 0, 0])}
    rates = {s: ev.metrics["acc/images"] for s, ev in by_scale.items()}
    assert rates == {1.0: 0.25, 1.5: 0.75, 2.0: 0.75, 4.0: 0.5}
    assert choose_scale(rates) == 1.5  # 1.5 and 2 tie at 0.75: the lower one
    assert choose_scale({4.0: 0.5, 3.0: 0.5, 2.0: 0.25}) == 3.0  # whatever the order of the keys
    assert choose_scale({"2": 0.5, "1.5": 0.5, "4": 0.5}) == "1.5"  # keys as scale texts (the leaderboard's)
    with pytest.raises(ValueError):
        choose_scale({})


@pytest.mark.parametrize("text, problem", [
    ("2", "at least two"), ("0.5,2", ">= 1"), ("1,x", "comma-separated"), ("2,2", "twice"), ("1,inf", "finite"),
])
def test_bad_scale_grids_name_the_flag(text, problem):
    with pytest.raises(DiffalignError, match=problem) as err:
        parse_scales(text, "--scales")
    assert str(err.value).startswith("--scales ") and "\n" not in str(err.value)


def test_scale_grid_is_sorted():
    assert parse_scales("4, 1,1.5") == [1.0, 1.5, 4.0] and check_scales([2, 1], "eval.scales") == [1.0, 2.0]


# --------------------------------------------------------------------------------------------
# Stored evaluations and one model at its best scale (no sampling: every evaluation is stored)
# --------------------------------------------------------------------------------------------


def tiny_spec(**kw) -> BestScaleSpec:
    validation = ("a photo of a red square", "a photo of two circles")
    heldout = ("a photo of a blue square", "a photo of three circles")
    return BestScaleSpec((1.0, 2.0, 3.0), validation, heldout, validation_images_per_family=2, images_per_family=2,
                         num_steps=2, seed=7, **kw)


def store(path: Path, spec: BestScaleSpec, split: str, scale: float, passed, model: str, **meta_changes) -> None:
    """An evaluation as evaluate_best_scale stores it, with the outcomes ``passed``."""
    items = spec.items(split)
    recs = [{"prompt": p, "family": prompt_family(p), "passed": bool(ok), "score": float(ok)} for p, ok in zip(items, passed)]
    meta = {**spec.expected_meta(split, scale), "model": model, "num_images": len(items), **meta_changes}
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{split}_cfg{scale:g}.json").write_text(json.dumps(Evaluation.from_records(recs, meta=meta).to_json()))


def never_loaded():
    raise AssertionError("a stored evaluation was sampled again")


def test_best_scale_reads_stored_evaluations_chooses_and_evaluates_held_out_there(tmp_path):
    spec = tiny_spec()
    assert spec.items("validation") == ["a photo of two circles"] * 2 + ["a photo of a red square"] * 2  # families in order
    for scale, passed in ((1.0, [1, 0, 0, 0]), (2.0, [1, 1, 0, 0]), (3.0, [0, 1, 1, 0])):  # 2 and 3 tie
        store(tmp_path, spec, "validation", scale, passed, "m")
    store(tmp_path, spec, "heldout", 2.0, [1, 1, 1, 0], "m")
    result = evaluate_best_scale(never_loaded, spec, model="m", cache=tmp_path)
    assert result.scale == 2.0 and result.validation_rates == {1.0: 0.25, 2.0: 0.5, 3.0: 0.5}
    assert result.heldout.metrics["acc/images"] == 0.75
    summary = result.to_json()
    assert summary["scale"] == 2.0 and summary["validation"] == {"1": 0.25, "2": 0.5, "3": 0.5}
    assert summary["heldout_images"] == 4


def test_a_store_of_other_settings_is_refused_with_the_file_named(tmp_path):
    spec = tiny_spec()
    store(tmp_path, spec, "validation", 1.0, [1, 0, 0, 0], "m", seed=8)
    with pytest.raises(DiffalignError, match=r"validation_cfg1\.json was evaluated with other settings \(seed: stored 8, now 7\)"):
        evaluate_best_scale(never_loaded, spec, model="m", cache=tmp_path)
    with pytest.raises(DiffalignError, match="model: stored 'm', now 'other'"):
        store(tmp_path, spec, "validation", 1.0, [1, 0, 0, 0], "m")
        evaluate_best_scale(never_loaded, spec, model="other", cache=tmp_path)
    more = BestScaleSpec(spec.scales, spec.validation_prompts + ("a photo of a green square",), spec.heldout_prompts,
                         validation_images_per_family=2, images_per_family=2, num_steps=2, seed=7)
    with pytest.raises(DiffalignError, match="prompt of image 2: stored 'a photo of a red square', now 'a photo of a green square'"):
        evaluate_best_scale(never_loaded, more, model="m", cache=tmp_path)



def test_cached_evaluation_computes_once_and_writes_whole_files(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return evaluation([1, 0, 1, 0], seed=7)

    path = tmp_path / "sub" / "e.json"
    first = cached_evaluation(path, compute, expect={"seed": 7}, prompts=PROMPTS)
    again = cached_evaluation(path, compute, expect={"seed": 7}, prompts=PROMPTS)
    assert len(calls) == 1 and again.records == first.records and again.meta == first.meta
    assert [p.name for p in path.parent.iterdir()] == ["e.json"]  # no temporary file left behind
    assert cached_evaluation(None, compute).records == first.records and len(calls) == 2  # no folder: computed
    with pytest.raises(DiffalignError, match=r"e\.json was evaluated with other settings \(images: stored 4, now 3\)"):
        cached_evaluation(path, compute, prompts=PROMPTS[:3])  # a list cut shorter (a --num-prompts check)
    path.write_text("{not json")
    with pytest.raises(DiffalignError, match="is not a stored evaluation"):
        cached_evaluation(path, compute)


# --------------------------------------------------------------------------------------------
# Two models, each at its own scale
# --------------------------------------------------------------------------------------------


def at(scale, heldout_passed) -> BestScale:
    return BestScale(scale, {scale: evaluation([1, 1, 0, 0])}, evaluation(heldout_passed))


def test_comparison_pairs_each_model_at_its_own_scale():
    base, trained = at(2.0, [1, 0, 1, 0]), at(1.5, [1, 1, 1, 1])
    comparison = compare_best_scales(trained, base)
    d = comparison.difference
    assert (comparison.base_scale, comparison.trained_scale) == (2.0, 1.5) and d.value == pytest.approx(0.5)
    assert d.lo > 0 and comparison.verdict == "outside noise"
    assert comparison.sentence() == (f"At each model's validation-best CFG scale (base CFG 2, trained CFG 1.5): "
                                     f"+0.500 [{d.lo:+.3f}, {d.hi:+.3f}] per image, outside noise")
    same = compare_best_scales(at(1.5, [1, 0, 1, 0]), base)
    assert same.difference.value == 0 and same.verdict == "within noise"
    assert type(comparison).from_json(json.loads(json.dumps(comparison.to_json()))) == comparison
    with pytest.raises(ValueError):  # held-out evaluations of different lists do not pair
        compare_best_scales(BestScale(1.0, {}, evaluation([1, 1], PROMPTS[:2])), base)


# --------------------------------------------------------------------------------------------
# diffalign eval --best-scale
# --------------------------------------------------------------------------------------------


def tiny_shapes_run(root: Path) -> Path:
    """A finished run of the tiny shapes model whose final weights are the base's own (every paired
    difference is then exactly 0)."""
    from diffalign.adapters import load_adapter
    from diffalign.config_files import dump_config, load_config
    from diffalign.export import save_trained_weights

    run = root / "tinyrun"
    save_trained_weights(load_adapter("tiny:shapes"), run / "final", lora=False,
                         metadata={"base_model": "tiny:shapes", "family": "shapes"})
    (run / "config.yaml").write_text(dump_config(load_config(ROOT / "configs/shapes/flow_grpo.yaml", ["model.id=tiny:shapes"])))
    return run


TINY_EVAL = ["--scales", "1,2", "--validation-images-per-family", "1", "--images-per-family", "1", "--steps", "2",
             "--mixed-precision", "no"]


def test_eval_best_scale_prints_both_tables_and_the_verdict_and_reuses_its_cache(tmp_path):
    run, cache = tiny_shapes_run(tmp_path), tmp_path / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "diffalign.cli", "eval", str(run), "--best-scale", *TINY_EVAL, "--cache", str(cache)]
    first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("best CFG scale per model: chosen on validation prompts") and "6 images per scale" in lines[0]
    assert "base = tiny:shapes" in lines[0] and "tinyrun = tiny:shapes + tinyrun/final" in lines[0]
    assert lines[1].split() == ["CFG", "1", "CFG", "2", "chosen"]
    base_row, run_row = lines[2].split(), lines[3].split()
    assert base_row[0] == "base" and run_row[0] == "tinyrun" and base_row[1:] == run_row[1:]  # the same weights
    chosen = base_row[-1]
    assert chosen in ("1", "2") and base_row[-2] == "CFG"
    assert f"base (CFG {chosen})" in first.stdout and f"tinyrun (CFG {chosen})" in first.stdout and "tinyrun - base" in first.stdout
    assert lines[-1] == (f"tinyrun: At each model's validation-best CFG scale (base CFG {chosen}, tinyrun CFG {chosen}): "
                         "+0.000 [+0.000, +0.000] per image, within noise")
    stored = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*.json"))
    assert stored == sorted([f"{m}/{f}" for m in ("base", "tinyrun")
                             for f in ("validation_cfg1.json", "validation_cfg2.json", f"heldout_cfg{chosen}.json")])
    assert "validation prompts at CFG 1" in first.stderr
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert "prompts at CFG" not in again.stderr and "sampling" not in again.stderr  # every evaluation read back
    other = subprocess.run([*argv[:-2], "--steps", "3", "--cache", str(cache)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    err = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert other.returncode == 2 and len(err) == 1 and "num_steps: stored 2, now 3" in err[0], other.stderr


def one_error_line(capsys, argv) -> str:
    from diffalign.cli import main

    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--best-scale", "--scales", "2"], ["--scales", "at least two"]),
    (["--best-scale", "--scales", "1,two"], ["--scales", "comma-separated"]),
    (["--best-scale", "--scales", "0,2"], ["--scales", ">= 1"]),
    (["--best-scale", "--validation-images-per-family", "0"], ["--validation-images-per-family", ">= 1"]),
    (["--scales", "1,2"], ["--scales", "only applies with --best-scale"]),
    (["--cache", "x"], ["--cache", "only applies with --best-scale"]),
    (["--best-scale", "--guidance-scale", "2"], ["--guidance-scale", "does not apply with --best-scale"]),
    (["--best-scale", "--prompts", "probe"], ["--prompts", "does not apply"]),
    (["--best-scale", "--reward", "brightness"], ["ShapesEval only", "brightness"]),
])
def test_eval_best_scale_bad_input_is_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = one_error_line(capsys, ["eval", *argv])
    assert all(w in line for w in words), line


@pytest.mark.parametrize("override, words", [
    ("eval.scales=[2]", ["'eval.scales'", "at least two"]),
    ("eval.scales=[0.5,2]", ["'eval.scales'", ">= 1"]),
    ("eval.scales=[1,x]", ["'eval.scales[1]'", "number"]),
    ("eval.scales=[2,2]", ["'eval.scales'", "twice"]),
    ("eval.validation_images_per_family=0", ["'eval.validation_images_per_family'", ">= 1"]),
    ("prompts.evaluate_on=validation", ["'eval.best_scale'", "evaluate_on"]),
])
def test_bad_best_scale_config_is_one_line(override, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = one_error_line(capsys, ["config", "configs/shapes/flow_grpo.yaml", "eval.best_scale=true", override])
    assert all(w in line for w in words), line


def test_best_scale_needs_shapes_prompts(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = one_error_line(capsys, ["config", "configs/tiny/flow_grpo_sd3.yaml", "eval.best_scale=true"])
    assert "'eval.best_scale'" in line and "prompts.source: shapes" in line


# --------------------------------------------------------------------------------------------
# eval.best_scale in a run
# --------------------------------------------------------------------------------------------

TINY_TRAIN = ["model.id=tiny:shapes", "max_iterations=1", "rollout.prompts_per_iteration=1", "rollout.group_size=2",
              "rollout.sample_batch_size=2", "train.batch_size=2", "sampling.num_steps=2", "sampling.window_size=0",
              "sampling.eval_num_steps=2", "eval.images_per_family=1", "eval.probe=false", "eval.at_start=false",
              "log.progress_bar=false", "eval.best_scale=true", "eval.scales=[1,2]", "eval.validation_images_per_family=1"]


def test_run_with_best_scale_writes_the_comparison_to_metrics_records_and_report(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "configs/shapes/flow_grpo.yaml", f"output_dir={out}", *TINY_TRAIN) == 0
    final = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("eval")][-1]
    saved = json.loads((out / "eval_records" / "iter-000001.json").read_text())["best_scale"]
    comparison = saved["comparison"]
    assert final["eval/best_scale/base_scale"] == comparison["base_scale"] == saved["base"]["scale"]
    assert final["eval/best_scale/trained_scale"] == comparison["trained_scale"] == saved["trained"]["scale"]
    d = comparison["difference"]
    assert (final["eval/best_scale/difference"], final["eval/best_scale/difference_lo"],
            final["eval/best_scale/difference_hi"]) == (d["value"], d["lo"], d["hi"])
    assert set(saved["base"]["validation"]) == set(saved["trained"]["validation"]) == {"1", "2"}
    assert saved["base"]["validation_images"] == 6  # one per family
    assert saved["trained"]["heldout_images"] == final["eval/num_images"] == 6  # the run's own eval list
    assert comparison["verdict"] in ("outside noise", "within noise")
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith("**Verdict:**")
    fmt = lambda s: f"{s:g}"
    assert report[4].startswith(f"**At each model's validation-best CFG scale (base CFG {fmt(comparison['base_scale'])}, "
                                f"trained CFG {fmt(comparison['trained_scale'])}): {d['value']:+.3f} [{d['lo']:+.3f}, "
                                f"{d['hi']:+.3f}] per image, {comparison['verdict']}**")
    assert "benchmarks/guidance_scales.py" not in "\n".join(report)
