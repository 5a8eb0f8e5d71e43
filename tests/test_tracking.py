"""Experiment trackers: a tiny run logs its scalars, evaluation table, sample grids and config to
TensorBoard (read back from the event files), W&B offline and trackio; bad tracker names fail in
one line."""

from __future__ import annotations

import importlib.util
import json

import pytest

from diffalign.errors import ConfigError
from tests.helpers.tiny_run import CONFIG, FAST, run_cli

TINY = [*FAST, "max_iterations=1", "eval.num_prompts=1", "checkpoint.every=0"]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not _installed("tensorboard"), reason="tensorboard is not installed")
def test_tensorboard_event_files_hold_scalars_images_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "log.trackers=[tensorboard]", "log.run_name=tiny", *TINY, "eval.at_start=true") == 0
    logdir = out / "tensorboard" / "tiny"
    assert list(logdir.glob("events.out.tfevents.*")), "no event file"
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = next(r for r in records if not r.get("eval"))
    # every numeric value of the iteration's metrics.jsonl record is a scalar at its iteration
    for key in ("reward_mean", "loss", "seconds"):
        (event,) = acc.Scalars(key)
        assert event.step == train["iteration"] and event.value == pytest.approx(train[key], rel=1e-5)
    # evaluations before (step 0) and after (step 1) training
    assert [e.step for e in acc.Scalars("eval/reward_mean")] == [0, 1]
    assert [e.step for e in acc.Images("eval/samples")] == [0, 1]
    assert acc.Images("eval/samples")[0].encoded_image_string.startswith(b"\x89PNG")
    assert any("eval/table" in t for t in tags["tensors"])  # the evaluation table (a Markdown text panel)
    # the config as hyperparameters: accelerate writes them next to the events
    (hparams,) = logdir.glob("*/hparams.yml")
    assert "optim.lr: 0.001" in hparams.read_text()


def test_unknown_tracker_is_a_one_line_config_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "log.trackers=[tensorbored]", *TINY) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "log.trackers" in err and "tensorbored" in err
    assert not out.exists()


def test_missing_tracker_package_names_the_key(monkeypatch):
    from diffalign.training import tracking

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="log.trackers.*'mlflow'.*not installed"):
        tracking.check_trackers(["mlflow"])


@pytest.mark.skipif(not _installed("wandb"), reason="wandb is not installed")
def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "log.trackers=[wandb]", "log.offline=true", *TINY) == 0
    (run,) = (out / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb")), "no offline wandb run file"


@pytest.mark.skipif(not _installed("trackio"), reason="trackio is not installed")
def test_trackio_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    import trackio.utils

    monkeypatch.setattr(trackio.utils, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "log.trackers=[trackio]", "log.project=tiny-tracking", *TINY) == 0
    assert list((tmp_path / "trackio").rglob("*tiny-tracking*")), "no local trackio project"
