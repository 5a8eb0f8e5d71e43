"""benchmarks/limits.py: the table math on hand-made cells, and one sitting on the tiny shapes model
(cells written, skipped when present, the table rebuilt from them, bad input refused in one line)."""

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def limits():
    return load_script("benchmarks/limits.py", "benchmarks_limits")


PROMPTS = ["a photo of a red circle", "a photo of a blue square", "a photo of a green triangle", "a photo of a yellow circle"]  # one family: single objects


def compact(passed):
    return {"passed": passed, "prompt": list(range(len(passed))), "score": [float(p) for p in passed]}


def cell(row, seed, chosen, training):
    return {"method": row, "seed": seed, "chosen_scale": "2", "training_scale": "4", "iterations": 4, "images": 256,
            "train_seconds": 120.0, "train_cpu_seconds": 240.0, "nfe_per_image": 10.0, "busy": False,
            "prompts": {"heldout": PROMPTS},
            "marks": [{"fraction": 1.0, "heldout": {"2": compact(chosen), "4": compact(training)}}]}


def test_table_math_on_hand_made_cells(limits):
    base_records = limits.records(compact([True, False, False, False]), PROMPTS)  # 0.25
    base = {"best_scale": "2", "heldout_metrics": {"acc/images": 0.25, "partial": 0.25}}
    cells = {
        "main": {0: cell("main", 0, [True, True, False, False], [False] * 4),       # 0.50: +0.25
                 1: cell("main", 1, [True, True, True, False], [False] * 4)},       # 0.75: +0.50
        "raft": {0: cell("raft", 0, [True, False, False, False], [True] * 4),       # 0.25: +0.00, -0.25 vs main
                 1: cell("raft", 1, [True, True, False, False], [True] * 4)},       # 0.50: +0.25, -0.25 vs main
    }
    summary = limits.summarise(cells, base, base_records)
    main, raft = summary["main"]["acc/images"], summary["raft"]["acc/images"]
    assert main["value"] == {"0": 0.5, "1": 0.75} and main["mean"] == pytest.approx(0.625)
    assert main["vs_base"]["0"]["value"] == pytest.approx(0.25) and main["vs_base_mean"] == pytest.approx(0.375)
    # t-interval over the per-seed differences 0.25 and 0.50: mean 0.375, sd 0.1768, t(0.975, 1) = 12.706
    half = 12.706204736 * 0.25 / 2 ** 0.5 / 2 ** 0.5
    assert main["vs_base_interval"]["lo"] == pytest.approx(0.375 - half, rel=1e-6)
    assert "vs_main_mean" not in main
    assert raft["vs_main_mean"] == pytest.approx(-0.25) and raft["vs_main_interval"]["lo"] == pytest.approx(-0.25)
    assert raft["training_scale_value"] == pytest.approx(1.0) and main["training_scale_value"] == pytest.approx(0.0)
    assert summary["raft"]["cost"]["train_cpu_minutes"] == pytest.approx(4.0)
    text = limits.format_table(summary, base)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and "row" not in line}
    assert set(rows) == {"main", "raft"} and "s0: +0.250" in rows["main"] and "-0.250" in rows["raft"]


TINY = ["--model", "tiny:shapes", "--seeds", "0", "--iterations", "1", "--scales", "1,4", "--images-per-family", "1",
        "--eval-steps", "2", "--eval-batch-size", "8", "--threads", "1", "sampling.num_steps=2", "sampling.window_size=0",
        "rollout.prompts_per_iteration=1", "rollout.group_size=2", "rollout.sample_batch_size=2", "train.batch_size=2",
        "train.optimizer_steps_per_iteration=1"]


def test_limits_sitting_end_to_end(limits, tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path)]
    results = limits.main(["--rows", "main,cfg_free", *TINY, *out])
    assert results["cells"] == ["cfg_free/seed0", "main/seed0"]
    cfg_free = json.loads((tmp_path / "cells" / "cfg_free" / "seed0.json").read_text())
    assert set(cfg_free["validation"]) == {"1"} and cfg_free["chosen_scale"] == "1" and cfg_free["training_scale"] == "1"
    main = json.loads((tmp_path / "cells" / "main" / "seed0.json").read_text())
    assert main["iterations"] == 1 and main["images"] == 2 and main["train_cpu_seconds"] > 0
    assert set(main["validation"]) == {"1", "4"} and main["settings"]["budget"] == "1 iterations"
    assert (tmp_path / "table.md").read_text().count("| main |") == 2  # per image and partial credit
    capsys.readouterr()

    monkeypatch.setattr(limits.lb, "run_cell", lambda *a, **k: pytest.fail("a stored cell was trained again"))
    limits.main(["--rows", "main", *TINY, *out])
    assert "main seed 0: done earlier" in capsys.readouterr().out
    limits.main(["--table-only", *out])
    assert "validation-best CFG scale" in capsys.readouterr().out

    other = ["2" if a == "1" and i and TINY[i - 1] == "--iterations" else a for i, a in enumerate(TINY)]
    assert limits.cli(["--rows", "main", *other, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "seed0.json" in err and "iterations" in err and "\n" not in err
    assert limits.cli(["--rows", "nosuch", *out]) == 2
    assert "--rows: unknown nosuch" in capsys.readouterr().err


def test_every_row_loads_as_a_config(limits, tmp_path):
    from diffalign.config_files import load_config

    for name, row in limits.ROWS.items():
        if not (ROOT / row.recipe).is_file():
            pytest.fail(f"{name}: {row.recipe} is missing")
        cfg = load_config(ROOT / row.recipe, [*row.overrides, *limits.lb.PLUMBING, f"output_dir={tmp_path}"])
        assert cfg.optim.lr_schedule == "constant", name
    batch = load_config(ROOT / limits.ROWS["batch4x"].recipe, [*limits.ROWS["batch4x"].overrides, f"output_dir={tmp_path}"])
    main = load_config(ROOT / limits.MAIN, [f"output_dir={tmp_path}"])
    assert batch.derived()["images_per_iteration"] == 4 * main.derived()["images_per_iteration"]
    assert batch.derived()["optimizer_steps_per_iteration"] == main.derived()["optimizer_steps_per_iteration"]
