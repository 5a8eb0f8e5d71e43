"""The edges of the command line as a user meets them, each ``diffalign`` in a subprocess: plain
``diffalign`` and ``--version``, a launcher config given to ``train``, whole-sentence recipe
descriptions, one error line at once for a model id that is nowhere, and ``sample``'s labelled
grid with the evaluation's defaults and no library loading bars."""

from __future__ import annotations

import json

import numpy as np

from diffalign import __version__
from tests.helpers.tiny_run import diffalign, user_env


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_plain_diffalign_prints_the_help(tmp_path):
    done = diffalign(cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: diffalign") and "train" in done.stdout and "recipes" in done.stdout


def test_version(tmp_path):
    done = diffalign("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"diffalign {__version__}", done.stdout + done.stderr


def test_a_launcher_config_given_to_train_says_how_to_use_it(tmp_path):
    done = diffalign("train", "accelerate/ddp", cwd=tmp_path)
    (line,) = error_lines(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is a launcher config, not a training recipe: use it with accelerate launch --config_file" in line, line
    assert "compute_environment" not in line


def test_recipes_describes_each_recipe_in_a_whole_sentence(tmp_path):
    done = diffalign("recipes", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    *rows, _footer = done.stdout.splitlines()
    described = {row.split()[0]: row.split(None, 1)[1] for row in rows}
    assert all(text.endswith((".", ")", "!", "?")) for text in described.values()), described
    # sentences that run over several comment lines are joined, up to their full stop
    assert described["accelerate/ddp"] == (
        "Data parallel on one node: every process samples its slice of the iteration's prompt groups; diffalign "
        "all-reduces gradients itself (exact: same update as one process over the same samples).")
    assert "(Liang et al. 2024, arXiv:2406.04314;" in described["sdxl/spo"]  # "et al." ends no sentence
    assert described["shapes/spo"] == "SPO on the shipped ShapesWorld model, in two steps."


def test_a_model_id_that_is_nowhere_is_one_line_at_once(tmp_path):
    """Not a folder, not a shipped or tiny: name, not cached, and the Hub unreachable: no retries."""
    env = {k: v for k, v in user_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there: as a machine without network
    done = diffalign("sample", "--model", "shapess", "--out", tmp_path / "s", cwd=tmp_path, env=env)
    (line,) = error_lines(done.stderr)
    assert done.returncode == 2 and "Retry" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "'shapess' is not a folder" in line and "(did you mean 'shapes'?)" in line and "127.0.0.1 cannot be reached" in line
    offline = diffalign("sample", "--model", "someone/no-such-model", "--out", tmp_path / "s", cwd=tmp_path)
    (line,) = error_lines(offline.stderr)
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in line, offline.stderr
    assert not (tmp_path / "s").exists()


def test_sample_labels_its_grid_and_uses_the_evaluation_defaults(tmp_path):
    from PIL import Image

    from diffalign.drm.sampling import GRID_TILE_PX
    from diffalign.images import LABEL_LINES

    done = diffalign("sample", "--num-prompts", "3", "--steps", "1", "--out", "s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Loading pipeline components" not in done.stderr and "Loading weights" not in done.stderr  # no library bars
    summary = json.loads((tmp_path / "s" / "samples.json").read_text())["summary"]
    assert (summary["seed"], summary["guidance_scale"]) == (1234, 4.0)
    grid = np.asarray(Image.open(tmp_path / "s" / "grid.png").convert("L"))
    tile, text_h = GRID_TILE_PX[0], LABEL_LINES * 11 + 4  # 32 px images shown at 128 px, three label lines under each
    assert grid.shape == (tile + text_h + 4, 3 * (tile + 2) + 2), grid.shape
    label_band = grid[2 + tile + 2: 2 + tile + text_h, 2: 2 + tile]
    assert (label_band < 80).sum() > 50  # the first prompt is written under its image
