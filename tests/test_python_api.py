"""The Python API example (scripts/python_api.py) runs end to end on the tiny ShapesWorld model."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_python_api_example_trains_evaluates_and_exports(repo_root, tmp_path):
    out = tmp_path / "run"
    overrides = ["model.id=tiny:shapes", "max_iterations=1", "rollout.prompts_per_iteration=2", "rollout.group_size=2",
                 "rollout.sample_batch_size=4", "train.batch_size=4", "sampling.num_steps=2", "sampling.eval_num_steps=2",
                 "sampling.window_size=0", "eval.at_start=false", "eval.images_per_family=2", "eval.probe=false",
                 "log.report=false"]
    proc = subprocess.run([sys.executable, "scripts/python_api.py", str(out), *overrides], cwd=repo_root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "acc/images" in proc.stdout and "run - base" in proc.stdout
    assert (out / "final").is_dir() and (out / "metrics.jsonl").is_file()
    # the main config fine-tunes all weights: the example exports the merged pipeline
    assert (out / "export" / "merged" / "model_index.json").is_file() and "merged weights exported" in proc.stdout
