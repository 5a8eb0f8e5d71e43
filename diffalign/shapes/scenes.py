"""Scenes of the shapes world: sampling one for a prompt, checking what it holds, rendering it.

The vocabulary, prompt grammar and splits are :mod:`diffalign.shapes.world`; the semantics a scene
must satisfy (exactly the named objects, GenEval's position rule on bounding-box centres) are
checked by :func:`requirements_met`, which the sampler and the verifier
(:mod:`reward_models.shapes_eval`) share.

Coordinates are pixels: ``x`` is the column, ``y`` the row, ``(0, 0)`` the top-left image corner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from diffalign.shapes.world import (
    BACKGROUND,
    BASE_SIZE,
    COLORS,
    EDGE_MARGIN_PX,
    MAX_EXTENT_PX,
    MIN_EXTENT_PX,
    MIN_GAP_PX,
    POSITION_ORTHO_MAX,
    POSITION_THRESHOLD,
    RELATIONS,
    SHAPES,
    SUPERSAMPLE,
    PromptError,
    PromptSpec,
    parse_prompt,
    scale_for,
)

__all__ = [
    "PlacedObject",
    "Scene",
    "SceneObject",
    "make_batch",
    "relation_holds",
    "render",
    "render_prompt",
    "requirements_met",
    "sample_scene",
]


@dataclass(frozen=True)
class PlacedObject:
    """A solid object: ``extent`` is the side of its axis-aligned bounding square, in pixels;
    ``(cx, cy)`` is that square's centre (for a triangle: base at ``cy + extent/2``, apex at the
    top, ``cy - extent/2``)."""

    shape: str
    color: str
    cx: float
    cy: float
    extent: float

    @property
    def width(self) -> float:
        return self.extent

    @property
    def height(self) -> float:
        return self.extent


Scene = list[PlacedObject]


class SceneObject(Protocol):
    """What :func:`requirements_met` needs of an object (placed or detected)."""

    shape: str
    color: str | None
    cx: float
    cy: float

    @property
    def width(self) -> float: ...

    @property
    def height(self) -> float: ...


def relation_holds(a: SceneObject, b: SceneObject, relation: str) -> bool:
    """GenEval's rule: is ``a`` <relation> ``b``, judged by bounding-box centres?

    The centre offset shrinks by ``POSITION_THRESHOLD`` x the summed extents on each axis; the
    relation holds when the shrunk offset's component along its axis, relative to the unshrunk
    offset's length, exceeds 0.5 (a cone of about +-60 degrees). Several relations can hold.
    """
    if relation not in RELATIONS:
        raise PromptError(f"unknown relation {relation!r}; expected one of {RELATIONS}")
    off = np.array([a.cx - b.cx, a.cy - b.cy], dtype=np.float64)
    dims = np.array([a.width + b.width, a.height + b.height], dtype=np.float64)
    norm = float(np.linalg.norm(off))
    if norm < 1e-6:
        return False
    revised = np.maximum(np.abs(off) - POSITION_THRESHOLD * dims, 0.0) * np.sign(off)
    dx, dy = revised / norm
    return {"left of": dx < -0.5, "right of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}[relation]


def requirements_met(objects: Sequence[SceneObject], spec: PromptSpec) -> dict[str, bool]:
    """The prompt's requirements, each named and judged on ``objects``; a scene satisfies the
    prompt iff all are True. Keys: ``count:<shape>`` (exact number of that shape),
    ``color:<colour> <shape>`` (that many of them in the colour), ``relation``, ``no_extra``
    (nothing besides the named objects)."""
    met: dict[str, bool] = {}
    for o in spec.objects:
        same_shape = [x for x in objects if x.shape == o.shape]
        met[f"count:{o.shape}"] = len(same_shape) == o.count
        if o.color is not None:
            met[f"color:{o.color} {o.shape}"] = sum(x.color == o.color for x in same_shape) == o.count
    if spec.relation is not None:
        a = [x for x in objects if x.shape == spec.objects[0].shape]
        b = [x for x in objects if x.shape == spec.objects[1].shape]
        met["relation"] = len(a) == 1 and len(b) == 1 and relation_holds(a[0], b[0], spec.relation)
    met["no_extra"] = len(objects) == spec.num_objects
    return met


def _random_extent(rng: np.random.Generator, scale: float) -> float:
    return float(rng.uniform(MIN_EXTENT_PX, MAX_EXTENT_PX)) * scale


def _random_centre(rng: np.random.Generator, extent: float, size: int, scale: float) -> tuple[float, float]:
    lo = EDGE_MARGIN_PX * scale + extent / 2
    hi = size - lo
    return float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))


def _separated(a: PlacedObject, b: PlacedObject, gap: float) -> bool:
    need = (a.extent + b.extent) / 2 + gap
    return abs(a.cx - b.cx) >= need or abs(a.cy - b.cy) >= need


def _sample_pair_with_relation(
    spec: PromptSpec, colors: list[str], rng: np.random.Generator, size: int, scale: float
) -> Scene:
    """Rejection-sample two objects whose centres differ clearly along the relation's axis."""
    a_spec, b_spec = spec.objects
    axis_sign = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}[spec.relation]
    axis, sign = axis_sign
    gap = MIN_GAP_PX * scale
    for _ in range(10_000):
        ea, eb = _random_extent(rng, scale), _random_extent(rng, scale)
        a = PlacedObject(a_spec.shape, colors[0], *_random_centre(rng, ea, size, scale), ea)
        b = PlacedObject(b_spec.shape, colors[1], *_random_centre(rng, eb, size, scale), eb)
        off = (a.cx - b.cx, a.cy - b.cy)
        along, across = sign * off[axis], abs(off[1 - axis])
        if along >= (ea + eb) / 2 + gap and across <= POSITION_ORTHO_MAX * along:
            return [a, b]
    raise RuntimeError(f"could not place {spec.text!r} in a {size}x{size} image")  # pragma: no cover


