"""Finding and reading a reward's weights file: a local path, or one file in a hub repository.

Used by rewards whose weights are a single checkpoint file rather than a ``save_pretrained``
folder (the LAION aesthetic head, HPSv2). Errors are one-line ``RewardError``s that name the
file or the repository.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from diffalign.errors import RewardError
from reward_models.clip_score import _first_line, _looks_like_path


def resolve_weights_file(reward: str, source: str, filename: str) -> str:
    """Local path of a weights file.

    ``source`` is either a local file (used as is) or a hub repo id ("namespace/name") from which
    ``filename`` is downloaded into (or read from) the huggingface_hub cache.
    """
    expanded = os.path.expanduser(str(source))
    if os.path.isfile(expanded):
        return expanded
    is_file_name = str(source).endswith((".pt", ".pth", ".bin", ".safetensors"))
    if _looks_like_path(str(source)) or os.path.isdir(expanded) or is_file_name:
        raise RewardError(f"{reward}: weights file {source!r} does not exist")
    from huggingface_hub import hf_hub_download  # lazy: only needed for hub ids

    try:
        return hf_hub_download(repo_id=str(source), filename=filename)
    except Exception as exc:  # offline, unknown repo or file, network errors
        raise RewardError(f"{reward}: cannot get {filename!r} from hub repo {source!r}: {_first_line(exc)}") from None


def load_state_dict(reward: str, path: str, weights_only: bool = True) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` or ``torch.save`` checkpoint on the CPU.

    Training checkpoints that wrap the weights (``{"state_dict": ...}``) are unwrapped and a
    DataParallel ``module.`` prefix is removed. ``weights_only=True`` refuses pickled code objects;
    pass False only for a file you trust.
    """
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state: Any = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # corrupt file, pickled objects refused by weights_only, ...
        raise RewardError(f"{reward}: cannot read weights file {path!r}: {_first_line(exc)}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardError(f"{reward}: weights file {path!r} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
