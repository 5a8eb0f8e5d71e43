"""`diffalign eval` compares a run with its own base and reward, `diffalign config` checks the
names `train` checks (without loading a model), and `--quiet` leaves only diffalign's lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny_run import CONFIG, FAST, ROOT, diffalign

SHAPES_CONFIG = "configs/shapes/flow_grpo.yaml"


def fake_run(root: Path, name: str, config: str, *overrides: str, family: str) -> Path:
    """A finished run directory as eval reads it before loading weights: config.yaml and
    final/diffalign.json (the refusals below happen before any model loads)."""
    from diffalign.config_files import dump_config, load_config

    run = root / name
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(load_config(ROOT / config, list(overrides))))
    (run / "final" / "diffalign.json").write_text(json.dumps({"family": family}))
    return run


def one_error_line(capsys, argv: list[str], monkeypatch) -> str:
    from diffalign.cli import main

    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return lines[0]


def test_eval_refuses_shapes_eval_of_a_tiny_sd3_run(tmp_path, capsys, monkeypatch):
    run = fake_run(tmp_path, "sd3run", CONFIG, family="sd3")
    line = one_error_line(capsys, ["eval", str(run), "--reward", "shapes_eval"], monkeypatch)
    assert "ShapesEval" in line and "'sd3run'" in line and "tiny:sd3" in line


def test_eval_refuses_a_run_of_another_base_than_base(tmp_path, capsys, monkeypatch):
    run = fake_run(tmp_path, "sd3run", CONFIG, family="sd3")
    line = one_error_line(capsys, ["eval", str(run), "--base", "shapes"], monkeypatch)
    assert "'sd3run'" in line and "tiny:sd3" in line and "--base" in line


def test_eval_refuses_runs_of_different_bases_with_a_base_column(tmp_path, capsys, monkeypatch):
    a = fake_run(tmp_path, "sd3run", CONFIG, family="sd3")
    b = fake_run(tmp_path, "shapesrun", SHAPES_CONFIG, family="shapes")
    line = one_error_line(capsys, ["eval", str(a), str(b)], monkeypatch)
    assert "different base models" in line and "sd3run" in line and "shapesrun" in line


def test_eval_resolves_each_runs_own_base_and_reward(tmp_path):
    from diffalign.evaluation import eval_base, eval_reward, read_run_source

    sd3 = read_run_source(fake_run(tmp_path, "sd3run", CONFIG, "reward.name=aesthetic", family="sd3"))
    shapes = read_run_source(fake_run(tmp_path, "shapesrun", SHAPES_CONFIG, family="shapes"))
    assert (sd3.base, sd3.family, sd3.reward) == ("tiny:sd3", "sd3", "aesthetic")
    assert eval_base([sd3], None) == "tiny:sd3"
    assert eval_reward([sd3], None) == ("aesthetic", {})
    assert eval_base([], None) == "shapes" and eval_reward([], None) == ("shapes_eval", {})
    assert eval_base([shapes], "default") == "default"  # the shipped model's two names are one model
    with pytest.raises(Exception, match="different rewards"):
        eval_reward([sd3, shapes], None)


def test_eval_header_states_what_was_sampled(tmp_path):
    """The shipped model on ShapesEval, cut to 3 images: spread over the families (each family's
    first), and the header says so, not 96 per family."""
    done = diffalign("eval", "--num-prompts", "3", "--steps", "1", "--images-per-family", "2", "--mixed-precision", "no",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    header = done.stdout.splitlines()[0]
    assert "3 images, each family's first (single_object 1 of 2, two_object 1 of 2, counting 1 of 2)" in header, header
    assert "base = shapes" in header and "96" not in header


def test_num_prompts_takes_each_familys_first_images_in_turn():
    from diffalign.evaluation import describe_families, shapes_eval_list
    from diffalign.shapes import evaluation_prompts, prompt_set

    prompts = prompt_set("heldout")
    whole = evaluation_prompts(prompts, 96)
    taken = shapes_eval_list(prompts, 96, 16)
    assert describe_families(taken, 96) == ("single_object 3 of 96, two_object 3 of 96, counting 3 of 96, colors 3 of 96, "
                                            "position 2 of 96, color_attr 2 of 96")
    rest = iter(whole)
    assert all(p in rest for p in taken)  # a subsequence of the whole list, in its order
    assert taken[:3] == whole[:3]  # each family's first images
    assert shapes_eval_list(prompts, 96, 0) == whole and shapes_eval_list(prompts, 2, 100) == evaluation_prompts(prompts, 2)


@pytest.mark.parametrize("override, key, hint", [
    ("reward.name=pickscor", "reward.name", "pickscore"),
    ("model.id=tiny:sd33", "model.id", "sd3"),
    ("algorithm.name=flow_grp", "algorithm.name", "flow_grpo"),
    ("log.trackers=[wandbb]", "log.trackers", "wandb"),
    ("model.id=./no/such/model", "model.id", "does not exist"),
])
def test_config_checks_names_as_train_does(override, key, hint, capsys, monkeypatch):
    line = one_error_line(capsys, ["config", SHAPES_CONFIG, override], monkeypatch)
    assert f"'{key}'" in line and hint in line, line


def test_config_and_train_share_one_check(monkeypatch):
    """train's build_trainer raises the same error as config, before building a model."""
    from diffalign.config_files import load_config
    from diffalign.errors import ConfigError
    from diffalign.trainer import build_trainer
    from diffalign.training.checks import check_config

    cfg = load_config(ROOT / SHAPES_CONFIG, ["reward.name=pickscor"])
    with pytest.raises(ConfigError) as checked:
        check_config(cfg)
    with pytest.raises(ConfigError) as built:
        build_trainer(cfg)
    assert str(checked.value) == str(built.value)


# What diffalign writes on stderr under --quiet: the trainer's banner ("diffalign: ...") and its
# log lines under it (indented two spaces: derived numbers, eval results), its own warnings and
# errors. Any other line came from a library underneath.
OWN_STDERR = ("diffalign: ", "  ", "warning: ", "error: ")


def test_quiet_train_writes_only_diffalign_lines(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="default")
    argv = [sys.executable, "-m", "diffalign.cli", "train", CONFIG, "max_iterations=1", "--quiet",
            f"output_dir={tmp_path / 'q'}", "--overwrite", *FAST]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    foreign = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(OWN_STDERR)]
    assert foreign == [] and "Traceback" not in done.stderr, done.stderr
    assert "diffalign: flow_grpo on tiny:sd3" in done.stderr  # the banner is diffalign's, and stays
