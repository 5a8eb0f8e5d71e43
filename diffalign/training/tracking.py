"""Experiment trackers (TensorBoard, Weights & Biases, MLflow, trackio) through accelerate's tracker API.

``log.trackers`` names the trackers; the trainer hands them to ``Accelerator(log_with=...)`` and
:class:`Tracking` starts them once the run directory exists, then mirrors what the run writes:

- the config as hyperparameters (flattened to dotted keys: ``optim.lr``, ``rollout.group_size``);
- every numeric value of every ``metrics.jsonl`` record as a scalar, at step = the record's
  ``iteration`` (training records at the iteration they ran, evaluations at the number of
  iterations done before them);
- each evaluation as a table (metric, value) and its sample grid as an image;
- pictures a recipe draws (BranchGRPO's tree) as images.

Only the main process logs (accelerate's trackers are main-process only). Where each tracker
writes: TensorBoard event files under ``RUN_DIR/tensorboard/<log.run_name>``; W&B under
``RUN_DIR/wandb`` (``log.offline`` or ``WANDB_MODE=offline``: no network, ``wandb sync`` later);
MLflow to ``RUN_DIR/mlruns`` when offline, else to ``MLFLOW_TRACKING_URI``; trackio to its local
database (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from diffalign.config import TRACKER_MODULES
from diffalign.errors import ConfigError
from diffalign.evaluation import is_bound_key

TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard/<run_name>: `tensorboard --logdir RUN_DIR/tensorboard`


def check_trackers(names: Sequence[str]) -> None:
    """One-line ``ConfigError`` naming ``log.trackers`` for an unknown or uninstalled tracker."""
    for name in names:
        if name not in TRACKER_MODULES:
            raise ConfigError(f"config key 'log.trackers' has unknown tracker {name!r} (known: {', '.join(TRACKER_MODULES)})")
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            raise ConfigError(f"config key 'log.trackers' names {name!r}, which is not installed "
                              f"(pip install {TRACKER_MODULES[name]}, or pip install -e '.[tracking]')")


def run_name(cfg) -> str:
    """``log.run_name``, else the run directory's name."""
    return cfg.log.run_name or Path(cfg.output_dir).name


def log_with(cfg) -> list:
    """``Accelerator(log_with=...)``: TensorBoard as a tracker object (so that its event files go to
    ``RUN_DIR/tensorboard/<run_name>``), the others by name. Nothing starts before
    :meth:`Tracking.start`."""
    from accelerate.tracking import TensorBoardTracker

    out: list = []
    for name in cfg.log.trackers:
        if name == "tensorboard":
            out.append(TensorBoardTracker(run_name(cfg), Path(cfg.output_dir) / TENSORBOARD_DIR))
        else:
            out.append(name)
    return out


def flat_config(data: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested config dict -> ``{"optim.lr": 3e-4, ...}`` with values every tracker accepts as a
    hyperparameter (bool, int, float, str; lists and None as text)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


class Tracking:
    """The run's trackers (a no-op without ``log.trackers`` or off the main process)."""

    def __init__(self, accelerator, cfg):
        self.accelerator = accelerator
        self.cfg = cfg
        self.enabled = bool(cfg.log.trackers) and accelerator.is_main_process
        self.run_dir = Path(cfg.output_dir)

    def start(self, config: Mapping) -> None:
        """Start every tracker (after the run directory exists) and store the config."""
        if not self.cfg.log.trackers:
            return
        name, offline = run_name(self.cfg), self.cfg.log.offline
        init_kwargs = {
            "wandb": {"name": name, "dir": str(self.run_dir), **({"mode": "offline"} if offline else {})},
            "trackio": {"name": name},
            "mlflow": {"run_name": name, **({"logging_dir": str(self.run_dir / "mlruns")} if offline else {})},
        }
        if offline and "mlflow" in self.cfg.log.trackers and self.accelerator.is_main_process:
            import mlflow

            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
        # every process calls it: accelerate starts the trackers on the main process only
        self.accelerator.init_trackers(self.cfg.log.project, config=flat_config(config), init_kwargs=init_kwargs)

    def log(self, record: Mapping, step: int) -> None:
        """The numeric values of a metrics record, as scalars at ``step``."""
        if not self.enabled:
            return
        values = {k: float(v) for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"}
        if values:
            self.accelerator.log(values, step=step)

    def log_record(self, record: Mapping) -> None:
        """A ``metrics.jsonl`` record at its iteration: its scalars, and an evaluation record's
        metrics (value and 95 % interval) as the table ``eval/table``."""
        step = int(record.get("iteration", 0))
        self.log(record, step)
        if record.get("eval"):
            rows = [[k[5:], float(v), record.get(f"{k}_lo"), record.get(f"{k}_hi")] for k, v in record.items()
                    if k.startswith("eval/") and isinstance(v, (int, float)) and not is_bound_key(k)]
            self.log_table("eval/table", ["metric", "value", "lo", "hi"], rows, step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A small table: a W&B / trackio table, a Markdown text panel in TensorBoard, an MLflow
        JSON artifact."""
        if not self.enabled:
            return
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                tracker.log_table(name, columns=columns, data=rows, step=step)
            elif tracker.name == "tensorboard":
                lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
                tracker.writer.add_text(name, "\n".join(lines), global_step=step)
                tracker.writer.flush()
            elif tracker.name == "trackio":
                import trackio

                tracker.log({name: trackio.Table(columns=columns, data=rows)}, step=step)
            elif tracker.name == "mlflow":
                import mlflow

                mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(columns)},
                                 artifact_file=f"{name.replace('/', '_')}-{step:06d}.json")

    def log_image(self, name: str, image, step: int) -> None:
        """One picture (a PNG path, a PIL image or an (H, W, 3) uint8 array)."""
        if not self.enabled:
            return
        from PIL import Image

        if isinstance(image, (str, Path)):
            with Image.open(image) as im:
                image = im.convert("RGB")
        array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({name: array[None]}, step=step, dataformats="NHWC")
                tracker.writer.flush()
            elif tracker.name == "wandb":
                tracker.log_images({name: [array]}, step=step)
            elif tracker.name == "trackio":
                import trackio

                tracker.log({name: trackio.Image(array)}, step=step)
            elif tracker.name == "mlflow":
                import mlflow

                mlflow.log_image(array, key=name, step=step)

    def finish(self) -> None:
        """Close the trackers (accelerate's ``end_training`` without its end of the process group,
        which the trainer ends itself: :func:`diffalign.distributed.end_process_group`)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
