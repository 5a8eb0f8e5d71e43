"""Loading code the reward models share: dtype and batch-size arguments, local path or hub id,
one-line errors, freezing a loaded model on its device, and a weights file that is a local path
or one file in a hub repository.

The weights-file helpers serve rewards whose weights are a single checkpoint file rather than a
``save_pretrained`` folder (the LAION aesthetic head, HPSv2). Errors are one-line ``RewardError``s that name the
file or the repository.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from diffalign.errors import RewardError


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A reward's ``dtype`` argument as a torch dtype (None: float32)."""
    if dtype is None:
        return torch.float32  # fp32 by default: bf16 is a speed choice the caller makes
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    parsed = getattr(torch, aliases.get(str(dtype), str(dtype)), None)
    if not isinstance(parsed, torch.dtype):
        raise RewardError(f"clip_score: unknown dtype {dtype!r}; use float32, float16 or bfloat16")
    return parsed


def looks_like_path(model: str) -> bool:
    """True when ``model`` names a local folder or file rather than a hub id."""
    # Hub ids are "name" or "namespace/name"; anything else is meant as a local folder.
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1 or "\\" in model


def hub_id_or_folder(reward: str, what: str, name: str) -> str:
    """A hub id as is, or an existing local folder (expanded); a missing folder is a RewardError
    naming ``what`` ("model", "processor", ...)."""
    if not looks_like_path(name):
        return name
    path = os.path.expanduser(name)
    if not os.path.isdir(path):
        raise RewardError(f"{reward}: {what} folder {name!r} does not exist")
    return path


def processor_config_or_none(path: str) -> dict[str, Any] | None:
    """The ``preprocessor_config.json`` of a model folder or hub id; None when there is none (then
    CLIP's defaults apply)."""
    from transformers.image_processing_utils import ImageProcessingMixin  # lazy: transformers is slow to import

    try:
        processor_config, _ = ImageProcessingMixin.get_image_processor_dict(path)
    except (OSError, ValueError):
        return None
    return processor_config


def check_batch_size(reward: str, batch_size: Any) -> None:
    """A reward's ``batch_size`` argument must be a positive int (a bool is refused)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardError(f"{reward}: batch_size must be a positive integer, got {batch_size!r}")


def components_dtype(model: torch.nn.Module, dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype of a reward built ``from_components``: the parsed argument, or (None) the model's own."""
    return parse_dtype(dtype) if dtype is not None else next(model.parameters()).dtype


def frozen(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` moved to ``device`` and ``dtype`` in place, in eval mode, with no gradients."""
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def pooled_output(features: Any) -> torch.Tensor:
    """The projected embedding of a CLIP ``get_*_features`` call, whatever transformers returns."""
    # transformers 5 returns a model output with the projected embedding in pooler_output;
    # transformers 4 returned the tensor itself.
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def resolve_weights_file(reward: str, source: str, filename: str, what: str = "weights file") -> str:
    """Local path of a weights file (or of another single file, named ``what`` in errors).

    ``source`` is either a local file (used as is) or a hub repo id ("namespace/name") from which
    ``filename`` is downloaded into (or read from) the huggingface_hub cache.
    """
    expanded = os.path.expanduser(str(source))
    if os.path.isfile(expanded):
        return expanded
    is_file_name = str(source).endswith((".pt", ".pth", ".bin", ".safetensors", ".json"))
    if looks_like_path(str(source)) or os.path.isdir(expanded) or is_file_name:
        raise RewardError(f"{reward}: {what} {source!r} does not exist")
    from huggingface_hub import hf_hub_download  # lazy: only needed for hub ids

    try:
        return hf_hub_download(repo_id=str(source), filename=filename)
    except Exception as exc:  # offline, unknown repo or file, network errors
        raise RewardError(f"{reward}: cannot get {filename!r} from hub repo {source!r}: {first_line(exc)}") from None


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
        raise RewardError(f"{reward}: cannot read weights file {path!r}: {first_line(exc)}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardError(f"{reward}: weights file {path!r} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
