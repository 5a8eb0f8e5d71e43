"""Saving trained weights in the formats diffusers users load in one line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from diffalign.adapters.base import ModelAdapter
from diffalign.errors import RunDirError


def denoiser_attr(adapter: ModelAdapter) -> str:
    """Name of the denoiser in the pipeline's components ("transformer" or "unet")."""
    for name, module in adapter.pipeline.components.items():
        if module is adapter.denoiser:
            return name
    raise RuntimeError("the adapter's denoiser is not a component of its pipeline")


def lora_state_dict(adapter: ModelAdapter) -> dict[str, torch.Tensor]:
    """The denoiser's LoRA weights in peft naming (as diffusers' ``save_lora_weights`` expects)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(adapter.denoiser).items()}


def save_trained_weights(adapter: ModelAdapter, out_dir: Path, *, lora: bool, metadata: dict) -> Path:
    """Write ``out_dir`` atomically (temporary folder + rename).

    - LoRA: ``pytorch_lora_weights.safetensors`` through the pipeline class's own
      ``save_lora_weights`` -> ``pipeline.load_lora_weights(out_dir)``.
    - Full fine-tuning: the whole pipeline -> ``DiffusionPipeline.from_pretrained(out_dir)``.
    Plus ``diffalign.json`` with what was trained how.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        if lora:
            pipe_cls = type(adapter.pipeline)
            attr = denoiser_attr(adapter)
            if not hasattr(pipe_cls, "save_lora_weights"):
                raise RunDirError(f"{pipe_cls.__name__} cannot save LoRA weights (no LoRA loader mixin)")
            pipe_cls.save_lora_weights(str(tmp), **{f"{attr}_lora_layers": lora_state_dict(adapter)})
        else:
            adapter.pipeline.save_pretrained(str(tmp))
        (tmp / "diffalign.json").write_text(json.dumps({"format": "lora" if lora else "full", **metadata}, indent=2, default=str))
        if out_dir.exists():
            backup = out_dir.with_name(f".{out_dir.name}-old")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(out_dir, backup)
            os.replace(tmp, out_dir)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_trained_adapter(run_or_final: str | os.PathLike, *, device="cpu", dtype=torch.float32) -> ModelAdapter:
    """Base model + the weights of a run's ``final/`` (or a final folder itself), via diffusers'
    own loading code (``load_lora_weights`` / ``from_pretrained``)."""
    from diffalign.adapters import load_adapter

    path = Path(run_or_final)
    final = path / "final" if (path / "final").is_dir() else path
    meta_file = final / "diffalign.json"
    if not meta_file.is_file():
        raise RunDirError(f"{str(path)!r} has no final weights (no final/diffalign.json); has the run finished?")
    meta = json.loads(meta_file.read_text())
    if meta["format"] == "full":
        return load_adapter(str(final), family=meta.get("family", "auto"), device=device, dtype=dtype)
    adapter = load_adapter(meta["base_model"], family=meta.get("family", "auto"), device=device, dtype=dtype)
    try:
        adapter.pipeline.load_lora_weights(str(final))
    except Exception as exc:
        raise RunDirError(f"LoRA weights in {str(final)!r} do not fit base model {meta['base_model']!r}: {str(exc).splitlines()[0]}") from None
    adapter.denoiser.requires_grad_(False)
    return adapter
