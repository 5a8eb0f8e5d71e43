"""Recipes: one trainer per algorithm, found by ``algorithm.name``.

A recipe module defines its config dataclass (registered with
:func:`diffalign.config.register_algorithm_config`) and a :class:`~diffalign.trainer.Trainer`
subclass registered here with :func:`register_recipe`. :func:`check_config` is every check that
``train`` makes before it loads a model; ``diffalign config`` makes the same ones.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from diffalign.errors import ConfigError, DiffalignError, close_match

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


def check_algorithm_name(name: str) -> None:
    """A registered recipe name, else a one-line ConfigError naming ``algorithm.name``."""
    if name not in _RECIPES:
        raise ConfigError(f"config key 'algorithm.name' is unknown: {name!r}{close_match(name, _RECIPES)}; "
                          f"known: {', '.join(available())}")


def trainer_class(name: str):
    check_algorithm_name(name)
    module, _, attr = _RECIPES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build_trainer(cfg, **kwargs):
    check_config(cfg)
    return trainer_class(cfg.algorithm.name)(cfg, **kwargs)


def check_config(cfg) -> None:
    """Every name and file of a run config that ``train`` resolves, checked without loading a
    model or building a reward (no weights): ``algorithm.name``, ``reward.name`` (and the names
    inside it: weighted components, SPO's ``algorithm.spm``), ``model.id`` / ``model.family``,
    ``log.trackers`` (known and installed) and the prompts (``prompts.file`` readable, families
    known). One ConfigError naming the key. :func:`build_trainer` calls it, and so does
    ``diffalign config``. A hub id is checked when it loads (naming its family needs the hub)."""
    import reward_models
    from diffalign.adapters import FAMILIES, model_family
    from diffalign.prompts import resolve_probe_prompts, resolve_prompts
    from diffalign.training.tracking import check_trackers

    check_algorithm_name(cfg.algorithm.name)
    named_rewards = [("reward.name", cfg.reward.name, cfg.reward.kwargs)]
    if getattr(cfg.algorithm, "spm", None):  # SPO's step-aware preference model is a reward by name
        named_rewards.append(("algorithm.spm", cfg.algorithm.spm, getattr(cfg.algorithm, "spm_kwargs", None)))
    for key, name, kwargs in named_rewards:
        try:
            reward_models.check_name(name, kwargs)
        except DiffalignError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None
    try:
        model_family(cfg.model.id, cfg.model.family)
    except DiffalignError as exc:
        key = "model.family" if cfg.model.family not in ("auto", *FAMILIES) else "model.id"
        raise ConfigError(f"config key '{key}': {exc}") from None
    check_trackers(cfg.log.trackers)
    resolve_prompts(cfg)
    resolve_probe_prompts(cfg)


def check_judges_trained(cfg, config_path: str) -> None:
    """A recipe whose auxiliary judge is trained by another command (SPO's step-aware preference
    model by ``train-spm``, Step-GRPO's DRM by ``train-reward``) and has not been trained yet: say
    which command trains it, instead of failing later on a missing folder or a Hub lookup."""
    algo = cfg.algorithm
    spm_model = str((getattr(algo, "spm_kwargs", None) or {}).get("model", ""))
    if getattr(algo, "spm", None) == "spm" and getattr(algo, "spm_train", None) and spm_model \
            and not spm_model.startswith("tiny:") and not Path(spm_model).exists():
        raise ConfigError(f"the step-aware preference model {spm_model!r} (algorithm.spm_kwargs.model) is not trained yet; "
                          f"train it first with: diffalign train-spm {config_path}")
    drm_path = str((cfg.reward.kwargs or {}).get("path", "")) if cfg.reward.name == "drm" else ""
    if drm_path and getattr(algo, "drm_train", None) and not Path(drm_path).exists():
        raise ConfigError(f"the diffusion reward model {drm_path!r} (reward.kwargs.path) is not trained yet; "
                          f"train it first with: diffalign train-reward {config_path}")
