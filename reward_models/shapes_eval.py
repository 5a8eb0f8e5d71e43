"""ShapesEval: a GenEval-style verifier for the coloured-shapes world, without learned weights.

Each image is read with classical vision and checked against the prompt's requirements as
defined by :func:`diffalign.shapes.scenes.requirements_met`:

1. Foreground: pixels whose RGB distance from the background exceeds ``FG_THRESHOLD``.
2. Connected components (8-connected). Components smaller than ``MIN_OBJECT_AREA_PX`` are
   *stray pixels*; more than ``STRAY_FRACTION`` of the image in stray pixels fails the image.
3. Each remaining component must be explained as an object of the world, else the image fails:
   - colour: the median of its brightest pixels lies within ``COLOR_TOLERANCE`` of a palette
     colour and at least ``COLOR_PURITY`` of those pixels are nearest to that colour;
   - size: its extent lies in the world's range, widened by ``EXTENT_SLACK``;
   - shape, from soft (anti-aliasing aware) coverage: the skew of the mass per row is about -0.57
     for an upright triangle and 0 for circles and squares; fill = area / (widest row x tallest
     column) then tells a circle (pi/4) from a square (1) and checks a triangle (1/2).
4. The detected objects are checked like GenEval: exact counts of each named shape, the named
   colours, the relation of bounding-box centres (GenEval's rule) and no extra objects.

Decisions (documented because GenEval differs): single- and two-object prompts require exactly
the named objects (GenEval accepts >= 1 of each and ignores extras). The strict reading, plus
the stray-pixel and unexplained-component gates, is the reward-hacking guard: a verifier that
accepted "at least one matching object" paid 36-46 % to noisy fragment images.

``partial_credit=True`` returns the fraction of requirements met (denser signal for RL), but an
image that fails a gate (stray pixels, unexplained components) still gets 0. With partial credit
an image that draws both objects of "a red circle and a blue square" in one colour meets 4 of 5
requirements and scores 0.8, one with the colours swapped 0.6: a policy can raise the reward by
trading swaps for one-colour images without passing more often. ``pass_weight=w`` (with
``partial_credit=True``) returns ``(1 - w) * fraction + w * passed`` instead: the dense signal, with
a step of ``w`` between "almost" and "right"; ``w = 1`` is pass/fail, ``w = 0`` plain partial credit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from diffalign.errors import RewardError
from diffalign.shapes import world
from diffalign.shapes.scenes import requirements_met
from diffalign.shapes.world import BACKGROUND, COLORS, FAMILIES, PromptSpec, parse_prompt
from reward_models.base import check_images, register

# Thresholds. Pixel quantities are for 32x32 images and scale with the image side (areas with
# its square); colour distances are Euclidean in RGB with channels in [0, 1].
FG_THRESHOLD = 0.3  # background pixels under noise std 0.05 sit ~0.09 away; palette colours >= 0.9
MIN_OBJECT_AREA_PX = 10.0  # the smallest object (a 7 px triangle) covers ~25 px; fragments below are stray
STRAY_FRACTION = 0.01  # at most 1 % of the image (10 px at 32x32) in stray fragments
CORE_FRACTION = 0.7  # colour is read from pixels at least 0.7 x as far from the background as the brightest
COLOR_TOLERANCE = 0.3  # about half the distance between the closest palette colours (~0.6)
COLOR_PURITY = 0.75  # share of core pixels that must be nearest to the object's colour
EXTENT_SLACK = (0.6, 1.5)  # accept extents in [0.6 x 7, 1.5 x 11] px: blur and model outputs vary
ASPECT_MAX = 1.4  # world objects have a square bounding box; elongated blobs are unexplained
COVERAGE_DEADZONE = 0.1  # coverage below 0.1 counts as none (clipped noise biases it upwards)
SKEW_TRIANGLE_MAX = -0.3  # skew of the mass per row: upright triangle about -0.57 ...
SKEW_SYMMETRIC_MAX = 0.25  # ... circle and square 0
FILL_TRIANGLE = (0.4, 0.78)  # ideal 0.5; rows and columns on pixel edges raise it
FILL_SYMMETRIC = (0.65, 1.08)  # circle ideal pi/4 = 0.785, square 1.0
FILL_CIRCLE_MAX = 0.885  # between the two: noisy circles reach ~0.85, noisy squares ~0.92

_STRUCTURE_8 = np.ones((3, 3), dtype=bool)
_PALETTE_NAMES = list(COLORS)
_PALETTE = np.asarray([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float64)  # (K, 3)
_BG = np.asarray(BACKGROUND, dtype=np.float64)


@dataclass(frozen=True)
class DetectedObject:
    """A component read as an object; ``(cx, cy)`` is its bounding-box centre in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    width: float
    height: float
    area: float  # soft coverage, in pixels
    fill: float  # area / (widest row x tallest column)
    skew: float  # skewness of the mass per row: < 0 when the bottom is heavier


@lru_cache(maxsize=4096)
def _spec(prompt: str) -> PromptSpec:
    return parse_prompt(prompt)


