"""The shapes world: grammar, split, scene sampler and renderer."""

from collections import Counter

import numpy as np
import pytest
import torch

from diffalign.shapes import world
from diffalign.shapes.scenes import make_batch, relation_holds, render, render_prompt, requirements_met, sample_scene
from diffalign.shapes.world import (
    BACKGROUND,
    COLORS,
    FAMILIES,
    HELDOUT_COUNTS,
    IN_DISTRIBUTION_FAMILIES,
    RELATIONS,
    SHAPES,
    VALIDATION_COUNTS,
    PromptError,
    all_prompts,
    evaluation_prompts,
    parse_prompt,
    prompt_atoms,
    prompt_family,
    split_prompts,
    validation_split,
    vocabulary,
)

EXAMPLES = {
    "a photo of a triangle": "single_object",
    "a photo of a circle and a square": "two_object",
    "a photo of three circles": "counting",
    "a photo of one circle": "counting",
    "a photo of a red square": "colors",
    "a photo of a circle left of a square": "position",
    "a photo of a triangle below a circle": "position",
    "a photo of a red circle and a blue triangle": "color_attr",
}


def test_examples_parse_to_their_family():
    for text, family in EXAMPLES.items():
        spec = parse_prompt(text)
        assert spec.family == family and prompt_family(text) == family
        assert spec.text == text
    spec = parse_prompt("a photo of a circle left of a square")
    assert [o.shape for o in spec.objects] == ["circle", "square"] and spec.relation == "left of"
    assert parse_prompt("a photo of three circles").objects[0].count == 3
    assert parse_prompt("  A photo of a  RED square ").text == "a photo of a red square"


def test_all_prompts_round_trip_and_cover_families():
    prompts = all_prompts()
    assert prompts == sorted(set(prompts))
    fams = Counter(parse_prompt(p).family for p in prompts)
    assert set(fams) == set(FAMILIES)
    assert fams["counting"] == len(SHAPES) * 4
    for p in prompts:
        assert parse_prompt(p).text == p
    words = {w for p in prompts for w in p.split()}
    assert words == set(vocabulary())


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("a photo of a dog", "'dog'"),
        ("a photo of a circle next to a square", "'next'"),
        ("a photo of a pink circle", "'pink'"),
        ("a photo of a circle.", "'circle.'"),
        ("a photo of two circle", "agree"),
        ("a photo of a circles", "agree"),
        ("a photo of three red circles", "colour"),
        ("a photo of a red circle and a square", "colour"),
        ("a photo of a circle and a circle", "different shapes"),
        ("a photo of a red circle and a red square", "different colours"),
        ("a photo of a red circle left of a square", "no colours"),
        ("photo of a circle", "a photo of"),
        ("a photo of", "missing"),
        ("a photo of a circle and", "missing"),
    ],
)
def test_parse_rejects_outside_grammar(text, culprit):
    with pytest.raises(ValueError, match=culprit):
        parse_prompt(text)
    with pytest.raises(PromptError):
        parse_prompt(text)


def test_split_roles_are_disjoint_sorted_and_deterministic():
    split = split_prompts(seed=0)
    assert split == split_prompts(seed=0) and split != split_prompts(seed=1)
    train, heldout, probe = split
    assert all(ps == sorted(ps) for ps in split)
    assert set(train).isdisjoint(heldout) and set(train).isdisjoint(probe) and set(heldout).isdisjoint(probe)
    assert set(train) | set(heldout) | set(probe) == set(all_prompts())
    assert {prompt_family(p) for p in train} == set(FAMILIES)
    heldout_families = {f: sum(prompt_family(p) == f for p in heldout) for f in FAMILIES}
    assert heldout_families == {f: HELDOUT_COUNTS.get(f, 0) for f in FAMILIES}


def test_every_heldout_atom_occurs_in_training():
    """Held-out prompts recombine what training shows: every shape, colour, count, relation and
    colour-shape pair they name occurs in some training prompt."""
    split = split_prompts(seed=0)
    known = set().union(*map(prompt_atoms, split.train))
    for p in split.heldout:
        assert prompt_atoms(p) <= known, p
    # every attribute of the world is trained
    assert {f"shape:{s}" for s in SHAPES} | {f"color:{c}" for c in COLORS} <= known
    assert {f"relation:{r}" for r in RELATIONS} | {f"count:{n}" for n in range(1, 5)} <= known


def test_probe_holds_three_pairs_never_trained():
    split = split_prompts(seed=0)
    pairs = lambda ps: {a for p in ps for a in prompt_atoms(p) if a.startswith("pair:")}
    unseen = pairs(split.probe) - pairs(split.train) - pairs(split.heldout)
    assert len(unseen) == 3 and {a.split()[-1] for a in unseen} == set(SHAPES)
    assert all(prompt_atoms(p) & unseen for p in split.probe)


def test_evaluation_prompts_cover_every_family_equally():
    split = split_prompts(seed=0)
    evaluation = split.evaluation()
    # small families are evaluated on their training prompts (fresh seeds), the rest on held-out text
    for p in evaluation:
        assert (p in split.train) == (prompt_family(p) in IN_DISTRIBUTION_FAMILIES), p
    images = evaluation_prompts(evaluation, images_per_family=96)
    counts = {f: sum(prompt_family(p) == f for p in images) for f in FAMILIES}
    assert counts == {f: 96 for f in FAMILIES}
    for f in FAMILIES:  # each family's prompts equally often (96 is a multiple of every count)
        per_prompt = {images.count(p) for p in evaluation if prompt_family(p) == f}
        assert len(per_prompt) == 1, (f, per_prompt)
    assert evaluation_prompts(["a photo of a circle"], images_per_family=3) == ["a photo of a circle"] * 3
    with pytest.raises(ValueError, match="images_per_family"):
        evaluation_prompts(evaluation, images_per_family=0)


