"""Model-based rewards (PickScore, LAION aesthetic, HPS v2) on tiny models of the real architecture.

Each model is built from a small config in code, saved the way its hub repo stores it, loaded back
through the reward's real loading path, and compared with a manual computation that uses the
reference preprocessing (transformers' CLIPImageProcessor, open_clip's ``preprocess_val``) on
images already at the model's input size, so that no resampling separates the two paths.

The open_clip tests skip when open_clip cannot be imported (it needs a torchvision that matches
torch; scripts/setup_rewards_env.sh builds such an environment).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import reward_models
from diffalign.errors import RewardError
from reward_models.aesthetic import AestheticMLP, AestheticScore
from reward_models.pickscore import PickScore
from tests.helpers.clip import IMAGE_SIZE, pooled, tiny_clip_fixture

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)  # not CLIP's, so a processor config that is ignored shows


def _uint8_images(batch: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    """Images in [0, 1] that are exact 8-bit values, so PIL round trips are lossless."""
    pixels = torch.randint(0, 256, (batch, 3, height, width), generator=torch.Generator().manual_seed(seed))
    return pixels.float() / 255


def _pil(images: torch.Tensor) -> list:
    from PIL import Image

    arrays = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arrays]


# ---------------------------------------------------------------- tiny transformers CLIP


# a logit scale other than CLIP's init (log 1/0.07), so a wrong scale shows
tiny_clip = tiny_clip_fixture(logit_scale=50.0)


@pytest.fixture(scope="module")
def image_processor():
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=list(MEAN),
        image_std=list(STD),
    )


def _reference_pixels(processor, images: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(processor(_pil(images), return_tensors="pt")["pixel_values"])).float()


# ---------------------------------------------------------------- PickScore


@pytest.fixture(scope="module")
def pickscore_folders(tiny_clip, image_processor, tmp_path_factory):
    """Laid out like the hub: weights alone in one repo, tokenizer + processor in another."""
    model, tokenizer = tiny_clip
    model_dir, processor_dir = tmp_path_factory.mktemp("PickScore_v1"), tmp_path_factory.mktemp("laion_processor")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(processor_dir)
    image_processor.save_pretrained(processor_dir)
    return model_dir, processor_dir


def test_pickscore_loads_folders_and_matches_manual_computation(tiny_clip, image_processor, pickscore_folders):
    model, tokenizer = tiny_clip
    model_dir, processor_dir = pickscore_folders
    reward = reward_models.build("pickscore", model=str(model_dir), processor=str(processor_dir), batch_size=2)
    images, prompts = _uint8_images(3), ["a cat", "a dog", "a cat"]
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32

    # The authors' inference snippet: processor -> features -> normalise -> exp(logit_scale) * dot.
    with torch.no_grad():
        image_emb = pooled(model.get_image_features(pixel_values=_reference_pixels(image_processor, images)))
        text_emb = pooled(model.get_text_features(**tokenizer(prompts, padding=True, return_tensors="pt")))
    image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True)
    text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)
    expected = model.logit_scale.exp() * (image_emb * text_emb).sum(-1)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
    assert reward.scale == pytest.approx(50.0)


def test_pickscore_bfloat16_is_close_to_float32(pickscore_folders):
    model_dir, processor_dir = pickscore_folders
    images, prompts = _uint8_images(2, seed=1), ["a cat", "a dog"]
    fp32 = PickScore(model=str(model_dir), processor=str(processor_dir))(images, prompts, [{}, {}])
    reward = PickScore(model=str(model_dir), processor=str(processor_dir), dtype="bf16")
    assert {p.dtype for p in reward.model.parameters()} == {torch.bfloat16}
    bf16 = reward(images, prompts, [{}, {}])
    assert bf16.dtype == torch.float32
    # Scores are 50 * cos; bf16 (8-bit mantissa) keeps cosines to a few 1e-3 through the tiny CLIP,
    # so within 0.25 (cos within 5e-3); not equal to fp32, so the bf16 weights really ran.
    diff = float((bf16 - fp32).abs().max())
    assert 0 < diff < 0.25, diff


def test_pickscore_missing_folders_are_named(pickscore_folders, tmp_path):
    model_dir, processor_dir = pickscore_folders
    with pytest.raises(RewardError, match="model folder .*no_such_model"):
        reward_models.build("pickscore", model=str(tmp_path / "no_such_model"), processor=str(processor_dir))
    with pytest.raises(RewardError, match="processor folder .*no_such_processor"):
        reward_models.build("pickscore", model=str(model_dir), processor=str(tmp_path / "no_such_processor"))
    with pytest.raises(RewardError, match="cannot load processor") as info:
        reward_models.build("pickscore", model=str(model_dir), processor=str(model_dir))  # weights, no tokenizer
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- LAION aesthetic predictor


def _manual_head(head: AestheticMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP by hand: five affine maps, no activations (dropout is off at eval)."""
    for layer in [m for m in head.layers if isinstance(m, torch.nn.Linear)]:
        x = x @ layer.weight.T + layer.bias
    return x.squeeze(-1)


