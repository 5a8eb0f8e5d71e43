"""Keep the Sol-RL benchmarks from rotting: their smallest runs work and produce their tables.

No timing or accuracy assertions (shared CPUs, random tiny models); the full runs are for the
shipped model and, for benchmarks/gpu/, an H100/H200.
"""

import importlib.util
import json
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _load(repo_root, rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, repo_root / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quant_benchmark_smallest_run(repo_root, tmp_path, capsys):
    bench = _load(repo_root, "benchmarks/sol_rl_quant.py", "bench_sol_rl_quant")
    result = bench.main(["--model", "tiny:sd3", "--prompts", "1", "--pool", "4", "--select", "2", "--stage1-steps", "1",
                         "--stage2-steps", "2", "--formats", "full,int8,nvfp4", "--out", str(tmp_path)])
    by = {r["format"]: r for r in result["rows"]}
    assert by["full"]["velocity_rel_err"] < 1e-5 and 0 < by["full"]["speedup_cpu"]
    for fmt in ("int8", "nvfp4"):
        if fmt in by and by[fmt]["status"] != "skipped":
            assert by[fmt]["velocity_rel_err"] > 0 and by[fmt]["stage1"] > 0 and by[fmt]["stage2"] > 0
    out = capsys.readouterr().out
    assert "pool tau" in out and (tmp_path / "result.json").is_file() and (tmp_path / "sol_rl_quant.png").is_file()


def test_accuracy_vs_time_benchmark_smallest_run(repo_root, tmp_path):
    bench = _load(repo_root, "benchmarks/sol_rl_vs_single_stage.py", "bench_sol_rl_vs_single")
    result = bench.main(["--model", "tiny:shapes", "--minutes", "0.001", "--eval-every", "1", "--samples-per-prompt", "1",
                         "--eval-prompts", "2", "--eval-steps", "2", "--out", str(tmp_path),
                         "--override", "rollout.prompts_per_iteration=1", "--override", "rollout.group_size=2",
                         "--override", "sampling.num_steps=2", "--override", "train.batch_size=4",
                         "--sol-override", "algorithm.pool_size=4", "--sol-override", "algorithm.stage1_steps=1"])
    for name in ("sol_rl", "single_stage"):
        curve = result["runs"][name]["curve"]
        assert len(curve) == 2 and curve[0]["iterations"] == 0 and curve[1]["iterations"] == 1
        assert "acc/overall" in curve[1]
    assert "sol/kendall_tau" in result["runs"]["sol_rl"]["records"][0]
    assert (tmp_path / "accuracy_vs_time.png").is_file()


def test_gpu_benchmark_cpu_smoke(repo_root, tmp_path):
    bench = _load(repo_root, "benchmarks/gpu/sol_rl_stage1.py", "bench_gpu_sol_rl")
    result = bench.main(["--device", "cpu", "--size", "tiny", "--prompts", "1", "--pool", "2", "--select", "2", "--batch", "2",
                         "--stage1-steps", "1", "--stage2-steps", "2", "--formats", "bf16,fp8", "--on-unsupported", "emulate",
                         "--out", str(tmp_path)])
    rows = {r["format"]: r for r in result["rows"]}
    assert rows["peft"]["img_per_s"] > 0 and rows["bf16"]["status"] == "native"
    assert rows["fp8"]["status"] in ("emulated", "skipped")
    assert (tmp_path / "result.json").is_file()


def test_gpu_bundle_smoke_runs_every_section_on_cpu(repo_root, tmp_path):
    bundle = _load(repo_root, "benchmarks/gpu/run_all.py", "bench_gpu_run_all")
    result = bundle.main(["--smoke", "--out", str(tmp_path / "run_all.json")])
    sections = result["sections"]
    assert set(sections) == {"sol_rl_stage1", "rollout_vs_pipeline", "overhead", "attention"}
    assert all(s["status"] == "ok" for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    assert sections["rollout_vs_pipeline"]["ratio"] > 0 and sections["overhead"]["ratio"] > 0
    assert sections["attention"]["sdpa_ms"] > 0
    written = json.loads((tmp_path / "run_all.json").read_text())
    assert written["machine"]["torch"] == torch.__version__ and written["total_seconds"] > 0
