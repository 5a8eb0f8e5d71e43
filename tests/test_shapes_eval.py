"""ShapesEval: accuracy on ground-truth renders, rejection of mismatches, noise and fragments."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import ndimage

import reward_models
from diffalign.errors import RewardError
from diffalign.shapes.scenes import render, requirements_met, sample_scene
from diffalign.shapes.world import (
    COLORS,
    FAMILIES,
    NUMBER_WORDS,
    RELATIONS,
    SHAPES,
    all_prompts,
    parse_prompt,
)
from reward_models.shapes_eval import ShapesEval

N_IMAGES = 660  # >= 600 fresh renders, every family many times


def _balanced_prompts(rng, n):
    """n prompts drawn family first, so that small families are not swamped by color_attr."""
    by_family = {f: [p for p in all_prompts() if parse_prompt(p).family == f] for f in FAMILIES}
    families = [FAMILIES[i % len(FAMILIES)] for i in range(n)]
    return [by_family[f][rng.integers(len(by_family[f]))] for f in families]


@pytest.fixture(scope="module")
def ground_truth():
    """(images, prompts, scenes) for N_IMAGES fresh 32x32 renders."""
    rng = np.random.default_rng(1234)
    prompts = _balanced_prompts(rng, N_IMAGES)
    scenes = [sample_scene(parse_prompt(p), rng) for p in prompts]
    images = torch.from_numpy(np.stack([render(s) for s in scenes]))
    return images, prompts, scenes


@pytest.fixture(scope="module")
def reward():
    return ShapesEval()


def _mutate(prompt, rng):
    """A prompt of the same family that differs from ``prompt`` in exactly one requirement."""
    spec = parse_prompt(prompt)
    objs = spec.objects
    other = lambda xs, *avoid: [x for x in xs if x not in avoid][rng.integers(len([x for x in xs if x not in avoid]))]
    fam = spec.family
    if fam == "single_object":
        return f"a photo of a {other(SHAPES, objs[0].shape)}"
    if fam == "colors":
        if rng.random() < 0.5:
            return f"a photo of a {other(list(COLORS), objs[0].color)} {objs[0].shape}"
        return f"a photo of a {objs[0].color} {other(SHAPES, objs[0].shape)}"
    if fam == "counting":
        n = other([1, 2, 3, 4], objs[0].count)
        return f"a photo of {NUMBER_WORDS[n - 1]} {objs[0].shape}{'s' if n > 1 else ''}"
    a, b = objs
    if fam == "two_object":
        return f"a photo of a {a.shape} and a {other(SHAPES, a.shape, b.shape)}"
    if fam == "position":
        if rng.random() < 0.3:  # swapped objects: the opposite relation
            return f"a photo of a {b.shape} {spec.relation} a {a.shape}"
        return f"a photo of a {a.shape} {other(RELATIONS, spec.relation)} a {b.shape}"
    # color_attr: swap the colours (binding), or change one colour
    if rng.random() < 0.4:
        return f"a photo of a {b.color} {a.shape} and a {a.color} {b.shape}"
    return f"a photo of a {a.color} {a.shape} and a {other(list(COLORS), a.color, b.color)} {b.shape}"


def test_registered_and_buildable():
    assert "shapes_eval" in reward_models.available()
    fn = reward_models.build("shapes_eval", partial_credit=True)
    assert isinstance(fn, ShapesEval) and fn.partial_credit


def test_clean_renders_pass(ground_truth, reward):
    images, prompts, _ = ground_truth
    r = reward(images, prompts, [{} for _ in prompts])
    assert r.shape == (len(prompts),) and r.dtype == torch.float32
    assert set(r.unique().tolist()) <= {0.0, 1.0}
    assert r.mean().item() >= 0.99
    info = reward.last_info
    assert set(info) == {f"acc/{f}" for f in FAMILIES} | {"acc/overall", "acc/images"}
    assert info["acc/images"] == pytest.approx(r.mean().item())
    # GenEval-style overall: the mean of the family accuracies
    assert info["acc/overall"] == pytest.approx(sum(info[f"acc/{f}"] for f in FAMILIES) / len(FAMILIES))
    assert min(info.values()) >= 0.95


def test_blur_and_noise_are_tolerated(ground_truth, reward):
    images, prompts, _ = ground_truth
    gen = torch.Generator().manual_seed(0)
    blurred = torch.from_numpy(ndimage.gaussian_filter(images.numpy(), sigma=(0, 0, 0.5, 0.5)))
    noisy = (images + 0.05 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    both = (blurred + 0.05 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    for name, x in [("blur", blurred), ("noise", noisy), ("blur+noise", both)]:
        assert reward(x, prompts, None).mean().item() >= 0.97, name


def test_mismatched_prompts_fail(ground_truth, reward):
    images, prompts, scenes = ground_truth
    rng = np.random.default_rng(7)
    pool = all_prompts()
    mutated = [_mutate(p, rng) for p in prompts]
    # and prompts of any family whose requirements the scene does not meet
    crossed = []
    for scene in scenes:
        while True:
            q = pool[rng.integers(len(pool))]
            if not all(requirements_met(scene, parse_prompt(q)).values()):
                crossed.append(q)
                break
    for p, q, scene in zip(prompts, mutated, scenes):
        assert q != p and not all(requirements_met(scene, parse_prompt(q)).values()), (p, q)
    for name, qs in [("mutated", mutated), ("crossed", crossed)]:
        r = reward(images, qs, None)
        assert r.mean().item() <= 0.01, name
        # partial credit still rewards the requirements that are met, but never fully
        partial = ShapesEval(partial_credit=True)(images, qs, None)
        assert partial.max().item() < 1.0 and partial.mean().item() > 0.2


@pytest.mark.parametrize("size", [32, 64])
def test_pure_noise_gets_nothing(size):
    gen = torch.Generator().manual_seed(size)
    uniform = torch.rand(150, 3, size, size, generator=gen)
    gray = (0.5 + 0.15 * torch.randn(150, 3, size, size, generator=gen)).clamp(0, 1)
    prompts = _balanced_prompts(np.random.default_rng(size), 300)
    for partial in (False, True):
        assert ShapesEval(partial_credit=partial)(torch.cat([uniform, gray]), prompts, None).sum().item() == 0


def test_fragments_and_extras_fail(reward):
    rng = np.random.default_rng(3)
    prompt = "a photo of a red circle and a blue triangle"
    image = render(sample_scene(parse_prompt(prompt), rng))
    assert reward(torch.from_numpy(image)[None], [prompt], None).item() == 1.0
    # salt of coloured single pixels away from the objects: stray fragments
    salted = image.copy()
    free = np.argwhere(ndimage.binary_dilation(image.max(0) > 0.05, iterations=3) == 0)
    for y, x in free[rng.choice(len(free), 40, replace=False)]:
        salted[:, y, x] = COLORS["red"]
    # an extra object (three non-overlapping squares, two recoloured and reshaped as asked)
    a, b, c = sample_scene(parse_prompt("a photo of three squares"), rng)
    scene = [replace(a, shape="circle", color="red"), replace(b, shape="triangle", color="blue")]
    extra = render(scene + [c])
    assert reward(torch.from_numpy(render(scene))[None], [prompt], None).item() == 1.0
    # the right objects cut into pieces by a grid of background lines
    cut = render(scene)
    cut[:, ::3, :] = 0.0
    cut[:, :, ::3] = 0.0
    batch = torch.from_numpy(np.stack([salted, extra, cut]))
    details = reward.evaluate(batch, [prompt] * 3)
    assert [d["passed"] for d in details] == [False, False, False]
    assert "stray" in details[0]["reason"]
    assert ShapesEval(partial_credit=True)(batch[[0, 2]], [prompt] * 2, None).sum().item() == 0


def test_64px_renders_pass():
    rng = np.random.default_rng(64)
    prompts = _balanced_prompts(rng, 120)
    images = torch.from_numpy(np.stack([render(sample_scene(parse_prompt(p), rng, 64), 64) for p in prompts]))
    fn = ShapesEval(size=64)
    assert fn(images, prompts, None).mean().item() >= 0.99
    with pytest.raises(RewardError, match="64x64"):
        fn(images[:, :, :32, :32], prompts, None)


def test_evaluate_details(reward):
    rng = np.random.default_rng(0)
    prompt = "a photo of a yellow square"
    scene = sample_scene(parse_prompt(prompt), rng)
    (d,) = reward.evaluate(torch.from_numpy(render(scene))[None], [prompt])
    assert d["passed"] and d["reason"] == "ok" and d["family"] == "colors"
    (obj,) = d["objects"]
    assert (obj["shape"], obj["color"]) == ("square", "yellow")
    assert abs(obj["cx"] - scene[0].cx) < 1 and abs(obj["cy"] - scene[0].cy) < 1
    (d,) = reward.evaluate(torch.from_numpy(render(scene))[None], ["a photo of a yellow circle"])
    assert not d["passed"] and "count:circle" in d["reason"]


def test_bad_input(reward):
    images = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match="'dog'"):
        reward(images, ["a photo of a dog", "a photo of a circle"], None)
    with pytest.raises(RewardError, match="2 images"):
        reward(images, ["a photo of a circle"], None)
    with pytest.raises(RewardError, match="metadata"):
        reward(images, ["a photo of a circle"] * 2, [{}])
    with pytest.raises(RewardError, match=r"\(B, 3, H, W\)"):
        reward(torch.zeros(2, 32, 32), ["a photo of a circle"] * 2, None)
    with pytest.raises(RewardError, match=r"\[0, 1\]"):
        reward(images + 2.0, ["a photo of a circle"] * 2, None)
    assert reward(images, ["a photo of a circle"] * 2, None).tolist() == [0.0, 0.0]  # empty image


def test_pass_weight_mixes_partial_credit_with_pass_fail():
    prompt = "a photo of a red circle and a blue square"
    scene = sample_scene(parse_prompt(prompt), np.random.default_rng(3))
    colours = {o.shape: o.color for o in scene}
    assert colours == {"circle": "red", "square": "blue"}
    swapped = [replace(o, color=colours["square" if o.shape == "circle" else "circle"]) for o in scene]
    images = torch.from_numpy(np.stack([render(scene), render(swapped)]))
    # 5 requirements (two counts, two colours, nothing extra); the swap misses both colours
    expected = {0.0: [1.0, 0.6], 0.5: [1.0, 0.3], 1.0: [1.0, 0.0]}
    for w, values in expected.items():
        fn = reward_models.build("shapes_eval", partial_credit=True, pass_weight=w)
        assert fn(images, [prompt] * 2, None).tolist() == pytest.approx(values), w
    assert ShapesEval()(images, [prompt] * 2, None).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("kwargs, match", [
    ({"partial_credit": True, "pass_weight": 1.5}, "pass_weight must be a number in"),
    ({"partial_credit": True, "pass_weight": "half"}, "pass_weight must be a number in"),
    ({"pass_weight": 0.5}, "needs partial_credit=true"),
])
def test_pass_weight_is_checked(kwargs, match):
    with pytest.raises(RewardError, match=match):
        ShapesEval(**kwargs)