def _describe_component(
    image: np.ndarray, mask: np.ndarray, region: np.ndarray, dist_bg: np.ndarray, scale: float
) -> tuple[DetectedObject | None, str]:
    """Read one component; returns (object, "") or (None, why it is unexplained).

    ``image`` (H, W, 3), ``mask`` the component's pixels, ``region`` the component grown by one
    pixel (to collect its anti-aliased rim), ``dist_bg`` each pixel's distance from the background.
    """
    rows, cols = np.nonzero(mask)
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    width, height = float(c1 - c0), float(r1 - r0)
    cx, cy = (c0 + c1) / 2, (r0 + r1) / 2

    # Colour: median of the brightest pixels, then nearest palette entry.
    d = dist_bg[mask]
    core = image[mask][d >= CORE_FRACTION * d.max()]
    median = np.median(core, axis=0)
    dists = np.linalg.norm(_PALETTE - median, axis=1)
    k = int(dists.argmin())
    if dists[k] > COLOR_TOLERANCE:
        return None, f"colour {np.round(median, 2).tolist()} at ({cx:.0f},{cy:.0f}) is not in the palette"
    nearest = np.linalg.norm(core[:, None, :] - _PALETTE[None], axis=2).argmin(axis=1)
    purity = float((nearest == k).mean())
    if purity < COLOR_PURITY:
        return None, f"mixed colours at ({cx:.0f},{cy:.0f}) (purity {purity:.2f})"
    color = _PALETTE_NAMES[k]

    lo, hi = EXTENT_SLACK[0] * world.MIN_EXTENT_PX * scale, EXTENT_SLACK[1] * world.MAX_EXTENT_PX * scale
    if not (lo <= max(width, height) <= hi):
        return None, f"blob of {width:.0f}x{height:.0f} px at ({cx:.0f},{cy:.0f}) is outside the object size range"
    if max(width, height) > ASPECT_MAX * min(width, height):
        return None, f"elongated blob of {width:.0f}x{height:.0f} px at ({cx:.0f},{cy:.0f})"

    # Soft coverage: projection of (pixel - background) onto (colour - background), in [0, 1].
    direction = _PALETTE[k] - _BG
    # A dead zone drops the faint positive bias that clipped noise leaves around the object.
    proj = (image - _BG) @ direction / float(direction @ direction)
    cov = np.clip((proj - COVERAGE_DEADZONE) / (1.0 - 2 * COVERAGE_DEADZONE), 0.0, 1.0) * region
    area = float(cov.sum())
    soft_w, soft_h = float(cov.sum(axis=1).max()), float(cov.sum(axis=0).max())
    fill = area / max(soft_w * soft_h, 1e-6)
    profile = cov.sum(axis=1)  # mass per row
    y = np.arange(profile.size, dtype=np.float64)
    mean = float((profile * y).sum() / area)
    var = float((profile * (y - mean) ** 2).sum() / area)
    skew = float((profile * (y - mean) ** 3).sum() / area) / max(var, 1e-6) ** 1.5

    where = f"blob at ({cx:.0f},{cy:.0f}) with fill {fill:.2f}, skew {skew:.2f}"
    if skew <= SKEW_TRIANGLE_MAX:  # bottom-heavy: an upright triangle or nothing
        if not (FILL_TRIANGLE[0] <= fill <= FILL_TRIANGLE[1]):
            return None, f"{where} is bottom-heavy but no triangle"
        shape = "triangle"
    elif abs(skew) <= SKEW_SYMMETRIC_MAX:
        if not (FILL_SYMMETRIC[0] <= fill <= FILL_SYMMETRIC[1]):
            return None, f"{where} is neither circle nor square"
        shape = "circle" if fill <= FILL_CIRCLE_MAX else "square"
    else:
        return None, f"{where} is lopsided"
    return DetectedObject(shape, color, cx, cy, width, height, area, fill, skew), ""


def detect_objects(image: np.ndarray) -> dict:
    """Segment one image (3, H, W) in [0, 1] into world objects.

    Returns ``{"objects": [DetectedObject], "unexplained": [str], "stray_pixels": int}``.
    """
    from scipy import ndimage  # lazy: only this reward needs scipy

    hwc = np.ascontiguousarray(np.transpose(image, (1, 2, 0)), dtype=np.float64)
    size = min(hwc.shape[:2])
    scale = world.scale_for(size)
    dist_bg = np.linalg.norm(hwc - _BG, axis=2)
    labels, n = ndimage.label(dist_bg > FG_THRESHOLD, structure=_STRUCTURE_8)
    objects: list[DetectedObject] = []
    unexplained: list[str] = []
    stray = 0
    if n:
        areas = np.bincount(labels.ravel(), minlength=n + 1)
        grown = ndimage.grey_dilation(labels, footprint=_STRUCTURE_8)  # rim pixels take a neighbour's label
        min_area = MIN_OBJECT_AREA_PX * scale**2
        for lab in range(1, n + 1):
            if areas[lab] < min_area:
                stray += int(areas[lab])
                continue
            mask = labels == lab
            region = ((grown == lab) & (labels == 0)) | mask
            obj, why = _describe_component(hwc, mask, region, dist_bg, scale)
            if obj is None:
                unexplained.append(why)
            else:
                objects.append(obj)
    return {"objects": objects, "unexplained": unexplained, "stray_pixels": stray}


