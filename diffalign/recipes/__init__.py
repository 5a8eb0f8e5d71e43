"""Recipes: one trainer per algorithm, found by ``algorithm.name``.

A recipe module defines its config dataclass (registered with
:func:`diffalign.config.register_algorithm_config`) and a :class:`~diffalign.trainer.Trainer`
subclass registered here with :func:`register_recipe`.
"""

from __future__ import annotations

import importlib

from diffalign.errors import ConfigError

_RECIPES: dict[str, str] = {
    "flow_grpo": "diffalign.recipes.flow_grpo:FlowGRPOTrainer",
    "diffusion_nft": "diffalign.recipes.diffusion_nft:DiffusionNFTTrainer",
    "sol_rl": "diffalign.recipes.sol_rl:build_sol_rl_trainer",
    "stepwise_flow_grpo": "diffalign.recipes.stepwise_flow_grpo:StepwiseFlowGRPOTrainer",
    "drm_step_grpo": "diffalign.recipes.drm_step_grpo:StepGRPOTrainer",
    "spo": "diffalign.recipes.spo:SPOTrainer",
    "diffusion_dpo": "diffalign.recipes.diffusion_dpo:DiffusionDPOTrainer",
    "branch_grpo": "diffalign.recipes.branch_grpo:BranchGRPOTrainer",
    "awm": "diffalign.recipes.awm:AWMTrainer",
}


def register_recipe(name: str, target: str) -> None:
    _RECIPES[name] = target


def available() -> list[str]:
    return sorted(_RECIPES)


def recipe_module(name: str) -> str | None:
    """The module that holds the recipe registered as ``name`` (None when none is)."""
    target = _RECIPES.get(name)
    return target.partition(":")[0] if target else None


def trainer_class(name: str):
    if name not in _RECIPES:
        raise ConfigError(f"config key 'algorithm.name' is unknown: {name!r}; known: {', '.join(available())}")
    module, _, attr = _RECIPES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build_trainer(cfg, **kwargs):
    return trainer_class(cfg.algorithm.name)(cfg, **kwargs)
