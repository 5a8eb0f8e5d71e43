"""The reward protocol and registry.

A reward is any callable ``reward(images, prompts, metadata) -> Tensor[B]`` where

- ``images``: float tensor ``(B, 3, H, W)`` with values in ``[0, 1]`` (any device / dtype),
- ``prompts``: list of ``B`` strings,
- ``metadata``: list of ``B`` dicts (per-sample extra information; may be empty dicts),

and the result is a float32 tensor of shape ``(B,)`` on the CPU or the images' device.
Rewards may additionally expose ``last_info: dict[str, float]`` after each call (extra
scalars to log, e.g. per-component values or per-family accuracy).

**Videos** (video models such as Wan decode to ``(B, F, 3, H, W)``, frames second) follow one
rule, applied by :func:`call_reward` wherever the trainer and the evaluation score samples: an
image reward scores every frame with the video's prompt and metadata, and the video's reward is
the **mean over its F frames**. A reward that judges a video as a whole (motion, consistency)
sets the class attribute ``video = True`` and receives the ``(B, F, 3, H, W)`` tensor unchanged.

**Groups**: during training each image's metadata holds ``"group"``, the id of its prompt group
(the images sampled together for one prompt, whose rewards the advantages compare). A reward that
compares the images of a group sets ``groupwise = True`` (:func:`is_groupwise`) and then receives
whole groups.

**Differentiable rewards** (what DRaFT / ReFL train through, ``docs/drft.md``) set the attribute
``differentiable = True``: called on images that require grad, they return rewards with a graph
back to the images (no ``no_grad``, no NumPy, no rounding on the way); called on plain images they
build no graph. A reward without the attribute is taken as not differentiable.

Rewards are found by name in an explicit registry (``@register("name")``) or by dotted path
(``"package.module:factory"`` or ``"package.module.factory"``). Heavy dependencies are imported
lazily inside the factories; every factory takes a ``device`` keyword instead of calling
``.cuda()``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from diffalign.errors import RewardError


@runtime_checkable
class RewardFn(Protocol):
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]
    ) -> torch.Tensor: ...


_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Class / factory decorator: ``@register("jpeg_compressibility")``."""

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"reward name {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def registered(name: str) -> Optional[Callable[..., RewardFn]]:
    """The factory registered under ``name`` (a class or function), or None; builds nothing."""
    _import_builtin()
    return _REGISTRY.get(name)


def available() -> list[str]:
    """Sorted names of all registered rewards."""
    _import_builtin()
    return sorted(_REGISTRY)


def _import_builtin() -> None:
    # Importing the package registers the built-in rewards (cheap: heavy deps are lazy).
    importlib.import_module("reward_models")


def _resolve_dotted(name: str) -> Callable[..., RewardFn]:
    module_name, _, attr = name.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RewardError(f"reward {name!r} cannot be imported: {exc}") from None


def build(name: str, **kwargs: Any) -> RewardFn:
    """Build a reward by registered name or dotted path; ``kwargs`` go to its factory."""
    _import_builtin()
    if name in _REGISTRY:
        factory = _REGISTRY[name]
    elif "." in name or ":" in name:
        factory = _resolve_dotted(name)
    else:
        raise RewardError(f"unknown reward {name!r}; known rewards: {', '.join(available())}")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise RewardError(f"reward {name!r}: bad arguments {sorted(kwargs)}: {exc}") from None


def is_video_reward(reward) -> bool:
    """Whether ``reward`` takes whole videos ``(B, F, 3, H, W)`` (attribute ``video = True``)."""
    return bool(getattr(reward, "video", False))


def is_groupwise(reward) -> bool:
    """Whether ``reward`` compares the images of a prompt group with each other (attribute
    ``groupwise = True``, e.g. ``pairwise``): it reads each image's group from ``metadata["group"]``
    and must receive whole groups, which the trainer's reward pool guarantees."""
    return bool(getattr(reward, "groupwise", False))


def is_differentiable(reward) -> bool:
    """Whether ``reward`` declares a gradient with respect to its images (``differentiable = True``)."""
    return bool(getattr(reward, "differentiable", False))


def call_reward(reward: RewardFn, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
    """``reward(images, prompts, metadata)`` with the video rule of the module docstring: for
    videos ``(B, F, 3, H, W)`` and an image reward, the mean of the per-frame rewards ``(B,)``.
    The per-frame ``last_info`` (if any) stays on the reward as it set it."""
    if images.ndim != 5 or is_video_reward(reward):
        return reward(images, prompts, metadata)
    b, f = images.shape[:2]
    frame_prompts = [p for p in prompts for _ in range(f)]  # video-major: frames of video 0, then video 1, ...
    frame_metadata = [m for m in metadata for _ in range(f)]
    value = reward(images.flatten(0, 1), frame_prompts, frame_metadata)
    if not isinstance(value, torch.Tensor) or value.shape != (b * f,):
        return value  # check_reward_output reports the wrong type / shape
    return value.float().view(b, f).mean(dim=1)


def check_reward_output(name: str, value: Any, batch_size: int) -> torch.Tensor:
    """Validate a reward's return value: a tensor of shape (B,). Non-finite values are allowed
    here (the trainer counts and masks them); a wrong type or shape is a RewardError."""
    if not isinstance(value, torch.Tensor):
        raise RewardError(f"reward {name!r} returned {type(value).__name__}, expected a tensor of shape ({batch_size},)")
    if value.shape != (batch_size,):
        raise RewardError(f"reward {name!r} returned shape {tuple(value.shape)}, expected ({batch_size},)")
    return value.detach().float().cpu()


def check_images(images: torch.Tensor, name: str = "images") -> None:
    """Raise a clear ValueError when images are not (B, 3, H, W) in [0, 1]."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise RewardError(f"{name}: expected a float tensor (B, 3, H, W), got {shape}")
    if images.numel() and (images.min() < -1e-3 or images.max() > 1 + 1e-3):
        raise RewardError(
            f"{name}: values must lie in [0, 1], got [{images.min().item():.3f}, {images.max().item():.3f}]"
        )
