"""Reward models: a protocol, a registry, and the built-in rewards.

``reward_models.build(name, **kwargs)`` returns a callable
``(images (B,3,H,W) in [0,1], prompts, metadata) -> Tensor(B,)``; :func:`call_reward` applies it
to videos ``(B,F,3,H,W)`` as the mean over frames (see :mod:`reward_models.base`).
"""

from reward_models.base import (
    RewardFn, available, build, call_reward, check_images, check_reward_output, is_video_reward, register,
)

__all__ = ["RewardFn", "available", "build", "call_reward", "check_images", "check_reward_output", "is_video_reward", "register"]

# Built-in rewards register themselves on import; each module keeps heavy imports lazy.
from reward_models import builtin as _builtin  # noqa: E402,F401