def _judge(found: dict, spec: PromptSpec, image_pixels: int) -> tuple[bool, float, dict[str, bool], str]:
    """(passed, partial score, requirements, reason) for one image's detections."""
    if found["stray_pixels"] > STRAY_FRACTION * image_pixels:
        return False, 0.0, {}, f"{found['stray_pixels']} stray foreground pixels"
    if found["unexplained"]:
        return False, 0.0, {}, "unexplained: " + "; ".join(found["unexplained"])
    met = requirements_met(found["objects"], spec)
    failed = [k for k, ok in met.items() if not ok]
    score = float(np.mean(list(met.values())))
    return not failed, score, met, ("ok" if not failed else "failed " + ", ".join(failed))


@register("shapes_eval")
class ShapesEval:
    """Verifiable reward for the shapes world: 1 if the image shows exactly what the prompt asks
    for, else 0 (or the fraction of requirements met with ``partial_credit=True``, mixed with
    pass/fail by ``pass_weight``; see the module docstring).

    Call: ``(images (B, 3, H, W) in [0, 1], prompts [B], metadata [B] | None) -> float32 (B,)`` on
    the CPU. After each call ``last_info`` holds ``acc/<family>`` (share of images that pass, for
    the families present), ``acc/overall`` (their mean, as GenEval's overall score) and
    ``acc/images`` (the share of all images that pass).
    """

    def __init__(self, partial_credit: bool = False, size: int | None = None, device: str | torch.device = "cpu",
                 pass_weight: float = 0.0):
        self.partial_credit = bool(partial_credit)
        if isinstance(pass_weight, bool) or not isinstance(pass_weight, (int, float)) or not 0.0 <= pass_weight <= 1.0:
            raise RewardError(f"shapes_eval: pass_weight must be a number in [0, 1], got {pass_weight!r}")
        if pass_weight and not self.partial_credit:
            raise RewardError("shapes_eval: pass_weight mixes partial credit with pass/fail; it needs partial_credit=true")
        self.pass_weight = float(pass_weight)
        self.size = size  # if set, images must be size x size
        self.device = torch.device(device)  # classical vision on the CPU; kept for the protocol
        self.last_info: dict[str, float] = {}

    def _check_inputs(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        check_images(images)
        if isinstance(prompts, str) or len(prompts) != images.shape[0]:
            got = "a single string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
            raise RewardError(f"shapes_eval: got {got} for {images.shape[0]} images; pass one prompt per image")
        if self.size is not None and tuple(images.shape[-2:]) != (self.size, self.size):
            raise RewardError(f"shapes_eval: expected {self.size}x{self.size} images, got {tuple(images.shape[-2:])}")
        if min(images.shape[-2:]) < 16:
            raise RewardError(f"shapes_eval: images must be at least 16x16, got {tuple(images.shape[-2:])}")
        return images.detach().to("cpu", torch.float32).clamp(0.0, 1.0).numpy()

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> list[dict]:
        """Per-image details: ``prompt``, ``family``, ``passed``, ``score`` (partial credit),
        ``reason``, ``requirements`` (name -> met), ``objects`` (detected, as dicts),
        ``unexplained`` and ``stray_pixels``."""
        arrays = self._check_inputs(images, prompts)
        specs = [_spec(p) for p in prompts]  # PromptError (a ValueError) names an unknown word
        results = []
        for array, prompt, spec in zip(arrays, prompts, specs):
            found = detect_objects(array)
            passed, score, met, reason = _judge(found, spec, array.shape[1] * array.shape[2])
            results.append(
                {
                    "prompt": prompt,
                    "family": spec.family,
                    "passed": passed,
                    "score": score,
                    "reason": reason,
                    "requirements": met,
                    "objects": [asdict(o) for o in found["objects"]],
                    "unexplained": found["unexplained"],
                    "stray_pixels": found["stray_pixels"],
                }
            )
        return results

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> torch.Tensor:
        if metadata is not None and len(metadata) != len(prompts):
            raise RewardError(f"shapes_eval: got {len(metadata)} metadata dicts for {len(prompts)} prompts")
        results = self.evaluate(images, prompts)
        if self.partial_credit:
            w = self.pass_weight
            values = [(1.0 - w) * r["score"] + w * float(r["passed"]) for r in results]
        else:
            values = [float(r["passed"]) for r in results]
        rewards = torch.tensor(values, dtype=torch.float32)
        info: dict[str, float] = {}
        for family in FAMILIES:
            passed = [r["passed"] for r in results if r["family"] == family]
            if passed:
                info[f"acc/{family}"] = float(np.mean(passed))
        if results:
            # GenEval's "overall" is the mean of the task-family accuracies (families weigh the
            # same however many prompts each has); the per-image pass rate is kept as acc/images.
            info["acc/overall"] = float(np.mean([v for k, v in info.items()]))
            info["acc/images"] = float(np.mean([r["passed"] for r in results]))
        self.last_info = info
        return rewards
