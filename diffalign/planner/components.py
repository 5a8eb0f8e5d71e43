"""The published architectures a plan counts, built on the ``meta`` device from shipped configs.

``architectures/<hub id with / as -->/<component>.json`` holds the ``config.json`` of one pipeline
component as published on the Hub (its ``_source``), ``architectures/rewards/<reward>.json`` a reward
model's. A component's role comes from its file name, as a diffusers pipeline names it:
``transformer*`` / ``unet`` the denoiser (Wan2.2 has two experts), ``text_encoder*`` the text
encoders, ``vae`` the autoencoder. Building under accelerate's ``init_empty_weights`` allocates no
memory, so every count here is exact and takes milliseconds.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffalign.errors import ConfigError, close_match

ARCHITECTURES = Path(__file__).with_name("architectures")
REWARDS = "rewards"  # the folder of reward models
DENOISER_PREFIXES = ("transformer", "unet")
TEXT_ENCODER_PREFIX = "text_encoder"


def slug(model_id: str) -> str:
    """The folder name of a hub id: ``org/name`` -> ``org--name`` (the Hub cache's own spelling)."""
    return model_id.strip("/").replace("/", "--")


def shipped_models() -> list[str]:
    """Hub ids with a shipped architecture."""
    return sorted(p.name.replace("--", "/") for p in ARCHITECTURES.iterdir() if p.is_dir() and p.name != REWARDS)


def model_folder(model_id: str) -> Path:
    """The architecture folder of ``model_id`` (case-insensitive); a ConfigError naming the key otherwise."""
    wanted = slug(model_id).lower()
    for folder in ARCHITECTURES.iterdir():
        if folder.is_dir() and folder.name.lower() == wanted:
            return folder
    raise ConfigError(f"config key 'model.id': no architecture shipped for {model_id!r}{close_match(model_id, shipped_models())}; "
                      f"add its components' config.json files to {ARCHITECTURES / slug(model_id)}/")


def role(component: str) -> str:
    """``denoiser``, ``text_encoder`` or ``vae`` for a pipeline component name."""
    if component.startswith(DENOISER_PREFIXES):
        return "denoiser"
    if component.startswith(TEXT_ENCODER_PREFIX):
        return "text_encoder"
    return component


def read_config(path: Path) -> dict:
    return json.loads(path.read_text())


def build_meta(config: dict) -> torch.nn.Module:
    """The module a config describes, with parameters on the ``meta`` device (no memory)."""
    from accelerate import init_empty_weights

    config = {k: v for k, v in config.items() if k != "_source"}
    name = config.pop("_class_name")
    with init_empty_weights(include_buffers=True):
        if "model_type" in config:  # a transformers model
            import transformers

            model_type = config.pop("model_type")
            cls = getattr(transformers, name)
            return cls(transformers.AutoConfig.for_model(model_type, **config))
        import diffusers

        cls = getattr(diffusers, name)
        return cls.from_config(config)


@dataclass(frozen=True)
class Component:
    """One counted module: its pipeline name, role, parameter count and where the config came from."""

    name: str
    role: str
    params: int
    buffers: int  # floating buffer elements (stored in the checkpoint and cast with the weights)
    source: str
    config: dict


def _count(config: dict) -> tuple[int, int]:
    """``(parameters, floating buffer elements)`` of a config's module; one build per distinct
    architecture (the same CLIP or T5 serves several pipelines)."""
    return _count_json(json.dumps({k: v for k, v in config.items() if k != "_source"}, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _meta_json(text: str) -> torch.nn.Module:
    return build_meta(json.loads(text))


@functools.lru_cache(maxsize=None)
def _count_json(text: str) -> tuple[int, int]:
    module = _meta_json(text)
    return sum(p.numel() for p in module.parameters()), sum(b.numel() for b in module.buffers() if b.is_floating_point())


def model_components(model_id: str) -> list[Component]:
    """Every component of a shipped pipeline architecture, denoiser first."""
    folder = model_folder(model_id)
    parts = []
    for path in sorted(folder.glob("*.json")):
        config = read_config(path)
        parts.append(Component(path.stem, role(path.stem), *_count(config), config.get("_source", str(path)), config))
    order = {"denoiser": 0, "text_encoder": 1}
    return sorted(parts, key=lambda c: (order.get(c.role, 2), c.name))


def reward_component(name: str) -> Component | None:
    """The reward model of a registered reward name, or None when none is shipped (a remote or
    rule-based reward, or one whose architecture is not known here)."""
    path = ARCHITECTURES / REWARDS / f"{name}.json"
    if not path.is_file():
        return None
    config = read_config(path)
    return Component(name, "reward", *_count(config), config.get("_source", str(path)), config)


def meta_denoiser(model_id: str, component: str) -> torch.nn.Module:
    """A denoiser component of ``model_id`` on the meta device (built once: LoRA counts walk it)."""
    config = read_config(model_folder(model_id) / f"{component}.json")
    return _meta_json(json.dumps({k: v for k, v in config.items() if k != "_source"}, sort_keys=True))
