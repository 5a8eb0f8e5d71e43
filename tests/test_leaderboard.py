"""benchmarks/leaderboard.py: the table math on synthetic cells (hand-computed), and one end-to-end
sitting on the tiny shapes model (cells written, skipped when present, the table rebuilt from them)."""

import json

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def board():
    return load_script("benchmarks/leaderboard.py", "benchmarks_leaderboard")


T2 = 4.302652729911275  # t(0.975, 2 degrees of freedom): 3 seeds


def records(acc: float, n: int = 10) -> dict:
    k = round(acc * n)
    return {"passed": [True] * k + [False] * (n - k), "prompt": list(range(n))}


def cell(method, seed, chosen, training=None, *, busy=False, minutes=(1.0, 2.0)):
    """A stored cell with held-out accuracies ``chosen`` (CFG 2) and ``training`` (CFG 4) at marks 0.5 and 1."""
    training = training or chosen
    return {"method": method, "seed": seed, "chosen_scale": "2", "training_scale": "4", "iterations": 10 + seed,
            "train_seconds": 60 * minutes[-1], "seconds_per_iteration": 12.0, "nfe_per_image": 10.0, "prep_seconds": 120.0,
            "busy": busy,
            "marks": [{"fraction": f, "train_seconds": 60 * m, "heldout": {"2": records(c), "4": records(t)}}
                      for f, m, c, t in zip((0.5, 1.0), minutes, chosen, training)]}


def synthetic():
    ref_training = [(0.0, 0.0)] * 3
    cells = {
        "flow_grpo": {s: cell("flow_grpo", s, c, t) for s, c, t in
                      zip((0, 1, 2), [(0.4, 0.5), (0.5, 0.6), (0.6, 0.7)], ref_training)},
        # final - flow_grpo final per seed: 0.3, 0.4, 0.2; first mark - flow_grpo final: 0.2 each
        "awm": {s: cell("awm", s, c, busy=s == 1) for s, c in zip((0, 1, 2), [(0.7, 0.8), (0.8, 1.0), (0.9, 0.9)])},
        # 0.1, -0.1, 0.1: within noise
        "spo": {s: cell("spo", s, c) for s, c in zip((0, 1, 2), [(0.3, 0.6), (0.3, 0.5), (0.3, 0.8)])},
        # -0.3, -0.4, -0.5
        "diffusion_dpo": {s: cell("diffusion_dpo", s, c) for s, c in zip((0, 1, 2), [(0.1, 0.2)] * 3)},
        "sol_rl": {0: cell("sol_rl", 0, (0.9, 0.9))},  # one seed: no interval
    }
    return cells, {"heldout_accuracy": 0.55, "best_scale": "2"}


def test_t_quantile_matches_scipy(board):
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 7, 10, 30, 101):
        assert board.t_quantile(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)


