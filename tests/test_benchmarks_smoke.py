"""Keep benchmarks/overhead.py from rotting: its smallest run works and both sides do the same forwards.

No timing assertions: the CPUs are shared, so times only mean something side by side.
"""

import importlib.util
import json
import sys

import pytest


def _load_overhead(repo_root):
    spec = importlib.util.spec_from_file_location("benchmarks_overhead", repo_root / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_overhead_benchmark_smallest_run(repo_root, capsys):
    overhead = _load_overhead(repo_root)
    result = overhead.main(["--size", "tiny", "--iterations", "1", "--repeats", "1", "--profile"])
    # 2 chunks x 6 rollout steps + 2 train batches x 5 trained steps x (policy + reference) = 32
    assert result.toolkit.nfe == result.raw.nfe == 32
    assert len(result.toolkit.wall) == len(result.raw.wall) == 1
    out = capsys.readouterr().out
    assert "ratio toolkit/raw" in out and "denoiser forwards" in out


def test_spo_vs_dpo_benchmark_smoke(repo_root, tmp_path):
    """benchmarks/spo_vs_dpo.py --smoke: SPM training, pair generation, the three methods
    interleaved, three held-out metrics per mark, results.json and the plot."""
    spec = importlib.util.spec_from_file_location("benchmarks_spo_vs_dpo", repo_root / "benchmarks" / "spo_vs_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--smoke", "--minutes", "0.01", "--marks", "1", "--out", str(tmp_path)])
    assert set(results["methods"]) == {"spo", "diffusion_dpo", "flow_grpo"}
    for st in results["methods"].values():
        assert st["iterations"] >= 1 and len(st["curve"]) == 2  # base + one mark
        assert set(st["curve"][-1][1]) == {"acc", "per_image", "partial"}
    assert set(results["base"]) == {"acc", "per_image", "partial"}
    assert (tmp_path / "results.json").is_file() and (tmp_path / "accuracy_vs_wallclock.png").is_file()


@pytest.mark.slow
def test_shapes_alignment_benchmark_smoke(repo_root, tmp_path, capsys):
    """benchmarks/shapes_alignment.py on the tiny shapes model: one training iteration, then the
    headline table with intervals and the paired difference, and the probe before/after."""
    spec = importlib.util.spec_from_file_location("benchmarks_shapes_alignment", repo_root / "benchmarks" / "shapes_alignment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.main(["--run-dir", str(tmp_path / "run"), "--images-per-family", "1", "--steps", "2", "--batch-size", "8",
                           "model.id=tiny:shapes", "max_iterations=1", "rollout.prompts_per_iteration=2", "rollout.group_size=2",
                           "sampling.eval_num_steps=2", "eval.images_per_family=1", "log.progress_bar=false", "log.report=false"])
    out = capsys.readouterr().out
    assert "flow_grpo - base" in out and "acc/single_object (in-distribution)" in out and "generalisation probe" in out
    assert set(summary["heldout"]["difference"]) >= {"acc/overall", "acc/images", "partial"}
    assert summary["heldout"]["models"]["base"]["meta"]["num_images"] == 6
    assert summary["probe"]["models"]["flow_grpo"]["meta"]["num_images"] == 2  # colors + color_attr
    assert (tmp_path / "run" / "benchmark.json").is_file()


def _load_rollout_vs_pipeline(repo_root):
    spec = importlib.util.spec_from_file_location("benchmarks_rollout_vs_pipeline", repo_root / "benchmarks" / "rollout_vs_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rollout_vs_pipeline_runs_the_same_forwards(repo_root, capsys):
    bench = _load_rollout_vs_pipeline(repo_root)
    assert bench.main(["--families", "sd3,flux,sd15", "--size", "tiny", "--images", "2", "--steps", "2", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["sd3"], ["flux"], ["sd15"])]
    assert [r[0] for r in rows] == ["sd3", "flux", "sd15"]
    assert all(r[2] == "2" for r in rows)  # 2 steps = 2 forwards on both sides (checked by the hook)
    assert "worst paired ratio" in out


def test_rollout_vs_pipeline_median_interval(repo_root):
    bench = _load_rollout_vs_pipeline(repo_root)
    assert bench.median_interval([1.02] * 9) == pytest.approx((1.02, 1.02))
    values = [0.90, 0.95, 0.98, 1.00, 1.01, 1.02, 1.05, 1.10, 1.40]
    lo, hi = bench.median_interval(values)
    assert min(values) <= lo <= 1.01 <= hi <= max(values)  # around the median, within the data
    assert lo < hi and hi < 1.40  # one slow outlier does not reach the median's interval
    assert bench.median_interval(values) == (lo, hi)  # a fixed seed: the same values, the same interval


def test_rollout_vs_pipeline_stops_on_different_forwards(repo_root):
    bench = _load_rollout_vs_pipeline(repo_root)
    sides = bench.Sides("sd3", bench.build_adapter("sd3", "tiny"), images=2, steps=2, guidance=4.5, resolution=32)
    sides.pipeline_kwargs = lambda original=sides.pipeline_kwargs: {**original(), "num_inference_steps": 3}
    with pytest.raises(SystemExit, match="different forwards"):
        bench.measure(sides, repeats=1)


@pytest.mark.slow
def test_scaling_benchmark_fits_and_resumes(repo_root, tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmarks_scaling", repo_root / "benchmarks" / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = scaling
    spec.loader.exec_module(scaling)
    assert scaling.fit_exponent([1, 2, 4], [3, 6, 12]) == pytest.approx(1.0)
    assert scaling.fit_exponent([32, 64, 128], [1, 4, 16]) == pytest.approx(2.0)
    monkeypatch.setitem(scaling.AXES, "images", [4, 8])  # two points: each is a child process
    args = ["--models", "sd3", "--size", "tiny", "--axes", "images", "--iterations", "1", "--threads", "1", "--out", str(tmp_path)]
    assert scaling.main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("sd3")]
    assert [r[2] for r in rows] == ["4", "8"] and "k_time" in out
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    assert (tmp_path / "scaling.png").stat().st_size > 0
    pieces = sorted(p.name for p in (tmp_path / "sd3").iterdir())
    assert len(pieces) == 2
    for name in pieces:  # memory of the timed iterations only: the peak is reset after the warm-up
        piece = json.loads((tmp_path / "sd3" / name).read_text())
        assert piece["memory"] == ("rss_peak" if sys.platform == "linux" else "rss_peak_whole_process")
        assert piece["iter_mib"] == piece["peak_mib"] - piece["base_mib"] and piece["iter_mib"] >= 0
        assert piece["base_mib"] > 0 or sys.platform != "linux"
    assert scaling.main(args) == 0  # resumes: every point is read back, none rerun
    assert "- sd3" in capsys.readouterr().out and sorted(p.name for p in (tmp_path / "sd3").iterdir()) == pieces


@pytest.mark.slow
def test_async_rewards_benchmark_smallest_run(repo_root, tmp_path, capsys):
    """benchmarks/async_rewards.py: a pair of timed iterations, printed beside the ideal ratio."""
    spec = importlib.util.spec_from_file_location("benchmarks_async_rewards", repo_root / "benchmarks" / "async_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--repeats", "1", "--kinds", "sleep", "--output-dir", str(tmp_path / "run"), "sampling.num_steps=2",
                          "rollout.prompts_per_iteration=2"])
    assert set(result) == {"sleep"} and result["sleep"]["sync"] > 0 and result["sleep"]["async"] > 0
    out = capsys.readouterr().out
    assert "2 chunks per iteration" in out and "sync/async" in out
