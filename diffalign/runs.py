"""Run directories: layout, atomic writes, metrics, checkpoints.

Layout of a run directory::

    config.yaml        resolved config of the run
    metrics.jsonl      one JSON object per iteration (and eval records with "eval": true)
    checkpoints/       iter-000010/ tensors.safetensors + state.json (full training state), written atomically
    final/             weights a diffusers pipeline loads (LoRA: load_lora_weights(final/))
    report.md          plots and before/after sample grids (when log.report is on)
    text_embeddings/   the prompt set's embeddings (model.text_encoders: cache; diffalign.training.text_encoders)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from diffalign import faults, state_files
from diffalign.errors import RunDirError

METADATA_FILE = "diffalign.json"  # final/ and exported folders: what was trained how


def eval_records_path(run_dir: Path, iteration: int) -> Path:
    """Where the trainer keeps one evaluation's per-image records (``eval_records/iter-N.json``)."""
    return Path(run_dir) / "eval_records" / f"iter-{iteration:06d}.json"


def read_final_metadata(run_dir: Path) -> dict:
    """``final/diffalign.json`` of a run directory (what was trained how)."""
    meta_file = Path(run_dir) / "final" / METADATA_FILE
    if not (Path(run_dir) / "config.yaml").is_file():
        raise RunDirError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    if not meta_file.is_file():
        raise RunDirError(f"run {str(run_dir)!r} has no final weights (no final/{METADATA_FILE}); has it finished?")
    return json.loads(meta_file.read_text())


def finished_iterations(run_dir: Path, max_iterations: int, report: bool = False) -> Optional[int]:
    """The iterations a finished run trained, or None when a resume has work left. Finished: its
    ``final/`` holds the weights of the latest checkpoint's iteration (the final evaluation ran before
    they were written), that iteration reaches ``max_iterations``, and (``report``) report.md exists."""
    meta_file = Path(run_dir) / "final" / METADATA_FILE
    try:
        done = json.loads(meta_file.read_text()).get("iterations")
    except (OSError, ValueError, AttributeError):
        return None
    latest = latest_checkpoint(Path(run_dir))
    if not isinstance(done, int) or done < max_iterations or (latest is not None and _checkpoint_iteration(latest) > done):
        return None
    if report and not (Path(run_dir) / "report.md").is_file():
        return None
    return done


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
        state_files.fsync_dir(path.parent)
        faults.file_written(path)
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


def read_jsonl(path: Path, warn: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Records of a JSON-lines file. A torn last line (a crash while appending it) is dropped,
    with a warning through ``warn``; a bad line before the last is an error."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if i == len(lines) - 1:
                if warn is not None:
                    warn(f"warning: dropped the torn last line of {str(path)!r} ({len(line)} characters)")
                break
            raise RunDirError(f"{str(path)!r} line {i + 1} is not a JSON object; the file is damaged") from None
        records.append(record)
    return records


class MetricsLog:
    """Append-only ``metrics.jsonl``. On resume it is cut back to the records that existed when the
    checkpoint was written (what a run interrupted later added is dropped)."""

    def __init__(self, path: Path):
        self.path = path

    def count(self) -> int:
        """Records written so far (a checkpoint stores it)."""
        return len(self.read())

    def truncate(self, *, records: Optional[int] = None, iteration: Optional[int] = None,
                 warn: Optional[Callable[[str], None]] = None) -> None:
        """Keep the first ``records`` records, or those before ``iteration``; a torn last line goes."""
        if not self.path.exists():
            return
        kept = read_jsonl(self.path, warn)
        kept = kept[:records] if records is not None else [r for r in kept if r.get("iteration", -1) < iteration]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def truncate_from(self, iteration: int) -> None:
        self.truncate(iteration=iteration)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        faults.file_written(self.path)

    def read(self) -> list[dict]:
        return read_jsonl(self.path)


def _checkpoint_iteration(path: Path) -> Optional[int]:
    digits = path.name[len(CHECKPOINT_PREFIX):]
    return int(digits) if path.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (``state.json``, written last, marks one finished;
    an old-format ``state.pt`` folder is listed so that loading it can say why it is refused)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _checkpoint_iteration(p) is not None
             and ((p / state_files.STATE_FILE).is_file() or (p / "state.pt").is_file())]
    return sorted(found, key=_checkpoint_iteration)


def clean_partial_writes(run_dir: Path) -> list[Path]:
    """Remove what a process killed while writing left behind: ``checkpoints/.tmp-*`` folders and
    the temporary files of atomic writes. Returns what was removed."""
    removed = []
    candidates = list((run_dir / "checkpoints").glob(".tmp-*")) if (run_dir / "checkpoints").is_dir() else []
    candidates += [p for p in run_dir.glob(".*") if p.name.startswith((".metrics.jsonl.", ".config.yaml.", ".final-"))]
    for p in candidates:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep_last: int) -> Path:
    """Write ``checkpoints/iter-N/`` (safetensors + JSON) into a temporary folder, fsync it, rename
    it into place and fsync the parent. On failure (a full disk) the temporary folder is removed and
    earlier checkpoints are untouched; the error names the last good one."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{iteration:06d}"
    previous = latest_checkpoint(run_dir)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        state_files.write_state(tmp, state)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        state_files.fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the previous checkpoint {previous.name} is intact" if previous is not None else "no earlier checkpoint exists"
        raise RunDirError(f"cannot write checkpoint {str(final)!r}: {exc.strerror or exc}; {kept}") from None
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
    """The state in ``path`` (safetensors + JSON; :class:`RunDirError` when unreadable)."""
    return state_files.read_state(path)