def test_table_math_on_hand_computed_cells(board):
    cells, base = synthetic()
    summary = board.summarise(cells, base)
    half = T2 * 0.1 / 3 ** 0.5  # every seed-sd below is 0.1

    ref = summary["flow_grpo"]["chosen"]
    assert ref["mean"] == pytest.approx([0.5, 0.6])
    assert ref["interval"][1]["lo"] == pytest.approx(0.6 - half) and ref["interval"][1]["hi"] == pytest.approx(0.6 + half)
    assert "vs_reference" not in ref and ref["reach_minutes"] == pytest.approx(2.0)  # only its own final mark reaches it
    assert summary["flow_grpo"]["training"]["mean"] == pytest.approx([0.0, 0.0])  # the CFG-4 records, not CFG 2

    awm = summary["awm"]["chosen"]
    assert awm["mean"] == pytest.approx([0.8, 0.9])
    assert awm["vs_reference"]["value"] == pytest.approx(0.3)
    assert (awm["vs_reference"]["lo"], awm["vs_reference"]["hi"]) == pytest.approx((0.3 - half, 0.3 + half))
    assert awm["verdict"] == "better" and awm["faster"]  # first mark: +0.2 on every seed
    assert awm["reach_minutes"] == pytest.approx(1.0)  # 0.8 at the first mark >= 0.6
    assert awm["vs_base"]["value"] == pytest.approx(0.35) and awm["vs_base_verdict"] == "better"
    # at the training scale flow_grpo's final accuracy is 0: awm reaches it at once
    assert summary["awm"]["training"]["reach_minutes"] == pytest.approx(1.0)

    spo = summary["spo"]["chosen"]
    assert spo["vs_reference"]["value"] == pytest.approx(1 / 30)
    assert spo["vs_reference"]["hi"] - spo["vs_reference"]["value"] == pytest.approx(T2 * (0.04 / 3) ** 0.5 / 3 ** 0.5)
    assert spo["verdict"] == "" and not spo["faster"]  # the interval holds 0
    assert spo["reach_minutes"] == pytest.approx(2.0)  # 0.3 < 0.6 at the first mark, 0.633 at the last

    dpo = summary["diffusion_dpo"]["chosen"]
    assert dpo["vs_reference"]["value"] == pytest.approx(-0.4) and dpo["verdict"] == "worse"
    assert dpo["reach_minutes"] is None

    sol = summary["sol_rl"]["chosen"]
    assert sol["interval"] == [None, None] and sol["vs_reference"] is None and sol["vs_base"] is None
    assert sol["vs_reference_mean"] == pytest.approx(0.4) and sol["verdict"] == "" and not sol["faster"]

    cost = summary["awm"]["cost"]
    assert cost["iterations"] == pytest.approx(11) and cost["prep_minutes"] == pytest.approx(2.0) and cost["busy"] == 1

    text = board.format_tables(summary, base)
    rows = {line.split()[0]: line for line in text.splitlines()[5:10]}  # the chosen-scale table's rows
    assert "better" in rows["awm"] and rows["awm"].endswith("1.0 faster")
    assert "better" not in rows["spo"] and "worse" not in rows["spo"] and "faster" not in rows["spo"]
    assert "worse" in rows["diffusion_dpo"] and rows["diffusion_dpo"].endswith("-")
    assert "busy 1 of 3" in text


def test_busy_reads_the_load_average(board, tmp_path):
    path = tmp_path / "loadavg"
    path.write_text("2.71 1.00 0.50 3/129 7986\n")
    assert board.load_average(path) == pytest.approx(2.71)
    assert board.load_average(tmp_path / "missing") is None
    assert board.is_busy([1.2, 2.71], threads=2) is True  # 2.71 > 2 + 0.5
    assert board.is_busy([1.2, 2.4], threads=2) is False
    assert board.is_busy([None, None], threads=1) is None


TINY = ["--model", "tiny:shapes", "--seeds", "0", "--minutes", "0.001", "--marks", "0.5", "--scales", "1,4",
        "--images-per-family", "1", "--eval-steps", "2", "--eval-batch-size", "8", "--threads", "1",
        "sampling.num_steps=2", "sampling.window_size=0", "rollout.prompts_per_iteration=1", "rollout.group_size=2",
        "rollout.sample_batch_size=2", "train.batch_size=2", "train.optimizer_steps_per_iteration=1"]


