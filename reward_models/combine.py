"""Weighted sum of rewards: ``r(x) = sum_i w_i * r_i(x)``.

Built from a list of component specs, e.g. in YAML::

    reward:
      name: weighted
      kwargs:
        components:
          - {name: clip_score, weight: 1.0, kwargs: {model: openai/clip-vit-large-patch14}}
          - {name: jpeg_compressibility, weight: 0.1}
          - {name: brightness, weight: 0.0, label: brightness_monitor}  # weight 0: logged only

Each component is built with ``reward_models.build`` and called on the same inputs. After each
call ``last_info`` holds ``"reward/<label>"``: the component's batch mean (unweighted), and each
of the component's own ``last_info`` entries as ``"reward/<label>/<key>"``. ``label`` defaults
to the component's name and must be unique. On videos ``(B, F, 3, H, W)`` every component is
called through :func:`~reward_models.base.call_reward`: image rewards give their mean over
frames, video rewards (``temporal_consistency``) see the whole videos. ``last_components`` holds
the last call's unweighted component rewards ``(B, K)`` (GDPO's advantages normalise each one
within its group: ``algorithm.advantage_aggregation: gdpo``, docs/gdpo.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import RewardFn, build, call_reward, check_reward_output, is_groupwise, register

_SPEC_KEYS = {"name", "weight", "kwargs", "label"}


@dataclass
class Component:
    label: str  # key under which the component is logged
    name: str  # registered name or dotted path, for error messages
    weight: float  # w_i
    reward: RewardFn


def _parse_spec(index: int, spec: Any) -> tuple[str, str, float, dict[str, Any]]:
    where = f"weighted: components[{index}]"
    if not isinstance(spec, dict):
        raise RewardError(f"{where}: expected a mapping with name/weight/kwargs, got {type(spec).__name__}")
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise RewardError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_SPEC_KEYS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise RewardError(f"{where}.name: expected a reward name, got {name!r}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise RewardError(f"{where}.weight: expected a finite number, got {weight!r}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RewardError(f"{where}.kwargs: expected a mapping, got {type(kwargs).__name__}")
    label = spec.get("label", name)
    if not isinstance(label, str) or not label:
        raise RewardError(f"{where}.label: expected a non-empty string, got {label!r}")
    return label, name, float(weight), dict(kwargs)


class WeightedSum:
    """Calls every component on the same batch and returns the weighted sum, float32 ``(B,)`` on CPU."""

    video = True  # takes videos as they are and applies the frame rule per component

    def __init__(self, components: Sequence[Component]) -> None:
        self.components = list(components)
        self.groupwise = any(is_groupwise(c.reward) for c in self.components)  # a pairwise component needs whole groups
        self.last_info: dict[str, float] = {}
        self.last_components: torch.Tensor | None = None  # (B, K) unweighted component rewards of the last call

    @property
    def weights(self) -> torch.Tensor:
        """(K,) the components' weights ``w_i``, in order."""
        return torch.tensor([c.weight for c in self.components], dtype=torch.float32)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        batch_size = images.shape[0]
        total = torch.zeros(batch_size, dtype=torch.float32)
        values = []
        info: dict[str, float] = {}
        for component in self.components:
            value = check_reward_output(component.name, call_reward(component.reward, images, prompts, metadata), batch_size)
            total += component.weight * value
            values.append(value.float())
            info[f"reward/{component.label}"] = value.mean().item() if batch_size else math.nan
            for key, extra in (getattr(component.reward, "last_info", None) or {}).items():
                info[f"reward/{component.label}/{key}"] = extra
        self.last_info = info
        self.last_components = torch.stack(values, dim=1)  # read by algorithm.advantage_aggregation: gdpo
        return total


@register("weighted")
def weighted(components: Sequence[dict[str, Any]], device: str | torch.device | None = None) -> WeightedSum:
    """Build a weighted sum from ``[{"name", "weight" (default 1), "kwargs" (default {}), "label"}, ...]``.

    ``device`` is passed to every component whose kwargs do not set their own.
    """
    if isinstance(components, (str, bytes, dict)) or not isinstance(components, Sequence) or not components:
        raise RewardError(f"weighted: components must be a non-empty list of component specs, got {components!r}")
    built: list[Component] = []
    for index, spec in enumerate(components):
        label, name, weight, kwargs = _parse_spec(index, spec)
        if any(c.label == label for c in built):
            raise RewardError(f"weighted: components[{index}].label: {label!r} is used twice; set distinct labels")
        if device is not None:
            kwargs.setdefault("device", device)
        try:
            reward = build(name, **kwargs)
        except RewardError as exc:
            raise RewardError(f"weighted: components[{index}] ({name}): {exc}") from None
        built.append(Component(label=label, name=name, weight=weight, reward=reward))
    return WeightedSum(built)
