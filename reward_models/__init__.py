"""Reward models: a protocol, a registry, and the built-in rewards.

``reward_models.build(name, **kwargs)`` returns a callable
``(images (B,3,H,W) in [0,1], prompts, metadata) -> Tensor(B,)``; :func:`call_reward` applies it
to videos ``(B,F,3,H,W)`` as the mean over frames (see :mod:`reward_models.base`).
:func:`check_name` checks a name the way :func:`build` resolves it, without building anything.
"""

from typing import Any, Optional

from reward_models.base import (
    RewardFn, available, build, call_reward, check_images, check_reward_output, is_differentiable, is_groupwise,
    is_video_reward, register,
)
from diffalign.errors import RewardError, close_match

__all__ = ["RewardFn", "available", "build", "call_reward", "check_images", "check_name", "check_reward_output",
           "is_differentiable", "is_groupwise", "is_video_reward", "register"]

# Built-in rewards register themselves on import; each module keeps heavy imports lazy.
from reward_models import builtin as _builtin  # noqa: E402,F401


def check_name(name: str, kwargs: Optional[dict[str, Any]] = None) -> None:
    """Raise the RewardError :func:`build` raises for a name it cannot resolve, with the closest
    known name, but build nothing (no weights load): a registered name, or a dotted path whose
    module imports and holds the factory; for ``weighted``, the name of each of its components."""
    from reward_models import base

    if base.registered(name) is None:
        if "." not in name and ":" not in name:
            raise RewardError(f"unknown reward {name!r}{close_match(name, available())}; known rewards: {', '.join(available())}")
        base._resolve_dotted(name)
    if name == "pairwise":
        from reward_models.pairwise import check_judge_name

        check_judge_name((kwargs or {}).get("judge"))
    if name == "weighted":
        components = (kwargs or {}).get("components")
        for index, spec in enumerate(components if isinstance(components, list) else []):  # malformed: build() says how
            if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                try:
                    check_name(spec["name"], spec.get("kwargs"))
                except RewardError as exc:  # named as reward_models.combine names a component
                    raise RewardError(f"weighted: components[{index}]: {exc}") from None
