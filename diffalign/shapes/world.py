"""A procedurally generated world of coloured shapes, with GenEval-style prompts.

This is diffalign's embedded default task: a tiny text-to-image model is pretrained on renders
of this world (:mod:`diffalign.shapes.model`) and RL-aligned against a verifiable reward
(:mod:`reward_models.shapes_eval`) that checks the same prompt semantics defined here.

The world
    Solid, axis-aligned circles, squares and upright triangles in six colours that sit 60 degrees
    apart on the hue wheel, on a black background (black keeps every colour far from the
    background and makes anti-aliased edges darker shades of the same hue, so segmentation by
    distance from the background is robust). Object extents are 7-11 px at 32x32 and scale with
    the image size; objects never overlap and keep a gap of at least 2 px (scaled).

Prompts (GenEval's six families; exact grammar, lower case)
    single_object  "a photo of a triangle"
    two_object     "a photo of a circle and a square"               (two different shapes)
    counting       "a photo of one circle" / "a photo of three circles"   (1-4)
    colors         "a photo of a red square"
    position       "a photo of a circle left of a square"            (left of, right of, above, below)
    color_attr     "a photo of a red circle and a blue triangle"     (different shapes and colours)

Semantics (what a scene must contain; shared by the sampler and the verifier)
    Exactly the named objects and nothing else: ``count`` objects of each named shape (any colour
    unless one is named), no extra objects. This is stricter than GenEval, which asks for at least
    one of each object in single/two-object prompts; exact counts close the reward-hacking hole of
    "at least one match" verifiers (which paid 36-46 % to noisy fragment images). Positions use
    GenEval's rule on bounding-box centres (:func:`relation_holds`).

Scenes (sampling a scene for a prompt, checking it, rendering it) are :mod:`diffalign.shapes.scenes`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from diffalign.errors import DiffalignError

__all__ = [
    "BACKGROUND",
    "COLORS",
    "FAMILIES",
    "HELDOUT_COUNTS",
    "IN_DISTRIBUTION_FAMILIES",
    "RELATIONS",
    "SHAPES",
    "VALIDATION_COUNTS",
    "ObjectSpec",
    "PromptError",
    "PromptSpec",
    "PromptSplit",
    "PROMPT_SETS",
    "all_prompts",
    "evaluation_prompts",
    "parse_prompt",
    "prompt_atoms",
    "prompt_family",
    "prompt_set",
    "scale_for",
    "split_prompts",
    "validation_split",
    "vocabulary",
]

# --------------------------------------------------------------------------------------------
# The world's constants
# --------------------------------------------------------------------------------------------

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

# Six hues 60 degrees apart, slightly desaturated so that no channel sits exactly at 0 or 1.
# The closest pairs (blue/purple 0.57, blue/cyan 0.60) are far further apart in RGB than
# sensor-like noise (std 0.05) or a blurred edge can bridge once a whole object is averaged.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "yellow": (0.95, 0.90, 0.10),
    "green": (0.10, 0.80, 0.15),
    "cyan": (0.10, 0.85, 0.90),
    "blue": (0.15, 0.25, 0.95),
    "purple": (0.70, 0.15, 0.85),
}

BACKGROUND: tuple[float, float, float] = (0.0, 0.0, 0.0)

FAMILIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

NUMBER_WORDS: tuple[str, ...] = ("one", "two", "three", "four")  # index + 1 = count
MAX_COUNT = len(NUMBER_WORDS)

BASE_SIZE = 32  # image side the pixel constants below refer to; they scale with size / BASE_SIZE
MIN_EXTENT_PX = 7.0  # object bounding-square side at 32x32: small enough that 4 fit, large
MAX_EXTENT_PX = 11.0  # enough that a 7 px triangle is still told apart from a circle
MIN_GAP_PX = 2.0  # gap between objects' bounding squares, keeps connected components separate
EDGE_MARGIN_PX = 1.0  # objects stay this far inside the image border
POSITION_THRESHOLD = 0.1  # GenEval: centre offsets shrink by 0.1 x (sum of extents) before the test
POSITION_ORTHO_MAX = 0.3  # sampled position scenes: |off-axis offset| <= 0.3 x on-axis offset
SUPERSAMPLE = 4  # sub-pixel samples per axis for anti-aliased coverage

_PROMPT_HEAD = ("a", "photo", "of")


class PromptError(DiffalignError, ValueError):
    """A prompt is outside the world's grammar (unknown word or wrong structure)."""


def scale_for(size: int) -> float:
    """Pixel constants are given for 32x32 images; multiply them by this for ``size``."""
    return size / BASE_SIZE


