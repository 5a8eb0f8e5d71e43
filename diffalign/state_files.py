"""Run state on disk without pickle: tensors in safetensors, everything else in JSON.

A training state is a nested structure of dicts, lists, tuples, numbers, strings, tensors and
numpy arrays (optimizer state, RNG states, counters). :func:`write_state` splits it into

- ``tensors.safetensors``: every tensor, under a generated key (``t0``, ``t1``, ...);
- ``state.json``: the structure, with ``{"__tensor__": key}`` where a tensor was, and tagged
  forms for what JSON lacks (tuples, non-string dict keys, numpy arrays, non-finite floats),
  plus the SHA-256 and size of the tensor file so that a truncated or altered file is detected.

:func:`read_state` reverses it. Reading never executes code from the files: safetensors holds raw
tensor bytes, and JSON only data; an unknown tag is an error. Every file is fsynced after it is
written (the caller renames the folder into place and fsyncs the parent).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any


import numpy as np
import torch

from diffalign import faults
from diffalign.errors import RunDirError

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"  # written last: a folder without it is incomplete
FORMAT = "diffalign-state/1"

def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else {"__float__": repr(value)}  # 'nan', 'inf', '-inf'
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared storage
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"cannot store {type(obj).__name__} at {where or '<root>'} in a run state (tensors, numbers, strings, "
                    f"lists, tuples and dicts only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    if any(k.startswith("__") for k in obj):
        raise ValueError(f"unknown tag {next(k for k in obj if k.startswith('__'))!r}")
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _written(path: Path) -> None:
    fsync_file(path)
    faults.file_written(path)


def write_state(folder: Path, state: dict) -> None:
    """Write ``state`` into the (new, empty) ``folder``: the tensor file, then ``state.json``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    body = _encode(state, tensors, "")
    tensor_file = folder / TENSORS_FILE
    save_file(tensors, str(tensor_file))
    _written(tensor_file)
    faults.checkpoint_file_written(tensor_file)
    doc = {"format": FORMAT, "tensors": {"file": TENSORS_FILE, "bytes": tensor_file.stat().st_size,
                                         "sha256": _sha256(tensor_file)}, "state": body}
    state_file = folder / STATE_FILE
    with open(state_file, "w") as f:
        json.dump(doc, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    _written(state_file)
    fsync_dir(folder)


def read_state(folder: Path) -> dict:
    """The state written by :func:`write_state`; :class:`RunDirError` (one line) when the folder is
    incomplete, altered, truncated or of another format."""
    from safetensors.torch import load_file

    state_file, tensor_file = folder / STATE_FILE, folder / TENSORS_FILE
    if (folder / "state.pt").is_file() and not state_file.is_file():
        raise RunDirError(f"checkpoint {str(folder)!r} is in the old pickle format (state.pt), which diffalign no longer "
                          f"loads because unpickling can run code; retrain, or convert it with the diffalign version that wrote it")
    try:
        doc = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise RunDirError(f"checkpoint {str(folder)!r} is incomplete ({STATE_FILE} missing)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunDirError(f"checkpoint {str(state_file)!r} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RunDirError(f"checkpoint {str(state_file)!r} is not a {FORMAT} file")
    meta = doc.get("tensors") or {}
    try:
        size = tensor_file.stat().st_size
    except FileNotFoundError:
        raise RunDirError(f"checkpoint {str(folder)!r} is incomplete ({TENSORS_FILE} missing)") from None
    if size != meta.get("bytes") or _sha256(tensor_file) != meta.get("sha256"):
        raise RunDirError(f"checkpoint {str(tensor_file)!r} is truncated or altered ({size} bytes, "
                          f"{meta.get('bytes')} recorded; checksum differs)")
    try:
        tensors = load_file(str(tensor_file))
        return _decode(doc["state"], tensors)
    except Exception as exc:  # malformed structure: name the file, one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RunDirError(f"checkpoint {str(folder)!r} cannot be read: {first}") from None
