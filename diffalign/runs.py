"""Run directories: layout, atomic writes, metrics, checkpoints.

Layout of a run directory::

    config.yaml        resolved config of the run
    metrics.jsonl      one JSON object per iteration (and eval records with "eval": true)
    checkpoints/       iter-000010/ state.pt (full training state), written atomically
    final/             weights a diffusers pipeline loads (LoRA: load_lora_weights(final/))
    report.md          plots and before/after sample grids (when log.report is on)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from diffalign.errors import RunDirError

CHECKPOINT_PREFIX = "iter-"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def check_run_dir(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Raise unless the requested action is allowed: never clobber another run or foreign files."""
    if resume:
        if not is_run_dir(path):
            raise RunDirError(f"cannot resume: {str(path)!r} is not a run directory (no config.yaml)")
        return
    if path.exists() and not path.is_dir():
        raise RunDirError(f"output_dir {str(path)!r} is a file")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            what = "holds another run" if is_run_dir(path) else "is not empty"
            raise RunDirError(
                f"output_dir {str(path)!r} {what}; pass --resume to continue it or --overwrite to replace it"
            )
        if not is_run_dir(path):
            raise RunDirError(f"refusing to overwrite {str(path)!r}: it is not a diffalign run directory")


def prepare_run_dir(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber another run. ``overwrite`` deletes it explicitly; ``resume`` needs one."""
    check_run_dir(path, resume=resume, overwrite=overwrite)
    if resume:
        return
    if path.exists() and any(path.iterdir()):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def _json_safe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, records at or past the resumed iteration are dropped."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_from(self, iteration: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("iteration", -1) < iteration]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep_last: int) -> Path:
    """Write ``checkpoints/iter-N/state.pt`` via a temporary folder and an atomic rename."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{iteration:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        torch.save(state, tmp / "state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except Exception as exc:  # corrupted or truncated file: say which one
        raise RunDirError(f"checkpoint {str(path / 'state.pt')!r} cannot be read: {exc}") from None