# --------------------------------------------------------------------------------------------
# Prompt specs and the grammar
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectSpec:
    """One object group a prompt asks for: ``count`` objects of ``shape`` (in ``color`` if set)."""

    shape: str
    color: str | None = None  # None: any colour
    count: int = 1


@dataclass(frozen=True)
class PromptSpec:
    """A parsed prompt: its normalised ``text``, ``family`` and what the image must contain.

    ``relation`` (position family only) holds between ``objects[0]`` and ``objects[1]``:
    "a circle left of a square" -> objects (circle, square), relation "left of".
    """

    text: str
    family: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    @property
    def num_objects(self) -> int:
        return sum(o.count for o in self.objects)


def vocabulary() -> list[str]:
    """Every word any prompt of the world can use, sorted (for building a tokenizer)."""
    words = set(_PROMPT_HEAD) | {"and"} | set(NUMBER_WORDS) | set(COLORS)
    words |= set(SHAPES) | {_plural(s) for s in SHAPES}
    for rel in RELATIONS:
        words |= set(rel.split())
    return sorted(words)


def _plural(shape: str) -> str:
    return shape + "s"


def _phrase(obj: ObjectSpec, counting: bool = False) -> str:
    if counting:
        noun = obj.shape if obj.count == 1 else _plural(obj.shape)
        return f"{NUMBER_WORDS[obj.count - 1]} {noun}"
    return f"a {obj.color} {obj.shape}" if obj.color else f"a {obj.shape}"


def _format(family: str, objects: Sequence[ObjectSpec], relation: str | None = None) -> str:
    head = " ".join(_PROMPT_HEAD)
    if family == "counting":
        return f"{head} {_phrase(objects[0], counting=True)}"
    if family in ("single_object", "colors"):
        return f"{head} {_phrase(objects[0])}"
    if family == "position":
        return f"{head} {_phrase(objects[0])} {relation} {_phrase(objects[1])}"
    return f"{head} {_phrase(objects[0])} and {_phrase(objects[1])}"  # two_object, color_attr


def _all_specs() -> list[PromptSpec]:
    specs: list[PromptSpec] = []

    def add(family: str, objects: tuple[ObjectSpec, ...], relation: str | None = None) -> None:
        specs.append(PromptSpec(_format(family, objects, relation), family, objects, relation))

    for shape in SHAPES:
        add("single_object", (ObjectSpec(shape),))
        for n in range(1, MAX_COUNT + 1):
            add("counting", (ObjectSpec(shape, count=n),))
        for color in COLORS:
            add("colors", (ObjectSpec(shape, color),))
    for a, b in itertools.permutations(SHAPES, 2):
        add("two_object", (ObjectSpec(a), ObjectSpec(b)))
        for rel in RELATIONS:
            add("position", (ObjectSpec(a), ObjectSpec(b)), rel)
        for ca, cb in itertools.permutations(COLORS, 2):
            add("color_attr", (ObjectSpec(a, ca), ObjectSpec(b, cb)))
    return specs


def all_prompts() -> list[str]:
    """Every prompt of the world, sorted (243 with 3 shapes and 6 colours)."""
    return sorted(s.text for s in _all_specs())


def _fail(text: str, why: str) -> PromptError:
    return PromptError(f"prompt {text!r} is outside the shapes grammar: {why}")


def _parse_phrase(text: str, tokens: list[str]) -> tuple[ObjectSpec, bool]:
    """Parse ``[a|<number>] [<colour>] <shape>`` -> (spec, used_number_word)."""
    if not tokens:
        raise _fail(text, "an object phrase is missing")
    det, rest = tokens[0], tokens[1:]
    if det == "a":
        count, numbered = 1, False
    elif det in NUMBER_WORDS:
        count, numbered = NUMBER_WORDS.index(det) + 1, True
    else:
        raise _fail(text, f"expected 'a' or a number word before an object, got {det!r}")
    color = None
    if rest and rest[0] in COLORS:
        color, rest = rest[0], rest[1:]
    if len(rest) != 1:
        raise _fail(text, f"expected one shape noun after {det!r}, got {' '.join(rest)!r}")
    noun = rest[0]
    want = SHAPES if count == 1 else tuple(_plural(s) for s in SHAPES)
    if noun not in want:
        raise _fail(text, f"{noun!r} does not agree with count {count} (use {'/'.join(want)})")
    shape = noun if count == 1 else noun[:-1]
    return ObjectSpec(shape, color, count), numbered