@pytest.mark.parametrize("size", [32, 64])
def test_render_puts_objects_where_the_scene_says(size):
    rng = np.random.default_rng(0)
    scale = size / 32
    for text in all_prompts()[::7]:
        spec = parse_prompt(text)
        scene = sample_scene(spec, rng, size)
        assert all(requirements_met(scene, spec).values()), text
        image = render(scene, size)
        assert image.shape == (3, size, size) and image.dtype == np.float32
        assert 0.0 <= image.min() and image.max() <= 1.0
        for obj in scene:
            assert 7 * scale <= obj.extent <= 11 * scale
            half = obj.extent / 2
            assert half <= obj.cx <= size - half and half <= obj.cy <= size - half
            # the pixel at the object's solid interior has its colour
            y = int(obj.cy + (obj.extent / 4 if obj.shape == "triangle" else 0))
            assert np.allclose(image[:, y, int(obj.cx)], COLORS[obj.color], atol=1e-5), (text, obj)
        # pixels far from every object are background
        covered = np.zeros((size, size), bool)
        for obj in scene:
            h = obj.extent / 2 + 1
            covered[max(int(obj.cy - h), 0) : int(obj.cy + h) + 1, max(int(obj.cx - h), 0) : int(obj.cx + h) + 1] = True
        assert np.allclose(image[:, ~covered], np.asarray(BACKGROUND)[:, None])
        # covered area matches the geometry (circle pi/4, triangle 1/2 of the bounding square)
        frac = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}
        cov = (image - np.asarray(BACKGROUND)[:, None, None]).sum(0)  # colour x coverage
        for obj in scene:
            r0, c0 = int(obj.cy - obj.extent / 2), int(obj.cx - obj.extent / 2)
            r1, c1 = int(obj.cy + obj.extent / 2) + 2, int(obj.cx + obj.extent / 2) + 2
            got = cov[r0:r1, c0:c1].sum() / sum(COLORS[obj.color])
            want = frac[obj.shape] * obj.extent**2
            assert got == pytest.approx(want, rel=0.08), (text, obj)  # 4x4 supersampling: +-1/8 px per edge


def test_objects_do_not_overlap_and_counts_are_exact():
    rng = np.random.default_rng(1)
    for _ in range(30):
        scene = sample_scene("a photo of four squares", rng)
        assert len(scene) == 4 and all(o.shape == "square" for o in scene)
        for i, a in enumerate(scene):
            for b in scene[i + 1 :]:
                need = (a.extent + b.extent) / 2 + 2
                assert abs(a.cx - b.cx) >= need or abs(a.cy - b.cy) >= need


def test_position_scenes_are_unambiguous():
    rng = np.random.default_rng(2)
    for rel in world.RELATIONS:
        spec = parse_prompt(f"a photo of a circle {rel} a triangle")
        for _ in range(20):
            a, b = sorted(sample_scene(spec, rng), key=lambda o: o.shape != "circle")
            holds = {r for r in world.RELATIONS if relation_holds(a, b, r)}
            assert holds == {rel}


def test_determinism_and_batch():
    a = make_batch(["a photo of a red square", "a photo of two circles"], np.random.default_rng(5))
    b = make_batch(["a photo of a red square", "a photo of two circles"], np.random.default_rng(5))
    c = make_batch(["a photo of a red square", "a photo of two circles"], np.random.default_rng(6))
    assert a.shape == (2, 3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert make_batch(["a photo of a triangle"], np.random.default_rng(0), size=64).shape == (1, 3, 64, 64)
    assert render_prompt("a photo of a triangle", np.random.default_rng(0)).shape == (3, 32, 32)
    with pytest.raises(TypeError):
        make_batch("a photo of a triangle", np.random.default_rng(0))


def test_validation_split_tunes_without_touching_heldout_or_probe():
    split = split_prompts(seed=0)
    fit, validation = validation_split(split)
    assert (fit, validation) == validation_split(split)
    assert set(fit) <= set(split.train) and set(validation) <= set(split.train)
    assert set(validation).isdisjoint(split.heldout) and set(validation).isdisjoint(split.probe)
    known = set().union(*map(prompt_atoms, fit))
    for p in validation:
        assert prompt_atoms(p) <= known, p
        # only the in-distribution families are both fitted and validated (on fresh seeds)
        assert (p in fit) == (prompt_family(p) in IN_DISTRIBUTION_FAMILIES), p
    counts = {f: sum(prompt_family(p) == f for p in validation if p not in fit) for f in FAMILIES}
    assert counts == {f: VALIDATION_COUNTS.get(f, 0) for f in FAMILIES}


def test_named_prompt_sets_are_the_splits_lists():
    from diffalign.shapes import PROMPT_SETS, PromptError, prompt_set, split_prompts, validation_split

    split = split_prompts()
    assert prompt_set("heldout") == split.evaluation() and prompt_set("probe") == split.probe
    assert prompt_set("train") == split.train and prompt_set("validation") == validation_split(split)[1]
    assert set(PROMPT_SETS) == {"heldout", "validation", "train", "probe"}
    with pytest.raises(PromptError, match=r"unknown 'fit' \(prompt sets: heldout"):
        prompt_set("fit")
