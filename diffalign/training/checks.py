"""Checks a run passes before it trains: every name and file of its config (:func:`check_config`,
no model loads), its auxiliary judges trained (:func:`check_judges_trained`), and the on-policy
self-check: before the first update the training forward *is* the sampling policy, so every
log-ratio of a re-scored transition must be 0 (to a tolerance)."""

from __future__ import annotations

import math

import torch

import reward_models
from diffalign import distributed, recipes
from diffalign.adapters import FAMILIES, SOURCE_IMAGE_FAMILIES, model_family
from diffalign.errors import ConfigError, DiffalignError
from diffalign.prompts import resolve_probe_prompts, resolve_prompts
from diffalign.training.tracking import check_trackers


def check_config(cfg) -> None:
    """Every name and file of a run config that ``train`` resolves, checked without loading a
    model or building a reward (no weights): ``algorithm.name``, ``reward.name`` (and the rewards a
    method builds by name besides it, e.g. SPO's ``algorithm.spm``, and ``train.guard.verifier``), ``model.id`` /
    ``model.family``, ``log.trackers`` (known and installed) and the prompts (``prompts.file``
    readable, families known). One ConfigError naming the key. ``build_trainer`` calls it, and so
    does ``diffalign config``. A hub id is checked when it loads (naming its family needs the hub)."""
    recipes.check_algorithm_name(cfg.algorithm.name)
    named_rewards = [("reward.name", cfg.reward.name, cfg.reward.kwargs), *cfg.algorithm.named_rewards()]
    if cfg.train.guard.verifier:
        named_rewards.append(("train.guard.verifier", cfg.train.guard.verifier, cfg.train.guard.verifier_kwargs))
    for key, name, kwargs in named_rewards:
        try:
            reward_models.check_name(name, kwargs)
        except DiffalignError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None
    try:
        family = model_family(cfg.model.id, cfg.model.family)
    except DiffalignError as exc:
        key = "model.family" if cfg.model.family not in ("auto", *FAMILIES) else "model.id"
        raise ConfigError(f"config key '{key}': {exc}") from None
    if family in SOURCE_IMAGE_FAMILIES and not cfg.prompts.image_column:
        raise ConfigError(f"config key 'prompts.image_column': model family {family!r} edits a source image; give a prompt "
                          "file whose rows name one (docs/models.md, Editing)")
    check_context_parallel(cfg, family)
    check_trackers(cfg.log.trackers)
    resolve_prompts(cfg)
    resolve_probe_prompts(cfg)


def check_context_parallel(cfg, family: str | None) -> None:
    """``train.context_parallel`` > 1 needs a method whose trainer supports it and a family whose
    diffusers transformer has a context-parallel plan that trains (``family`` None: a hub id, checked
    again once it has loaded). One ConfigError naming the key."""
    degree = cfg.train.context_parallel
    if degree == 1:
        return
    if not recipes.trainer_class(cfg.algorithm.name).supports_context_parallel:
        raise ConfigError(f"config key 'train.context_parallel' {degree}: algorithm {cfg.algorithm.name!r} does not support "
                          "context parallelism (flow_grpo does)")
    problem = distributed.context_parallel_problem(family, degree) if family is not None else None
    if problem:
        raise ConfigError(problem)


def check_judges_trained(cfg, config_path: str) -> None:
    """A method whose auxiliary judge is trained by another command (SPO's step-aware preference
    model by ``train-spm``, Step-GRPO's DRM by ``train-reward``) and has not been trained yet: say
    which command trains it, instead of failing later on a missing folder or a Hub lookup."""
    message = cfg.algorithm.untrained_judge(cfg, config_path)
    if message:
        raise ConfigError(message)


class SelfCheckError(DiffalignError):
    """The on-policy ratio before any update was not 1: sampler and training forward disagree."""


def max_log_ratio(new_logp: torch.Tensor, old_logp: torch.Tensor) -> float:
    """``max |new_logp - old_logp|`` over all entries (fp32)."""
    return float((new_logp.float() - old_logp.float()).abs().max())


def check_on_policy(worst: float, tolerance: float, where: str, sampler: str = "sampler") -> None:
    """Raise :class:`SelfCheckError` when ``worst`` (a :func:`max_log_ratio`) is non-finite or
    above ``tolerance`` (``train.self_check_tolerance``)."""
    if not math.isfinite(worst) or worst > tolerance:
        raise SelfCheckError(
            f"on-policy self-check failed: |log ratio| = {worst:.3g} before any update (tolerance "
            f"{tolerance:g}) {where}; the training forward does not reproduce the {sampler} "
            "(check the adapter's predict, CFG batching and dtype), or raise train.self_check_tolerance"
        )