def parse_prompt(text: str) -> PromptSpec:
    """Parse a prompt of the world's grammar (case and extra spaces are normalised).

    Raises :class:`PromptError` (a ``ValueError``) naming the unknown word, or the structural
    problem, for anything outside the grammar.
    """
    if not isinstance(text, str):
        raise PromptError(f"prompt must be a string, got {type(text).__name__}")
    words = text.lower().split()
    known = set(vocabulary())
    for w in words:
        if w not in known:
            raise PromptError(f"unknown word {w!r} in prompt {text!r} (the shapes vocabulary is: {' '.join(sorted(known))})")
    if tuple(words[:3]) != _PROMPT_HEAD:
        raise _fail(text, "prompts start with 'a photo of'")
    body = words[3:]

    relation = None
    split_at = None
    if "and" in body:
        split_at, width = body.index("and"), 1
    else:
        for i in range(len(body)):
            for rel in RELATIONS:
                rel_words = rel.split()
                if body[i : i + len(rel_words)] == rel_words:
                    split_at, width, relation = i, len(rel_words), rel
                    break
            if split_at is not None:
                break

    if split_at is None:  # one object phrase: single_object, colors or counting
        obj, numbered = _parse_phrase(text, body)
        if numbered:
            if obj.color is not None:
                raise _fail(text, "counting prompts name no colour")
            family = "counting"
        else:
            family = "colors" if obj.color else "single_object"
        objects = (obj,)
    else:
        (a, num_a), (b, num_b) = _parse_phrase(text, body[:split_at]), _parse_phrase(text, body[split_at + width :])
        if num_a or num_b:
            raise _fail(text, "two-object prompts use 'a', not number words")
        if a.shape == b.shape:
            raise _fail(text, "the two objects must be different shapes")
        if relation is not None:
            if a.color or b.color:
                raise _fail(text, "position prompts name no colours")
            family = "position"
        elif a.color and b.color:
            if a.color == b.color:
                raise _fail(text, "the two objects must have different colours")
            family = "color_attr"
        elif a.color or b.color:
            raise _fail(text, "name a colour for both objects or for neither")
        else:
            family = "two_object"
        objects = (a, b)
    return PromptSpec(_format(family, objects, relation), family, objects, relation)


def prompt_family(text: str) -> str:
    """The GenEval family of a prompt (one of :data:`FAMILIES`)."""
    return parse_prompt(text).family


IN_DISTRIBUTION_FAMILIES: tuple[str, ...] = ("single_object", "two_object")
"""Families too small to split by prompt (3 and 6 prompts): every prompt trains, and evaluation
samples them on fresh noise seeds. Reports label them in-distribution."""

# Share of each larger family's prompts held out (after the probe's prompts are set aside). These
# give 96 evaluation images as whole multiples: counting 4 x 24, colors 6 x 16, position 8 x 12,
# colour attribution 32 x 3.
HELDOUT_COUNTS: dict[str, int] = {"counting": 4, "colors": 6, "position": 8, "color_attr": 32}


class PromptSplit(NamedTuple):
    """The world's prompts by role (each list sorted; the three are disjoint).

    ``train``: the only prompts that training (pretraining and RL) may use.
    ``heldout``: prompt texts that never occur in ``train``, from the families large enough to
    split; every shape, colour, count, relation and colour-shape pair they name occurs in ``train``
    prompts, so they measure whether training improved the model, not
    compositional generalisation.
    ``probe``: every prompt naming one of the held-out colour-shape pairs (the generalisation
    probe: those pairs never occur in ``train``); reported apart, never the headline.
    """

    train: list[str]
    heldout: list[str]
    probe: list[str]

    def evaluation(self) -> list[str]:
        """The headline evaluation prompts: ``heldout`` plus the ``train`` prompts of the
        :data:`IN_DISTRIBUTION_FAMILIES` (sampled on fresh seeds)."""
        in_dist = [p for p in self.train if prompt_family(p) in IN_DISTRIBUTION_FAMILIES]
        return sorted(self.heldout + in_dist)