@pytest.fixture(scope="module")
def aesthetic_files(tiny_clip, image_processor, tmp_path_factory):
    model, tokenizer = tiny_clip
    folder = tmp_path_factory.mktemp("clip_l14")
    model.save_pretrained(folder)  # a full CLIPModel checkpoint, as openai/clip-vit-large-patch14
    image_processor.save_pretrained(folder)
    torch.manual_seed(1)
    head = AestheticMLP(input_size=model.config.projection_dim).eval()
    head_file = folder / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(head.state_dict(), head_file)  # keys layers.0.weight, ..., as the released file
    return folder, head_file, head


def test_aesthetic_loads_files_and_matches_manual_computation(tiny_clip, image_processor, aesthetic_files):
    model, _ = tiny_clip
    folder, head_file, head = aesthetic_files
    reward = reward_models.build("aesthetic", clip_model=str(folder), head=str(head_file), batch_size=2)
    assert type(reward.model).__name__ == "CLIPVisionModelWithProjection"  # the text tower is not loaded
    images = _uint8_images(3, seed=2)
    scores = reward(images, ["", "", ""], [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32

    with torch.no_grad():  # the original: processor -> CLIPModel image features -> L2 norm -> MLP
        embedding = pooled(model.get_image_features(pixel_values=_reference_pixels(image_processor, images)))
        expected = _manual_head(head, embedding / embedding.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_aesthetic_head_without_prefix_from_safetensors(aesthetic_files, tmp_path):
    from safetensors.torch import save_file

    folder, _, head = aesthetic_files
    bare = {k.removeprefix("layers."): v.contiguous() for k, v in head.state_dict().items()}  # nn.Sequential keys
    save_file(bare, tmp_path / "head.safetensors")
    reference = AestheticScore(clip_model=str(folder), head=str(folder / "sac+logos+ava1-l14-linearMSE.pth"))
    reward = AestheticScore(clip_model=str(folder), head=str(tmp_path / "head.safetensors"))
    images = _uint8_images(2, height=40, width=48, seed=3)  # resized and cropped: same path for both
    torch.testing.assert_close(reward(images, ["", ""], [{}, {}]), reference(images, ["", ""], [{}, {}]))


def test_aesthetic_is_differentiable(aesthetic_files):
    folder, head_file, _ = aesthetic_files
    reward = AestheticScore(clip_model=str(folder), head=str(head_file))
    images = _uint8_images(2, height=40, width=36).requires_grad_(True)
    reward.score(images).sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_aesthetic_bad_sources_are_named(aesthetic_files, tmp_path):
    folder, head_file, _ = aesthetic_files
    with pytest.raises(RewardError, match="CLIP model folder .*no_such_clip"):
        reward_models.build("aesthetic", clip_model=str(tmp_path / "no_such_clip"), head=str(head_file))
    with pytest.raises(RewardError, match="weights file .*no_such_head.pth"):
        reward_models.build("aesthetic", clip_model=str(folder), head=str(tmp_path / "no_such_head.pth"))
    # HF_HUB_OFFLINE=1 (conftest): a hub id cannot be fetched; the message names repo and file.
    with pytest.raises(RewardError, match="sac\\+logos.*camenduru/improved-aesthetic-predictor") as info:
        reward_models.build("aesthetic", clip_model=str(folder))
    assert "\n" not in str(info.value)
    torch.save(AestheticMLP(input_size=8).state_dict(), tmp_path / "other.pth")
    with pytest.raises(RewardError, match="head takes 8-d embeddings but the CLIP model gives 16-d"):
        reward_models.build("aesthetic", clip_model=str(folder), head=str(tmp_path / "other.pth"))


# ---------------------------------------------------------------- HPS v2 (open_clip)

TINY_OPEN_CLIP = "diffalign-tiny-ViT"  # registered with open_clip by the fixture below
TINY_OPEN_CLIP_CONFIG = {  # ViT-H-14's config, shrunk: same classes, same tokenizer (vocab 49408, 77 tokens)
    "embed_dim": 16,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def test_hpsv2_without_open_clip_says_how_to_install(tmp_path):
    try:
        import open_clip  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("open_clip is importable here")
    for name in ("hpsv2", "hpsv2.1"):
        with pytest.raises(RewardError, match=f"{name} needs open_clip.*pip install 'diffalign\\[rewards\\]'") as info:
            reward_models.build(name, checkpoint=str(tmp_path / "HPS_v2_compressed.pt"))
        assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def open_clip_tiny(tmp_path_factory):
    open_clip = pytest.importorskip("open_clip", reason="open_clip (with a matching torchvision) is not installed")
    config_dir = tmp_path_factory.mktemp("open_clip_configs")
    (config_dir / f"{TINY_OPEN_CLIP}.json").write_text(json.dumps(TINY_OPEN_CLIP_CONFIG))
    open_clip.add_model_config(config_dir)
    torch.manual_seed(0)
    model, _, preprocess_val = open_clip.create_model_and_transforms(TINY_OPEN_CLIP, pretrained=None, output_dict=True)
    checkpoint = tmp_path_factory.mktemp("hps") / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, checkpoint)  # the released files' layout
    return open_clip, model.eval(), preprocess_val, checkpoint


def test_hpsv2_loads_checkpoint_and_matches_reference(open_clip_tiny):
    open_clip, model, preprocess_val, checkpoint = open_clip_tiny
    reward = reward_models.build("hpsv2.1", checkpoint=str(checkpoint), architecture=TINY_OPEN_CLIP, batch_size=2)
    assert reward.name == "hpsv2.1"
    images, prompts = _uint8_images(3, seed=4), ["a cat on a mat", "a red dog", "a cat on a mat"]
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32

    # hpsv2.score: preprocess_val(PIL) -> model(image, text) -> diag(image_features @ text_features.T)
    pixels = torch.stack([preprocess_val(image) for image in _pil(images)])
    with torch.no_grad():
        out = model(pixels, open_clip.get_tokenizer(TINY_OPEN_CLIP)(prompts))
    expected = torch.diagonal(out["image_features"] @ out["text_features"].T)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)

    resized = reward(_uint8_images(2, height=48, width=40), prompts[:2], [{}, {}])  # resize + crop path runs
    assert resized.shape == (2,) and torch.isfinite(resized).all()

    bf16 = reward_models.build("hpsv2.1", checkpoint=str(checkpoint), architecture=TINY_OPEN_CLIP, dtype="bfloat16")
    bf16_scores = bf16(images, prompts, [{}] * 3)
    assert bf16_scores.dtype == torch.float32
    torch.testing.assert_close(bf16_scores, expected, rtol=0, atol=0.03)  # cosines: bf16 keeps ~2 digits


def test_hpsv2_bad_checkpoints_are_named(open_clip_tiny, tmp_path):
    _, model, _, checkpoint = open_clip_tiny
    with pytest.raises(RewardError, match="weights file .*no_such.pt"):
        reward_models.build("hpsv2", checkpoint=str(tmp_path / "no_such.pt"), architecture=TINY_OPEN_CLIP)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("visual.")}
    torch.save({"state_dict": state}, tmp_path / "text_only.pt")
    with pytest.raises(RewardError, match="cannot load .*text_only.pt.* into open_clip.*Missing key") as info:
        reward_models.build("hpsv2", checkpoint=str(tmp_path / "text_only.pt"), architecture=TINY_OPEN_CLIP)
    assert "\n" not in str(info.value)
    with pytest.raises(RewardError, match="unknown open_clip architecture 'no-such-arch'"):
        reward_models.build("hpsv2", checkpoint=str(checkpoint), architecture="no-such-arch")


def test_hpsv2_real_architecture_preprocessing(open_clip_tiny):
    """ViT-H-14's validation transform is what HPS uses: 224 px, bicubic, shortest side, OpenAI stats."""
    from reward_models.hpsv2 import transform_from_open_clip

    from dataclasses import asdict

    from open_clip.transform import PreprocessCfg

    open_clip = open_clip_tiny[0]
    image_size = open_clip.get_model_config("ViT-H-14")["vision_cfg"]["image_size"]
    cfg = asdict(PreprocessCfg(size=image_size))  # what create_model sets for ViT-H-14 (no preprocess_cfg in its JSON)
    transform = transform_from_open_clip("hpsv2", cfg)
    assert (transform.resize, transform.crop, transform.crop_offsets) == (224, (224, 224), "torchvision")
    assert transform.mean == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
