"""Editing reward: does the edited image follow the instruction, and does it keep the source?

``edit_consistency`` scores an edit ``y`` of a source image ``s`` under instruction ``c`` as

    r(y; c, s) = w_i * r_instruction(y, c) + w_p * preservation(y, s)

- ``r_instruction``: any registered text-image reward on the edited image and the instruction
  (``instruction: {name, kwargs}``), e.g. ``clip_score`` or ``pickscore``; for ShapesWorld-style
  instructions phrased as the wanted result ("a photo of two red circles"), ``shapes_eval`` is an
  exact verifier of the edit.
- ``preservation`` in [0, 1] (1 = the source unchanged):
  ``pixel``: ``1 - mean |y - s|`` over pixels and channels (values in [0, 1]);
  ``clip``: the cosine similarity of CLIP image embeddings of ``y`` and ``s`` (``clip_model``).
  The source is resized (bilinear, antialiased) to the edited image's size first.

Preservation alone is maximised by returning the source (no edit), instruction-following alone by
ignoring it: the weights set the trade-off. The source image comes from each sample's metadata
(``source_image``: a path, or a ``(3, H, W)`` tensor in [0, 1]), which the trainer and the
evaluation fill from editing prompts (``prompts.image_column``). ``last_info`` holds the two
terms' batch means (``instruction``, ``preservation``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from diffalign.errors import RewardError
from diffalign.images import load_rgb, to_tensor
from reward_models.base import build, call_reward, check_images, check_reward_output, register

PRESERVATION_KINDS = ("pixel", "clip")
SOURCE_CACHE_SIZE = 256  # decoded source images kept between calls (a run revisits its prompts)


@register("edit_consistency")
class EditConsistency:
    """``w_i * r_instruction + w_p * preservation``; see the module docstring.

    Args:
        instruction: the instruction-following reward: a registered name or dotted path, or
            ``{name, kwargs}``; None only with ``instruction_weight: 0``.
        instruction_weight: ``w_i``.
        preservation_weight: ``w_p``.
        preservation: ``pixel`` or ``clip``.
        clip_model: the CLIP model (hub id or folder) of ``preservation: clip``.
        device: where the component rewards run.
    """

    def __init__(
        self,
        instruction: str | dict[str, Any] | None = None,
        instruction_weight: float = 1.0,
        preservation_weight: float = 1.0,
        preservation: str = "pixel",
        clip_model: Optional[str] = None,
        device: str | torch.device | None = None,
    ) -> None:
        for name, weight in (("instruction_weight", instruction_weight), ("preservation_weight", preservation_weight)):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise RewardError(f"edit_consistency: {name} must be a finite number, got {weight!r}")
        if preservation not in PRESERVATION_KINDS:
            raise RewardError(f"edit_consistency: preservation must be one of {', '.join(PRESERVATION_KINDS)}, got {preservation!r}")
        self.instruction_weight = float(instruction_weight)
        self.preservation_weight = float(preservation_weight)
        self.preservation = preservation
        self.instruction = None
        if instruction is not None:
            name, kwargs = (instruction, {}) if isinstance(instruction, str) else _spec(instruction)
            if device is not None:
                kwargs.setdefault("device", device)
            try:
                self.instruction = build(name, **kwargs)
            except RewardError as exc:
                raise RewardError(f"edit_consistency: instruction ({name}): {exc}") from None
            self.instruction_name = name
        elif self.instruction_weight != 0:
            raise RewardError("edit_consistency: instruction (a reward name or {name, kwargs}) is required unless instruction_weight is 0")
        self.clip = None
        if preservation == "clip":
            if not clip_model:
                raise RewardError("edit_consistency: preservation 'clip' needs clip_model (a CLIP hub id or folder)")
            self.clip = build("clip_score", model=clip_model, device=device)
        self._sources: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.last_info: dict[str, float] = {}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        check_images(images)
        batch = images.shape[0]
        sources = torch.stack([self.source(m, i, images.shape[-2:]) for i, m in enumerate(metadata)]) if batch else images
        keep = self.preservation_term(images.float().cpu(), sources)
        total = self.preservation_weight * keep
        info = {"preservation": keep.mean().item() if batch else math.nan}
        if self.instruction is not None:
            follow = check_reward_output(self.instruction_name, call_reward(self.instruction, images, prompts, metadata), batch)
            total = total + self.instruction_weight * follow
            info["instruction"] = follow.mean().item() if batch else math.nan
        self.last_info = info
        return total

    @torch.no_grad()
    def preservation_term(self, images: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """``(B,)`` in [0, 1] (clip: cosine in [-1, 1]) of edited images and sources ``(B, 3, H, W)``."""
        if self.clip is None:
            return 1.0 - (images - sources).abs().mean(dim=(1, 2, 3))
        edited, source = (self.clip.image_embeddings(self.clip.preprocess(x)) for x in (images, sources))
        return (edited * source).sum(dim=-1).float().cpu()  # unit-norm embeddings: the cosine

    def source(self, metadata: dict, index: int, size: Sequence[int]) -> torch.Tensor:
        """Sample ``index``'s source image ``(3, H, W)`` in [0, 1] at the edited image's ``size``."""
        source = metadata.get("source_image") if isinstance(metadata, dict) else None
        if source is None:
            raise RewardError(f"edit_consistency: sample {index} has no source_image in its metadata "
                              "(editing prompts from prompts.image_column carry one)")
        if isinstance(source, torch.Tensor):
            return _resized(source.float().cpu(), size)
        key = (str(source), tuple(size))
        if key not in self._sources:
            try:
                pixels = to_tensor(load_rgb(source))
            except Exception as exc:  # PIL raises several error types for unreadable files
                raise RewardError(f"edit_consistency: cannot read source image {str(source)!r} ({type(exc).__name__}: {exc})") from None
            self._sources[key] = _resized(pixels, size)
            if len(self._sources) > SOURCE_CACHE_SIZE:
                self._sources.popitem(last=False)
        return self._sources[key]


def _spec(spec: Any) -> tuple[str, dict]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or set(spec) - {"name", "kwargs"}:
        raise RewardError(f"edit_consistency: instruction must be a reward name or {{name, kwargs}}, got {spec!r}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RewardError(f"edit_consistency: instruction.kwargs must be a mapping, got {type(kwargs).__name__}")
    return spec["name"], dict(kwargs)


def _resized(image: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``(3, h, w)`` -> ``(3, H, W)`` (bilinear, antialiased) when the sizes differ."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True, align_corners=False)[0].clamp(0, 1)