def test_leaderboard_sitting_end_to_end(board, tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path)]
    results = board.main(["--methods", "flow_grpo,diffusion_nft", *TINY, *out])
    assert set(results) == {"settings", "interval", "base", "methods", "cells"}
    assert results["cells"] == ["diffusion_nft/seed0", "flow_grpo/seed0"]
    assert set(results["methods"]["diffusion_nft"]) >= {"chosen", "training", "cost", "seeds", "marks"}
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
    stored = json.loads((tmp_path / "cells" / "flow_grpo" / "seed0.json").read_text())
    assert stored["iterations"] >= 1 and [m["fraction"] for m in stored["marks"]] == [0.5, 1.0]
    assert stored["chosen_scale"] in stored["marks"][-1]["heldout"] and stored["training_scale"] == "4"
    assert len(stored["marks"][-1]["heldout"]["4"]["passed"]) == 6 and set(stored["validation"]) == {"1", "4"}
    assert stored["nfe_per_image"] == 2.0 and stored["cpu"] and stored["busy"] in (True, False)
    assert (tmp_path / "base" / "summary.json").is_file()
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("a stored cell was trained again")

    monkeypatch.setattr(board, "run_cell", no_training)
    board.main(["--methods", "flow_grpo", *TINY, *out])
    assert "flow_grpo seed 0: done earlier" in capsys.readouterr().out
    assert json.loads((tmp_path / "cells" / "flow_grpo" / "seed0.json").read_text()) == stored

    (tmp_path / "results.json").unlink()
    board.main(["--table-only", *out])
    text = capsys.readouterr().out
    assert "validation-chosen CFG scale" in text and "diffusion_nft" in text and "NFE/img" in text
    assert (tmp_path / "results.json").is_file()

    # another budget over the same cells, and a method whose judge is missing: one line each, exit code 2
    longer = ["0.5" if a == "0.001" else a for a in TINY]  # --minutes
    assert board.cli(["--methods", "flow_grpo", *longer, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "seed0.json" in err and "minutes" in err and "\n" not in err
    assert board.cli(["--methods", "spo", *TINY, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert "step-aware preference model" in err and "--prepare" in err and "\n" not in err
    drm = ["--methods", "drm_step_grpo", *TINY, *out, "--judge-set", "drm_step_grpo", "pairs.samples_per_prompt=2",
           "pairs.num_steps=2", "train.steps=2", "prompts.families=[single_object]", "pairs.reward=brightness",
           "pairs.reward_kwargs={}", "eval.t_grid=[0.5]"]
    assert board.cli(drm) == 2 and "diffusion reward model (DRM)" in capsys.readouterr().err

    # --prepare trains the missing judge once, charged to the cell as preparation
    monkeypatch.undo()
    board.main([*drm, "--prepare"])
    prep = json.loads((tmp_path / "prep" / "drm_step_grpo" / "prep.json").read_text())
    judged = json.loads((tmp_path / "cells" / "drm_step_grpo" / "seed0.json").read_text())
    assert (tmp_path / "prep" / "drm_step_grpo" / "judge").is_dir() and prep["seconds"] > 0
    assert judged["prep_seconds"] == pytest.approx(prep["seconds"])
    assert judged["config"]["reward"]["kwargs"]["path"] == str(tmp_path / "prep" / "drm_step_grpo" / "judge")
    guard = judged["guard"]  # the recipe's train.guard: ShapesEval's training curve beside the DRM's
    assert guard["verifier"] == "shapes_eval" and guard["learned_key"] == "drm_score_mean"
    assert len(guard["verifier_reward"]) == len(guard["learned_reward"]) == judged["iterations"]


def test_every_method_loads_as_a_config(board, tmp_path):
    from diffalign.config_files import load_config

    for name, method in board.METHODS.items():
        judge = [f"{method.judge.run_key}={tmp_path / name}"] if method.judge else []
        cfg = load_config(board.ROOT / method.recipe, [*method.overrides, *board.PLUMBING, *judge, f"output_dir={tmp_path}"])
        assert cfg.optim.lr_schedule == "constant" and method.nfe(cfg) >= 0, name
    assert board.METHODS["grpo_guard"].overrides and board.METHODS["flow_grpo_mix"].overrides


def test_budget_units(board):
    import argparse

    assert board.Budget("cpu_minutes", 2.0).spent(wall_seconds=600, cpu_seconds=90, iterations=3) == pytest.approx(1.5)
    assert board.Budget("minutes", 2.0).spent(600, 90, 3) == pytest.approx(10.0)
    assert board.Budget("iterations", 2.0).spent(600, 90, 3) == 3.0
    assert str(board.Budget("cpu_minutes", 30.0)) == "30 cpu minutes"
    args = board.parse_args(["--cpu-minutes", "30"])
    assert args.budget == board.Budget("cpu_minutes", 30.0)
    assert board.parse_args([]).budget == board.Budget("minutes", 15.0)
    with pytest.raises(board.DiffalignError, match="--iterations must be a whole number > 0"):
        board.budget_from_args(argparse.Namespace(minutes=None, cpu_minutes=None, iterations=1.5))
