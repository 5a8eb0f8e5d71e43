"""Recipes: one method per module, found by ``algorithm.name``.

``diffalign/recipes/<name>.py`` holds a method's config dataclass (a
:class:`~diffalign.config.AlgorithmConfig`) and its :class:`~diffalign.trainer.Trainer` subclass,
and registers both at its end with :func:`register_recipe`. This package's own module is only the
registry: the shipped methods are listed by module name and imported the first time one is asked
for, so reading a config does not import a trainer it does not use. A method outside diffalign
calls :func:`register_recipe` from its own module (imported before its config is loaded).
"""

from __future__ import annotations

import importlib
from typing import Callable

from diffalign.errors import ConfigError, close_match

DEFAULT = "flow_grpo"  # algorithm.name when a config names none

# the shipped methods: name -> the module that registers it (docs/<name>.md documents it)
_MODULES: dict[str, str] = {name: f"diffalign.recipes.{name}" for name in (
    "flow_grpo", "diffusion_nft", "sol_rl", "stepwise_flow_grpo", "drm_step_grpo", "spo", "diffusion_dpo",
    "branch_grpo", "awm", "drft", "raft", "opd", "dgpo")}
_CONFIGS: dict[str, type] = {}
_TRAINERS: dict[str, Callable] = {}


def register_recipe(name: str, config: type, trainer: Callable) -> None:
    """Register method ``name``: its ``algorithm`` config dataclass and its trainer (a Trainer
    subclass, or a callable ``(cfg, **kwargs) -> Trainer``)."""
    _MODULES.setdefault(name, config.__module__)
    _CONFIGS[name] = config
    _TRAINERS[name] = trainer


def available() -> list[str]:
    return sorted(_MODULES)


def recipe_module(name: str) -> str | None:
    """The module that holds the recipe registered as ``name`` (None when none is)."""
    return _MODULES.get(name)


def check_algorithm_name(name: str) -> None:
    """A registered recipe name, else a one-line ConfigError naming ``algorithm.name``."""
    if name not in _MODULES:
        raise ConfigError(f"config key 'algorithm.name' is unknown: {name!r}{close_match(name, _MODULES)}; "
                          f"known: {', '.join(available())}")


def _load(name: str) -> None:
    check_algorithm_name(name)
    if name not in _CONFIGS:
        importlib.import_module(_MODULES[name])
    if name not in _CONFIGS:
        raise ConfigError(f"module {_MODULES[name]!r} does not register the recipe {name!r} (register_recipe)")


def config_class(name: str) -> type:
    """The ``algorithm`` config dataclass of method ``name``."""
    _load(name)
    return _CONFIGS[name]


def trainer_class(name: str) -> Callable:
    """The trainer of method ``name``."""
    _load(name)
    return _TRAINERS[name]
