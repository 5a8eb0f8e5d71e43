"""ShapesSoft: a differentiable stand-in for the ShapesEval verifier, for DRaFT / ReFL.

ShapesEval (:mod:`reward_models.shapes_eval`) segments an image into connected components and
judges them with thresholds: its value has no gradient. ShapesSoft scores two things that verifier
checks with smooth functions of the pixels, read from the prompt's parsed scene spec
(:func:`diffalign.shapes.world.parse_prompt`):

- **colour** (in [0, 1]): the share of the image's soft foreground mass whose colour is one the
  prompt names (any palette colour when it names none):

      fg(p)     = sigmoid((||p - background|| - FG_THRESHOLD) / FG_TEMPERATURE)   (ShapesEval's threshold)
      q_k(p)    = exp(-||p - c_k||^2 / (2 COLOR_SIGMA^2))                          (c_k a palette colour)
      colour    = sum_p fg(p) sum_{k named} q_k(p) / sum_p fg(p)

  ShapesEval's colour gates ask the same: the core of every object within ``COLOR_TOLERANCE`` of
  a palette colour (``COLOR_SIGMA`` is half of it), the named colours present.
- **mass** (in (0, 1]): how close the foreground mass ``m = sum_p fg(p)`` (in pixels at 32x32)
  is to the mass of the prompted objects, ``e = sum_objects count x fill(shape) x E[extent^2]``
  (fill: circle pi/4, square 1, triangle 1/2; extents uniform in the world's range):
  ``exp(-|log((m + 1) / (e + 1))|)``, i.e. the smaller ratio of the two. ShapesEval's exact counts
  and its stray-pixel and size gates fail images with too much or too little foreground.

The reward is ``(color_weight x colour + mass_weight x mass) / (color_weight + mass_weight)``.

What it does not see, and so what a policy can get away with (reward-hacking risks): shapes,
positions and counts beyond total area are not scored, so one blob of the right area and colour
scores as high as the right objects; with two named colours, swapping them ("a blue circle and a
red triangle" for "a red circle and a blue triangle") or painting both objects in one of them
scores the full colour term; faint pixels below the threshold cost almost nothing. The held-out
ShapesEval pass rate (the evaluation of every ShapesWorld run) is the check that the soft reward's
gains are real.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import torch

from diffalign.errors import RewardError
from diffalign.shapes import world
from diffalign.shapes.world import BACKGROUND, COLORS, PromptSpec, parse_prompt
from reward_models.base import check_images, register
from reward_models.shapes_eval import COLOR_TOLERANCE, FG_THRESHOLD

FG_TEMPERATURE = 0.05  # width of the soft foreground step: fg = 0.12 at 0.2 from the background, 0.88 at 0.4
COLOR_SIGMA = COLOR_TOLERANCE / 2  # q_k = exp(-2) = 0.14 at ShapesEval's tolerance from a palette colour
SHAPE_FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # area / extent^2 of the world's shapes
# E[extent^2] for extents uniform in [MIN, MAX] (pixels at 32x32): mean^2 + variance
MEAN_EXTENT_SQ = ((world.MIN_EXTENT_PX + world.MAX_EXTENT_PX) / 2) ** 2 + (world.MAX_EXTENT_PX - world.MIN_EXTENT_PX) ** 2 / 12
MASS_EPS = 1.0  # pixels added to both masses: an empty image against one object scores about 1 / 40, not 0

_PALETTE_NAMES = list(COLORS)


@lru_cache(maxsize=4096)
def _spec(prompt: str) -> PromptSpec:
    return parse_prompt(prompt)


def expected_mass(spec: PromptSpec) -> float:
    """Foreground pixels (at 32x32) the prompted objects cover on average."""
    return sum(o.count * SHAPE_FILL[o.shape] * MEAN_EXTENT_SQ for o in spec.objects)


def allowed_colors(spec: PromptSpec) -> torch.Tensor:
    """(K,) float mask of the palette colours the prompt names (all of them when it names none)."""
    named = {o.color for o in spec.objects if o.color}
    return torch.tensor([1.0 if (not named or name in named) else 0.0 for name in _PALETTE_NAMES])


def soft_terms(images: torch.Tensor, specs: Sequence[PromptSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """(colour (B,), mass (B,)) of images ``(B, 3, H, W)`` in [0, 1]; differentiable in the images."""
    x = images.to(torch.promote_types(images.dtype, torch.float32)).permute(0, 2, 3, 1)  # (B, H, W, 3); fp32 or fp64
    dev, dtype = x.device, x.dtype
    background = torch.tensor(BACKGROUND, device=dev, dtype=dtype)
    palette = torch.tensor([COLORS[c] for c in _PALETTE_NAMES], device=dev, dtype=dtype)  # (K, 3)
    dist_bg = (((x - background) ** 2).sum(-1) + 1e-8).sqrt()  # (B, H, W); the 1e-8 keeps sqrt's gradient finite at 0
    fg = torch.sigmoid((dist_bg - FG_THRESHOLD) / FG_TEMPERATURE)
    q = torch.exp(-((x[..., None, :] - palette) ** 2).sum(-1) / (2 * COLOR_SIGMA**2))  # (B, H, W, K)
    allowed = torch.stack([allowed_colors(s) for s in specs]).to(dev, dtype)  # (B, K)
    named = (q * allowed[:, None, None, :]).sum(-1)  # (B, H, W)
    mass = fg.sum(dim=(1, 2))
    colour = (fg * named).sum(dim=(1, 2)) / (mass + 1e-6)
    scale = world.scale_for(min(images.shape[-2:]))
    expected = torch.tensor([expected_mass(s) for s in specs], device=dev, dtype=dtype)
    mass_score = torch.exp(-torch.log((mass / scale**2 + MASS_EPS) / (expected + MASS_EPS)).abs())
    return colour, mass_score


@register("shapes_soft")
class ShapesSoft:
    """Differentiable ShapesWorld reward (see the module docstring): ``(images (B, 3, H, W) in
    [0, 1], prompts [B], metadata) -> float32 (B,)`` on the images' device, with a graph back to
    the images when they require grad. ``last_info``: ``soft/color`` and ``soft/mass`` (batch means)."""

    differentiable = True

    def __init__(self, color_weight: float = 1.0, mass_weight: float = 1.0, device: str | torch.device = "cpu"):
        for key, value in (("color_weight", color_weight), ("mass_weight", mass_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise RewardError(f"shapes_soft: {key} must be a number >= 0, got {value!r}")
        if color_weight + mass_weight <= 0:
            raise RewardError("shapes_soft: color_weight + mass_weight must be > 0")
        self.color_weight, self.mass_weight = float(color_weight), float(mass_weight)
        self.device = torch.device(device)  # computed where the images are; kept for the protocol
        self.last_info: dict[str, float] = {}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        check_images(images)
        if isinstance(prompts, str) or len(prompts) != images.shape[0]:
            got = "a single string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
            raise RewardError(f"shapes_soft: got {got} for {images.shape[0]} images; pass one prompt per image")
        colour, mass = soft_terms(images, [_spec(p) for p in prompts])  # PromptError names an unknown word
        reward = (self.color_weight * colour + self.mass_weight * mass) / (self.color_weight + self.mass_weight)
        if len(prompts):
            self.last_info = {"soft/color": float(colour.detach().mean()), "soft/mass": float(mass.detach().mean())}
        return reward
