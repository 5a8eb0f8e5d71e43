"""Built-in rewards: registry, JPEG (in)compressibility, brightness, CLIP score, weighted sum.

The CLIP tests use a tiny CLIPModel built from config and an in-memory CLIPTokenizer, and go
through the real ``from_pretrained`` path with a local folder (no hub access).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reward_models
from diffalign.errors import RewardError
from reward_models.base import check_images, check_reward_output
from reward_models.clip_score import CLIP_MEAN, CLIP_STD, ClipImageTransform, ClipScore
from tests.helpers.clip import CAT_MERGES, IMAGE_SIZE, pooled, tiny_clip_fixture


def _noise(batch: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- registry


def test_builtin_names_registered():
    names = reward_models.available()
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "brightness", "clip_score", "weighted"):
        assert name in names


@pytest.mark.parametrize("name", ["reward_models.compression:brightness", "reward_models.compression.brightness"])
def test_build_by_dotted_path(name):
    reward = reward_models.build(name)
    images = torch.full((2, 3, 4, 4), 0.25)
    assert torch.allclose(reward(images, ["a", "b"], [{}, {}]), torch.full((2,), 0.25))


def test_unknown_name_lists_known_rewards():
    with pytest.raises(RewardError, match="unknown reward 'nope'.*jpeg_compressibility"):
        reward_models.build("nope")


def test_bad_dotted_path():
    with pytest.raises(RewardError, match="cannot be imported"):
        reward_models.build("reward_models.compression:missing_factory")


def test_bad_kwargs_are_reward_errors():
    with pytest.raises(RewardError, match="bad arguments"):
        reward_models.build("jpeg_compressibility", qualty=90)
    with pytest.raises(RewardError, match="quality"):
        reward_models.build("jpeg_compressibility", quality=0)


def test_check_reward_output():
    assert check_reward_output("r", torch.zeros(3, dtype=torch.float64), 3).dtype == torch.float32
    with pytest.raises(RewardError, match=r"shape \(3, 1\), expected \(3,\)"):
        check_reward_output("r", torch.zeros(3, 1), 3)
    with pytest.raises(RewardError, match="returned list"):
        check_reward_output("r", [0.0, 0.0, 0.0], 3)


def test_check_images():
    with pytest.raises(RewardError, match=r"\(B, 3, H, W\)"):
        check_images(torch.zeros(2, 1, 4, 4))
    with pytest.raises(RewardError, match=r"\[0, 1\]"):
        check_images(torch.full((1, 3, 4, 4), 2.0))


# ---------------------------------------------------------------- pixel rewards


def test_jpeg_flat_image_more_compressible_than_noise():
    images = torch.cat([torch.full((1, 3, 32, 32), 0.5), _noise(1)])
    prompts, metadata = ["", ""], [{}, {}]
    compress = reward_models.build("jpeg_compressibility")(images, prompts, metadata)
    incompress = reward_models.build("jpeg_incompressibility", device="cpu")(images, prompts, metadata)
    assert compress.shape == incompress.shape == (2,)
    assert compress.dtype == torch.float32
    assert compress[0] > compress[1]  # flat image scores higher on compressibility
    assert incompress[1] > incompress[0]
    assert torch.equal(compress, -incompress)
    assert (incompress > 0).all()


def test_jpeg_quality_changes_size():
    images = _noise(1)
    low = reward_models.build("jpeg_incompressibility", quality=10)(images, [""], [{}])
    high = reward_models.build("jpeg_incompressibility", quality=95)(images, [""], [{}])
    assert low < high


def test_brightness():
    images = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])
    out = reward_models.build("brightness")(images, ["", ""], [{}, {}])
    assert torch.equal(out, torch.tensor([0.0, 1.0]))


# ---------------------------------------------------------------- CLIP score


tiny_clip = tiny_clip_fixture(merges=[*CAT_MERGES, ("d", "o")])  # "do" too


@pytest.fixture(scope="module")
def clip_folder(tiny_clip, tmp_path_factory):
    from transformers import CLIPImageProcessorPil

    model, tokenizer = tiny_clip
    folder = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.25, 0.25, 0.25],
    ).save_pretrained(folder)
    return folder


def test_clip_score_matches_manual_computation(tiny_clip):
    model, tokenizer = tiny_clip
    reward = ClipScore.from_components(model, tokenizer, batch_size=2)
    images = _noise(3, size=40)
    prompts = ["a cat", "a dog", "a cat"]
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32

    pixels = reward.preprocess(images)
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        image_emb = pooled(model.get_image_features(pixel_values=pixels))
        text_emb = pooled(model.get_text_features(**tokens))
    expected = 100 * F.cosine_similarity(image_emb, text_emb, dim=-1)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)

    clipped = ClipScore.from_components(model, tokenizer, scale=2.5, clip_negative=True)(images, prompts, [{}] * 3)
    torch.testing.assert_close(clipped, 2.5 * (expected / 100).clamp(min=0), rtol=1e-4, atol=1e-4)


def test_clip_score_is_differentiable(tiny_clip):
    model, tokenizer = tiny_clip
    reward = ClipScore.from_components(model, tokenizer)
    images = _noise(2, size=48).requires_grad_(True)
    reward.score(images, ["a cat", "do"]).sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    # the reward as called (differentiable = True): a graph on images that require grad, none otherwise
    assert reward.differentiable and reward(images, ["a cat", "do"], [{}, {}]).requires_grad
    assert not reward(images.detach(), ["a cat", "do"], [{}, {}]).requires_grad


def test_clip_score_prompt_count_mismatch(tiny_clip):
    reward = ClipScore.from_components(*tiny_clip)
    with pytest.raises(RewardError, match="2 images but 1 prompts"):
        reward(_noise(2), ["a cat"], [{}, {}])


def test_clip_score_loads_local_folder(tiny_clip, clip_folder):
    reward = reward_models.build("clip_score", model=str(clip_folder), device="cpu", dtype="float32", batch_size=4)
    assert reward.transform == ClipImageTransform(IMAGE_SIZE, (IMAGE_SIZE, IMAGE_SIZE), (0.5,) * 3, (0.25,) * 3)
    images, prompts = _noise(2), ["a cat", "a dog"]
    processor_config = {
        "size": {"shortest_edge": IMAGE_SIZE},
        "crop_size": IMAGE_SIZE,
        "image_mean": [0.5] * 3,
        "image_std": [0.25] * 3,
    }
    expected = ClipScore.from_components(*tiny_clip, image_processor_config=processor_config)(images, prompts, [{}, {}])
    torch.testing.assert_close(reward(images, prompts, [{}, {}]), expected, rtol=1e-5, atol=1e-5)


def test_clip_score_folder_without_processor_uses_clip_defaults(tiny_clip, tmp_path):
    model, tokenizer = tiny_clip
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reward = ClipScore(model=str(tmp_path))
    assert reward.transform == ClipImageTransform(IMAGE_SIZE, (IMAGE_SIZE, IMAGE_SIZE), CLIP_MEAN, CLIP_STD)


def test_clip_score_missing_folder(tmp_path):
    missing = str(tmp_path / "no_such_clip")
    with pytest.raises(RewardError, match="no_such_clip") as info:
        reward_models.build("clip_score", model=missing)
    assert "\n" not in str(info.value)


def test_clip_score_unloadable_folder(tmp_path):
    with pytest.raises(RewardError, match=f"cannot load CLIP model '{tmp_path}'") as info:
        reward_models.build("clip_score", model=str(tmp_path))  # exists but empty
    assert "\n" not in str(info.value)


def test_preprocess_output_is_crop_size():
    transform = ClipImageTransform.from_processor_config(
        {"size": {"shortest_edge": 24}, "crop_size": {"height": 20, "width": 22}}, image_size=IMAGE_SIZE
    )
    out = transform(_noise(2, size=16).repeat(1, 1, 1, 3))  # 16 x 48, aspect 1:3
    assert out.shape == (2, 3, 20, 22)
    assert transform.output_size(16, 48) == (20, 22)


def test_preprocess_matches_clip_image_processor_without_resampling():
    """When no resize is needed, crop offsets and normalisation equal transformers' processor."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pixels = torch.randint(0, 256, (3, 45, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    reference = processor(Image.fromarray(pixels.permute(1, 2, 0).numpy()), return_tensors="pt")["pixel_values"]
    transform = ClipImageTransform.from_processor_config(processor.to_dict(), image_size=32)
    out = transform(pixels[None].float() / 255)
    torch.testing.assert_close(out, torch.as_tensor(np.asarray(reference)).float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- weighted sum


def test_weighted_sum_and_last_info():
    images = torch.cat([torch.full((1, 3, 32, 32), 0.5), _noise(1)])
    prompts, metadata = ["", ""], [{}, {}]
    reward = reward_models.build(
        "weighted",
        components=[
            {"name": "brightness", "weight": 2.0},
            {"name": "jpeg_compressibility", "weight": -0.5, "kwargs": {"quality": 80}},
        ],
        device="cpu",
    )
    out = reward(images, prompts, metadata)
    bright = reward_models.build("brightness")(images, prompts, metadata)
    jpeg = reward_models.build("jpeg_compressibility", quality=80)(images, prompts, metadata)
    torch.testing.assert_close(out, 2.0 * bright - 0.5 * jpeg)
    assert reward.last_info["reward/brightness"] == pytest.approx(bright.mean().item())
    assert reward.last_info["reward/jpeg_compressibility"] == pytest.approx(jpeg.mean().item())
    assert reward.last_info["reward/jpeg_compressibility/jpeg_size_kb"] == pytest.approx(-jpeg.mean().item())


def test_weighted_nested_prefixes_inner_info():
    inner = {"name": "weighted", "label": "inner", "kwargs": {"components": [{"name": "brightness"}]}}
    reward = reward_models.build("weighted", components=[inner, {"name": "brightness", "weight": 0.0}])
    out = reward(torch.full((2, 3, 4, 4), 0.75), ["", ""], [{}, {}])
    torch.testing.assert_close(out, torch.full((2,), 0.75))
    assert reward.last_info == {"reward/inner": 0.75, "reward/inner/reward/brightness": 0.75, "reward/brightness": 0.75}


@pytest.mark.parametrize(
    "components, message",
    [
        ([], "non-empty list"),
        ([{"weight": 1.0}], r"components\[0\]\.name"),
        ([{"name": "brightness"}, {"name": "brightness", "weight": "x"}], r"components\[1\]\.weight"),
        ([{"name": "brightness", "kwargs": [1]}], r"components\[0\]\.kwargs"),
        ([{"name": "brightness", "wieght": 1.0}], r"unknown field\(s\) \['wieght'\]"),
        ([{"name": "brightness"}, {"name": "brightness"}], r"components\[1\]\.label"),
        ([{"name": "nope"}], r"components\[0\] \(nope\): unknown reward"),
    ],
)
def test_weighted_bad_spec(components, message):
    with pytest.raises(RewardError, match=message):
        reward_models.build("weighted", components=components)