def sample_scene(spec: PromptSpec | str, rng: np.random.Generator, size: int = BASE_SIZE) -> Scene:
    """A random scene that satisfies ``spec``: exactly the named objects, random extents and
    positions, no overlaps. Colours that the prompt does not name are drawn uniformly."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if size < 16:
        raise ValueError(f"size must be at least 16 pixels, got {size}")
    scale = scale_for(size)
    palette = list(COLORS)
    shapes: list[str] = []
    colors: list[str] = []
    for o in spec.objects:
        for _ in range(o.count):
            shapes.append(o.shape)
            colors.append(o.color if o.color is not None else palette[int(rng.integers(len(palette)))])

    if spec.relation is not None:
        return _sample_pair_with_relation(spec, colors, rng, size, scale)

    gap = MIN_GAP_PX * scale
    for _ in range(1000):  # restart the whole scene when an object finds no free spot
        scene: Scene = []
        for shape, color in zip(shapes, colors):
            for _ in range(200):
                extent = _random_extent(rng, scale)
                obj = PlacedObject(shape, color, *_random_centre(rng, extent, size, scale), extent)
                if all(_separated(obj, other, gap) for other in scene):
                    scene.append(obj)
                    break
            else:
                break
        if len(scene) == len(shapes):
            order = rng.permutation(len(scene))  # no link between list order and position
            return [scene[int(i)] for i in order]
    raise RuntimeError(f"could not place {spec.text!r} in a {size}x{size} image")  # pragma: no cover


def _coverage(obj: PlacedObject, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Fraction of each pixel covered by ``obj``; ``xs``/``ys`` are sub-pixel sample grids of
    shape (rows, cols, SUPERSAMPLE**2)."""
    half = obj.extent / 2
    dx, dy = xs - obj.cx, ys - obj.cy
    if obj.shape == "circle":
        inside = dx * dx + dy * dy <= half * half
    elif obj.shape == "square":
        inside = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    elif obj.shape == "triangle":  # apex at the top; half-width grows linearly to `half` at the base
        depth = dy + half  # 0 at the apex row, extent at the base
        inside = (depth >= 0) & (depth <= obj.extent) & (np.abs(dx) <= depth / 2)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}; expected one of {SHAPES}")
    return inside.mean(axis=-1)


def render(scene: Sequence[PlacedObject], size: int = BASE_SIZE) -> np.ndarray:
    """Render a scene: float32 array (3, size, size) in [0, 1], anti-aliased by supersampling."""
    bg = np.asarray(BACKGROUND, dtype=np.float32)
    image = np.broadcast_to(bg[:, None, None], (3, size, size)).copy()
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    for obj in scene:
        if obj.color not in COLORS:
            raise ValueError(f"unknown colour {obj.color!r}; expected one of {tuple(COLORS)}")
        half = obj.extent / 2
        r0, r1 = max(int(np.floor(obj.cy - half)), 0), min(int(np.ceil(obj.cy + half)) + 1, size)
        c0, c1 = max(int(np.floor(obj.cx - half)), 0), min(int(np.ceil(obj.cx + half)) + 1, size)
        if r0 >= r1 or c0 >= c1:
            continue
        sub_y = (np.arange(r0, r1)[:, None] + offsets[None, :]).reshape(-1)
        sub_x = (np.arange(c0, c1)[:, None] + offsets[None, :]).reshape(-1)
        ys = sub_y.reshape(r1 - r0, 1, SUPERSAMPLE, 1)
        xs = sub_x.reshape(1, c1 - c0, 1, SUPERSAMPLE)
        ys, xs = np.broadcast_arrays(ys, xs)
        cov = _coverage(obj, xs.reshape(r1 - r0, c1 - c0, -1), ys.reshape(r1 - r0, c1 - c0, -1))
        color = np.asarray(COLORS[obj.color], dtype=np.float32)
        patch = image[:, r0:r1, c0:c1]
        image[:, r0:r1, c0:c1] = patch * (1 - cov[None]) + color[:, None, None] * cov[None]
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def render_prompt(text: str, rng: np.random.Generator, size: int = BASE_SIZE) -> np.ndarray:
    """Render a random ground-truth image (3, size, size) for one prompt."""
    return render(sample_scene(parse_prompt(text), rng, size), size)


def make_batch(prompts: Sequence[str], rng: np.random.Generator, size: int = BASE_SIZE) -> torch.Tensor:
    """Ground-truth images for ``prompts``: float32 tensor (B, 3, size, size) in [0, 1]."""
    if isinstance(prompts, str):
        raise TypeError("make_batch takes a list of prompts, not a single string")
    images = [render_prompt(p, rng, size) for p in prompts]
    if not images:
        return torch.zeros(0, 3, size, size, dtype=torch.float32)
    return torch.from_numpy(np.stack(images))