def prompt_atoms(spec: PromptSpec | str) -> set[str]:
    """What a prompt asks the model to know: its shapes, colours, counts, relation and colour-shape
    pairs, as strings (``"shape:circle"``, ``"pair:red circle"``, ``"count:3"``, ...)."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    atoms = {f"relation:{spec.relation}"} if spec.relation else set()
    for o in spec.objects:
        atoms |= {f"shape:{o.shape}", f"count:{o.count}"}
        if o.color:
            atoms |= {f"color:{o.color}", f"pair:{o.color} {o.shape}"}
    return atoms


def split_prompts(seed: int = 0) -> PromptSplit:
    """The deterministic train / held-out / probe split of :func:`all_prompts` (see
    :class:`PromptSplit`).

    Three colour-shape pairs (one per shape, three different colours, chosen by ``seed``) are
    held out entirely: every prompt naming one goes to ``probe``. Of each remaining family,
    :data:`HELDOUT_COUNTS` prompts are held out, drawn at random until every atom of every
    held-out prompt (:func:`prompt_atoms`) also occurs in a training prompt (a held-out
    "a red square" needs the pair in some training prompt, e.g. a colour-attribution one).
    """
    rng = np.random.default_rng(seed)
    colors = list(COLORS)
    pair_colors = rng.permutation(len(colors))[: len(SHAPES)]
    held_pairs = {f"pair:{colors[int(c)]} {shape}" for c, shape in zip(pair_colors, SHAPES)}

    probe = [s.text for s in _all_specs() if prompt_atoms(s) & held_pairs]
    rest = {f: sorted(s.text for s in _all_specs() if s.family == f and s.text not in probe) for f in FAMILIES}
    for _ in range(10_000):
        heldout: list[str] = []
        for family, texts in rest.items():
            order = rng.permutation(len(texts))[: HELDOUT_COUNTS.get(family, 0)]
            heldout += [texts[int(i)] for i in order]
        train = [t for texts in rest.values() for t in texts if t not in heldout]
        known = set().union(*map(prompt_atoms, train))
        if all(prompt_atoms(t) <= known for t in heldout):
            break
    else:  # pragma: no cover - the counts above leave plenty of valid draws
        raise RuntimeError("no split keeps every held-out prompt's atoms in training")
    return PromptSplit(sorted(train), sorted(heldout), sorted(probe))


# Validation prompts carved from the training split for choosing hyperparameters (96 images per
# family as whole multiples: counting 2 x 48, colors 3 x 32, position 4 x 24, colour attribution 24 x 4).
VALIDATION_COUNTS: dict[str, int] = {"counting": 2, "colors": 3, "position": 4, "color_attr": 24}


def validation_split(split: PromptSplit, seed: int = 1) -> tuple[list[str], list[str]]:
    """``(fit, validation)``: the training prompts split again, for tuning hyperparameters without
    touching ``heldout`` or ``probe``. :data:`VALIDATION_COUNTS` prompts per family move to
    ``validation`` under the same rule as :func:`split_prompts` (every atom of a validation prompt
    occurs in ``fit``); the :data:`IN_DISTRIBUTION_FAMILIES` stay in ``fit`` and are validated on
    fresh seeds. Both lists sorted."""
    rng = np.random.default_rng(seed)
    by_family: dict[str, list[str]] = {}
    for p in split.train:
        by_family.setdefault(prompt_family(p), []).append(p)
    for _ in range(10_000):
        validation = [ps[int(i)] for f, ps in by_family.items() for i in rng.permutation(len(ps))[: VALIDATION_COUNTS.get(f, 0)]]
        fit = [p for p in split.train if p not in validation]
        known = set().union(*map(prompt_atoms, fit))
        if all(prompt_atoms(t) <= known for t in validation):
            break
    else:  # pragma: no cover
        raise RuntimeError("no validation split keeps every validation prompt's atoms in the fit prompts")
    in_dist = [p for p in fit if prompt_family(p) in IN_DISTRIBUTION_FAMILIES]
    return sorted(fit), sorted(validation + in_dist)


PROMPT_SETS: tuple[str, ...] = ("heldout", "validation", "train", "probe")


def prompt_set(name: str, split: PromptSplit | None = None) -> list[str]:
    """The distinct prompts of a named set of ``split`` (default :func:`split_prompts`): ``heldout``
    (the headline evaluation, :meth:`PromptSplit.evaluation`), ``validation`` (:func:`validation_split`),
    ``train`` or ``probe``."""
    if name not in PROMPT_SETS:
        raise PromptError(f"unknown {name!r} (prompt sets: {', '.join(PROMPT_SETS)})")
    split = split or split_prompts()
    if name == "heldout":
        return split.evaluation()
    if name == "validation":
        return validation_split(split)[1]
    return list(split.train if name == "train" else split.probe)


def evaluation_prompts(prompts: Sequence[str], images_per_family: int = 96) -> list[str]:
    """``prompts`` repeated round-robin within each family to ``images_per_family`` entries per
    family (families in :data:`FAMILIES` order, each family's prompts sorted). Sampled with one
    fixed seed, every entry gets its own noise; the same list and seed give every compared model
    the same images' noise."""
    if images_per_family < 1:
        raise ValueError(f"images_per_family must be >= 1, got {images_per_family}")
    by_family: dict[str, list[str]] = {}
    for p in sorted(set(prompts)):
        by_family.setdefault(prompt_family(p), []).append(p)
    out: list[str] = []
    for family in FAMILIES:
        ps = by_family.get(family, [])
        out += [ps[i % len(ps)] for i in range(images_per_family)] if ps else []
    return out
