"""benchmarks/pretrain_plateau.py: the plateau rule on hand-made checkpoints, and a sitting on two
snapshots of a tiny pretraining run (exported, evaluated, stored, skipped when present)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plateau():
    return load_script("benchmarks/pretrain_plateau.py", "benchmarks_pretrain_plateau")


PROMPTS = [f"a photo of a {c} circle" for c in ("red", "blue", "green", "yellow")]


def step(passed):
    return {"records": [{"prompt": p, "family": "single_object", "passed": ok, "score": float(ok)}
                        for p, ok in zip(PROMPTS, passed)]}


def test_plateau_rule_on_hand_made_checkpoints(plateau):
    steps = {4500: step([1, 0, 0, 0]), 5500: step([1, 1, 0, 0]), 6500: step([1, 1, 1, 0]), 8500: step([1, 1, 1, 0]),
             9500: step([1, 1, 1, 1])}
    result = plateau.plateau(steps, window=2000, min_gain=0.01)
    gains = result["gains"]
    assert set(gains) == {6500, 8500, 9500}  # 4500 and 5500 have nothing 2,000 steps before them
    assert gains[6500]["over_step"] == 4500 and gains[6500]["value"] == pytest.approx(0.5)
    assert gains[8500]["over_step"] == 6500 and gains[8500]["value"] == pytest.approx(0.0)
    assert gains[9500]["over_step"] == 6500 and gains[9500]["value"] == pytest.approx(0.25)
    assert result["reached_at"] == 8500  # the first gain below 0.01 per 2,000 steps
    assert plateau.plateau(steps, window=2000, min_gain=-1)["reached_at"] is None


def test_architecture_flags_follow_the_state_record(plateau):
    info = {"architecture": {"text_encoder": "bert", "cross_attention_levels": 2, "text_time_embedding": False,
                             "coordinate_channels": True}, "timestep_shift": 2.0}
    assert plateau.architecture_flags(info) == ["--text-encoder", "bert", "--cross-attention-levels", "2",
                                                "--no-text-time-embedding", "--coordinate-channels", "--timestep-shift", "2"]
    shipped = json.loads((ROOT / "scripts" / "pretrain_state" / "shapes-t2i-bert-12k-step008500" / "state.json").read_text())
    assert plateau.architecture_flags(shipped)[:2] == ["--text-encoder", "bert"]


def test_plateau_sitting_on_a_tiny_run(plateau, tmp_path, capsys, monkeypatch):
    run = [sys.executable, str(ROOT / "scripts" / "pretrain_shapes.py"), "--tiny", "--no-eval", "--batch-size", "4",
           "--warmup", "2", "--decay-steps", "2", "--threads", "1", "--steps", "4", "--save-every", "2",
           "--out", str(tmp_path / "model"), "--state-dir", str(tmp_path / "state")]
    subprocess.run(run, check=True, capture_output=True)
    snaps = [str(tmp_path / f"state-step00000{s}") for s in (2, 4)]
    args = ["--scales", "1,2", "--images-per-family", "1", "--k", "1", "--window", "2", "--eval-steps", "2",
            "--eval-batch-size", "8", "--export-flags=--tiny", "--out", str(tmp_path / "out")]
    summary = plateau.main([*snaps, *args])
    assert set(summary["steps"]) == {"2", "4"} and (tmp_path / "out" / "models" / "step4" / "model_index.json").is_file()
    row = summary["steps"]["4"]
    assert row["scale"] in (1.0, 2.0) and set(row["validation"]) == {"1", "2"} and row["pass_at_k"] is not None
    assert summary["plateau"]["gains"]["4"]["over_step"] == 2
    assert "| 4 |" in (tmp_path / "out" / "table.md").read_text()
    capsys.readouterr()
    monkeypatch.setattr(plateau, "evaluate_checkpoint", lambda *a, **k: pytest.fail("a stored checkpoint was evaluated again"))
    plateau.main([*snaps, *args])
    assert "step 4: done earlier" in capsys.readouterr().out
    assert plateau.cli([str(tmp_path / "nowhere"), *args]) == 2
    assert "neither a pretraining state folder" in capsys.readouterr().err
