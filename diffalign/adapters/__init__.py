"""Model adapters: one per diffusers pipeline family, found by name and imported lazily.

``load_adapter(model_id)`` resolves, in this order:

- ``tiny:<family>``: the family's tiny random model built in code (tests, smoke runs);
- ``shapes`` / ``default``: the small text-to-image model shipped with diffalign;
- an existing local folder: the family is read from its ``model_index.json`` ``_class_name``;
- a string that looks like a path (``.``, ``/``, ``~``) but does not exist: an error;
- anything else: a hub id, whose family is read from the hub's ``model_index.json`` unless
  ``family`` is given.

Every failure raises :class:`diffalign.errors.ModelLoadError` with a one-line message naming
the id, path or family and the known families. :func:`model_family` resolves an id the same way
without loading anything (``diffalign config`` and ``train`` check ``model.id`` with it first).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from ..errors import DiffalignError, ModelLoadError, close_match
from .base import ModelAdapter, PromptEmbeds

# family name -> "module:Class". Adding a model = one adapter module + one line here (+ one in
# PIPELINE_FAMILIES); no sampler or algorithm changes.
FAMILIES: dict[str, str] = {
    "sd3": "diffalign.adapters.sd3:SD3Adapter",
    "flux": "diffalign.adapters.flux:FluxAdapter",
    "flux_kontext": "diffalign.adapters.flux_kontext:FluxKontextAdapter",
    "sd15": "diffalign.adapters.sd15:SD15Adapter",
    "sdxl": "diffalign.adapters.sdxl:SDXLAdapter",
    "sana": "diffalign.adapters.sana:SanaAdapter",
    "qwen": "diffalign.adapters.qwen:QwenImageAdapter",
    "qwen_edit": "diffalign.adapters.qwen_edit:QwenImageEditAdapter",
    "flux2": "diffalign.adapters.flux2:Flux2Adapter",
    "wan": "diffalign.adapters.wan:WanAdapter",
    "zimage": "diffalign.adapters.zimage:ZImageAdapter",
    "ltx": "diffalign.adapters.ltx:LTXAdapter",
    "hunyuan_video": "diffalign.adapters.hunyuan_video:HunyuanVideoAdapter",
    "shapes": "diffalign.adapters.shapes:ShapesAdapter",
}

# model_index.json `_class_name` -> family.
PIPELINE_FAMILIES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux_kontext",
    "StableDiffusionPipeline": "sd15",
    "StableDiffusionXLPipeline": "sdxl",
    "SanaPipeline": "sana",
    "QwenImagePipeline": "qwen",
    "QwenImageEditPipeline": "qwen_edit",
    "Flux2KleinPipeline": "flux2",
    "WanPipeline": "wan",
    "ZImagePipeline": "zimage",
    "LTXPipeline": "ltx",
    "HunyuanVideoPipeline": "hunyuan_video",
    "ShapesPipeline": "shapes",
}

# families whose every prompt needs a source image (prompts.image_column); FLUX.1 Kontext without
# one is FLUX.1 text-to-image
SOURCE_IMAGE_FAMILIES = ("qwen_edit",)

DEFAULT_ALIASES = ("shapes", "default")  # ids of the shipped default model
TINY_PREFIX = "tiny:"

__all__ = ["FAMILIES", "PIPELINE_FAMILIES", "SOURCE_IMAGE_FAMILIES", "ModelAdapter", "PromptEmbeds", "adapter_class", "load_adapter", "model_family"]


def _known() -> str:
    return f"known families: {', '.join(sorted(FAMILIES))}"


def adapter_class(family: str, *, model_id: str | None = None) -> type[ModelAdapter]:
    """The adapter class registered for ``family`` (imported on first use); ``model_id`` only
    makes the error message name the model being loaded."""
    prefix = f"model {model_id!r}: " if model_id is not None else ""
    _check_family(family, model_id)
    module_name, _, class_name = FAMILIES[family].partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"{prefix}model family {family!r} cannot be imported from {FAMILIES[family]!r}: {e}") from e


def _check_family(family: str, model_id: str | None = None) -> None:
    """A family name of :data:`FAMILIES` (its module is not imported)."""
    if family not in FAMILIES:
        prefix = f"model {model_id!r}: " if model_id is not None else ""
        raise ModelLoadError(f"{prefix}unknown model family {family!r}{close_match(family, FAMILIES)}; {_known()}")


def _family_from_index(index_file: Path | str, where: str) -> str:
    """Family named by a ``model_index.json``; ``where`` names the model in error messages."""
    try:
        class_name = json.loads(Path(index_file).read_text())["_class_name"]
    except FileNotFoundError as e:
        raise ModelLoadError(f"{where} has no model_index.json (not a diffusers pipeline folder); {_known()}") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{where}: cannot read _class_name from model_index.json ({e}); {_known()}") from e
    if class_name not in PIPELINE_FAMILIES:
        raise ModelLoadError(
            f"{where}: pipeline class {class_name!r} has no adapter "
            f"(supported: {', '.join(sorted(PIPELINE_FAMILIES))}); {_known()}"
        )
    return PIPELINE_FAMILIES[class_name]


def _family_from_hub(model_id: str, kwargs: dict) -> str:
    try:
        from huggingface_hub import hf_hub_download

        hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
        index_file = hf_hub_download(repo_id=model_id, filename="model_index.json", **hub_kwargs)
    except Exception as e:  # offline, unknown repo, gated repo, invalid id: all one user-facing error
        raise ModelLoadError(
            f"cannot read model_index.json of hub model {model_id!r} ({type(e).__name__}: {_first_line(e)}); "
            f"check the id or pass family=...; {_known()}"
        ) from e
    return _family_from_index(index_file, f"hub model {model_id!r}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _from_pretrained(cls: type[ModelAdapter], source: str, model_id: str, device, dtype, kwargs) -> ModelAdapter:
    try:
        return cls.from_pretrained(source, device=device, dtype=dtype, **kwargs)
    except DiffalignError:
        raise
    except Exception as e:  # missing files, wrong layout, offline hub, bad kwargs
        raise ModelLoadError(
            f"cannot load {cls.family} model {model_id!r} ({type(e).__name__}: {_first_line(e)}); {_known()}"
        ) from e


def load_adapter(
    model_id: str, *, family: str = "auto", device="cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> ModelAdapter:
    """Load a model as a :class:`ModelAdapter`.

    Args:
        model_id: ``tiny:<family>``, ``shapes`` / ``default``, a local pipeline folder or a
            hub id (see the module docstring).
        family: ``"auto"`` to detect it from ``model_index.json``, or a name in
            :data:`FAMILIES` to force one (required for hub ids when offline).
        device, dtype: where and in which dtype the frozen parts live.
        **kwargs: passed to the adapter's ``from_pretrained`` (adapter options such as
            ``max_sequence_length`` or ``guidance``, and pipeline options such as ``revision``),
            or to ``build_tiny`` (``seed`` and the same adapter options) for ``tiny:`` ids.
    """
    from ..progress import library_loading_bars_off

    with library_loading_bars_off():  # the caller shows its own loading phase
        return _load_adapter(str(model_id), family, device, dtype, kwargs)


def _load_adapter(model_id: str, family: str, device, dtype: torch.dtype, kwargs: dict) -> ModelAdapter:
    kind, name = _locate(model_id, _forced(family))
    if name is None:  # a hub id: its model_index.json names the family
        name = _family_from_hub(model_id, kwargs)
    cls = adapter_class(name, model_id=model_id)
    if kind == "tiny":
        try:
            return cls.build_tiny(device=device, dtype=dtype, **kwargs)
        except TypeError as e:  # an option this family does not have
            raise ModelLoadError(f"cannot build {model_id!r}: {e}; {_known()}") from e
    if kind == "default":
        if not hasattr(cls, "default_model_path"):
            raise ModelLoadError(f"model {model_id!r}: family {cls.family!r} has no shipped default model; {_known()}")
        return _from_pretrained(cls, str(cls.default_model_path()), model_id, device, dtype, kwargs)
    source = str(Path(model_id).expanduser()) if kind == "folder" else model_id
    return _from_pretrained(cls, source, model_id, device, dtype, kwargs)


def model_family(model_id: str, family: str | None = "auto") -> str | None:
    """The family :func:`load_adapter` would load ``model_id`` as, found without loading weights,
    importing the adapter or asking the hub; None for a hub id whose ``family`` is not given (the
    hub's model_index.json names it at load time). Raises the ModelLoadError loading would raise
    for an unknown family, a missing path, or a folder that is not a pipeline of a known family."""
    return _locate(str(model_id), _forced(family))[1]


def _forced(family: str | None) -> str | None:
    return None if family in (None, "auto") else family


def _locate(model_id: str, forced: str | None) -> tuple[str, str | None]:
    """``(kind, family)`` of ``model_id`` in the order of the module docstring: kind is ``tiny``,
    ``default``, ``folder`` or ``hub``; family is None only for a hub id without ``forced``."""
    if forced is not None:
        _check_family(forced, model_id)  # fail early on an unknown family
    if model_id.startswith(TINY_PREFIX):
        name = model_id[len(TINY_PREFIX):]
        if forced is not None and forced != name:
            raise ModelLoadError(f"model {model_id!r} is family {name!r} but family={forced!r} was given; {_known()}")
        _check_family(name, model_id)
        return "tiny", name
    if model_id in DEFAULT_ALIASES:
        return "default", forced or "shapes"
    path = Path(model_id).expanduser()
    if path.is_dir():
        return "folder", forced or _family_from_index(path / "model_index.json", f"model folder {model_id!r}")
    if path.exists():
        raise ModelLoadError(f"model path {model_id!r} is a file; expected a diffusers pipeline folder")
    if model_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {model_id!r} does not exist")
    return "hub", forced
