"""Image editing: FLUX.1 Kontext and Qwen-Image-Edit adapters, prompt files with source images,
the ``edit_consistency`` reward, and one training iteration of each tiny editing config.

Parity: diffalign's deterministic rollout (flow ODE, zero noise) from the same noise, prompts and
source images equals the stock pipeline's ``__call__`` (``output_type="latent"``), CFG on and off.
"""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch

import reward_models
from diffalign.adapters import FAMILIES, PIPELINE_FAMILIES, SOURCE_IMAGE_FAMILIES, PromptEmbeds, load_adapter
from diffalign.adapters.flux import pack_latents, unpack_latents
from diffalign.config_files import load_config
from diffalign.errors import ConfigError, RewardError
from diffalign.images import ImagePrompt, prompt_from_record, prompt_metadata, prompt_record
from diffalign.prompts import read_prompt_file, resolve_prompts
from diffalign.sampling import build_kernel, sample_linear
from tests.helpers.adapters import PX, one_thread  # noqa: F401 (fixture)
from tests.helpers.clip import tiny_clip_fixture
from tests.helpers.tiny_run import FAST, ROOT, run_cli, train_records

TEXTS = ["a photo of a blue circle", "two blue squares"]
tiny_clip = tiny_clip_fixture()


def _png(path, seed: int, size: int = PX, width: int | None = None):
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size, width or size, 3)) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    return [_png(folder / f"s{i}.png", i) for i in range(3)]


@pytest.fixture(scope="module")
def wide_sources(tmp_path_factory):
    """Two 80 x 40 (2:1) sources: squashing them to a square changes what the model sees."""
    folder = tmp_path_factory.mktemp("wide")
    return [_png(folder / f"w{i}.png", 10 + i, size=40, width=80) for i in range(2)]


@pytest.fixture(scope="module")
def kontext():
    return load_adapter("tiny:flux_kontext")


@pytest.fixture(scope="module")
def qwen_edit():
    return load_adapter("tiny:qwen_edit")


def _rollout(adapter, prompts, guidance_scale, steps=2):
    x = adapter.prepare_noise(len(prompts), PX, PX, generator=torch.Generator().manual_seed(7))
    traj = sample_linear(adapter, build_kernel(adapter, "flow_grpo", 0.0), adapter.encode_prompts(prompts, with_uncond=guidance_scale > 1),
                         adapter.make_schedule(steps, PX, PX), torch.zeros(steps, dtype=torch.bool),
                         guidance_scale=guidance_scale, height=PX, width=PX, noise=x)
    return x, traj.latents[:, -1]


def _images(paths):
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


# ---- editing prompts ---------------------------------------------------------------------
def test_image_prompt_is_text_with_an_image(tmp_path):
    a, b = ImagePrompt("make it red", "/x/a.png"), ImagePrompt("make it red", "/x/b.png")
    assert str(a) == "make it red" and a.upper() == "MAKE IT RED" and isinstance(a, str)
    assert a != b and len({a, b, ImagePrompt("make it red", "/x/a.png")}) == 2 and a != "make it red"
    assert pickle.loads(pickle.dumps(a)) == a and pickle.loads(pickle.dumps(a)).image == "/x/a.png"
    assert prompt_metadata([a, "plain"]) == [{"source_image": "/x/a.png"}, {}]
    assert prompt_from_record(json.loads(json.dumps(prompt_record(a)))) == a and prompt_record("plain") == "plain"


def test_prompt_file_with_an_image_column(tmp_path, sources):
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "a.png", 5)
    rows = [{"prompt": " make it red ", "image": "img/a.png"}, {"prompt": "", "image": "img/a.png"},
            {"prompt": "make it blue", "image": str(sources[0])}]
    f = tmp_path / "edits.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = read_prompt_file(str(f), image_column="image")
    assert prompts == [ImagePrompt("make it red", tmp_path / "img" / "a.png"), ImagePrompt("make it blue", sources[0])]
    assert read_prompt_file(str(f)) == ["make it red", "make it blue"]  # without image_column: text only
    (tmp_path / "edits.csv").write_text("text,src\nmake it red,img/a.png\n")
    assert read_prompt_file(str(tmp_path / "edits.csv"), column="text", image_column="src")[0].image == str(tmp_path / "img" / "a.png")
    cfg = load_config(ROOT / "configs/tiny/flow_grpo_flux_kontext.yaml")
    train, evals = resolve_prompts(cfg)
    assert len(train) == 4 and all(isinstance(p, ImagePrompt) for p in train) and evals == train


@pytest.mark.parametrize("row, message", [
    ({"prompt": "make it red", "image": "missing.png"}, r"row 2: source image 'missing.png' does not exist"),
    ({"prompt": "make it red", "image": "broken.png"}, r"row 2: source image 'broken.png' cannot be read"),
    ({"prompt": "make it red", "image": ""}, r"row 2 has no source image path"),
    ({"prompt": "make it red"}, r"prompts.image_column.*line 2 .* has no 'image'"),
])
def test_bad_source_images_are_one_line_errors(tmp_path, sources, row, message):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    f = tmp_path / "edits.jsonl"
    f.write_text(json.dumps({"prompt": "ok", "image": str(sources[0])}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=message):
        read_prompt_file(str(f), image_column="image")


def test_bad_image_column_config_exits_2(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("make it red\n")
    for overrides, key in [([f"prompts.file={tmp_path / 'p.txt'}"], "prompts.image_column"),
                           (["prompts.source=list", "prompts.train=[a]"], "prompts.image_column"),
                           (["prompts.image_column=null"], "prompts.image_column")]:
        out = tmp_path / "run"
        config = "configs/tiny/flow_grpo_qwen_edit.yaml"  # qwen_edit without images: refused before loading
        assert run_cli("train", config, f"output_dir={out}", *overrides, *FAST) == 2
        err = capsys.readouterr().err.strip()
        assert key in err and "\n" not in err and not out.exists()


# ---- FLUX.1 Kontext ------------------------------------------------------------------------
def test_registered():
    assert FAMILIES["flux_kontext"].endswith("FluxKontextAdapter") and PIPELINE_FAMILIES["FluxKontextPipeline"] == "flux_kontext"
    assert FAMILIES["qwen_edit"].endswith("QwenImageEditAdapter") and PIPELINE_FAMILIES["QwenImageEditPipeline"] == "qwen_edit"
    assert SOURCE_IMAGE_FAMILIES == ("qwen_edit",)


@pytest.mark.parametrize("guidance_scale", [1.0, 2.0])
def test_kontext_rollout_matches_stock_pipeline(kontext, sources, guidance_scale):
    """Distilled guidance 3.5 always; true CFG with the empty negative prompt above 1."""
    prompts = [ImagePrompt(t, p) for t, p in zip(TEXTS, sources)]
    x, ours = _rollout(kontext, prompts, guidance_scale)
    cfg = dict(negative_prompt=[""] * 2, true_cfg_scale=guidance_scale) if guidance_scale > 1 else {}
    with torch.no_grad():
        stock = kontext.pipeline(image=_images(sources[:2]), prompt=TEXTS, height=PX, width=PX, num_inference_steps=2,
                                 output_type="latent", max_sequence_length=kontext.max_sequence_length,
                                 guidance_scale=kontext.guidance, latents=pack_latents(x), max_area=PX * PX,
                                 _auto_resize=False, **cfg).images
    torch.testing.assert_close(unpack_latents(stock, PX // 2, PX // 2), ours, rtol=1e-4, atol=1e-4)


def stock_kontext_source_size(image, vae_scale_factor, resolutions):
    """``FluxKontextPipeline.__call__``'s source size at its default ``_auto_resize=True``, transcribed:
    the image's size floored to the image processor's factor (2 x VAE), the preferred resolution of
    nearest aspect ratio, each side floored to a multiple of 2 x VAE."""
    multiple = vae_scale_factor * 2
    width, height = (side - side % multiple for side in image.size)
    aspect = width / height
    _, width, height = min((abs(aspect - w / h), w, h) for w, h in resolutions)
    return height // multiple * multiple, width // multiple * multiple


def test_source_sizes_follow_the_stock_pipelines_at_real_scale():
    """FLUX.1 Kontext [dev] and Qwen-Image-Edit (VAE factor 8) on photo-sized sources."""
    from types import SimpleNamespace

    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from PIL import Image

    from diffalign.adapters.flux_kontext import kontext_source_size
    from diffalign.adapters.qwen_edit import qwen_edit_source_size

    real = SimpleNamespace(image_processor=VaeImageProcessor(vae_scale_factor=16), vae_scale_factor=8)
    for width, height in ((1216, 832), (832, 1216), (1024, 1024), (1920, 1080), (640, 1600), (1000, 333)):
        image = Image.new("RGB", (width, height))
        assert kontext_source_size(real, image) == stock_kontext_source_size(image, 8, PREFERRED_KONTEXT_RESOLUTIONS)
        # QwenImageEditPipeline: calculate_dimensions(1024 * 1024, w / h) -> sides rounded to 32 at that area
        w = round(math.sqrt(1024 * 1024 * width / height) / 32) * 32
        h = round(math.sqrt(1024 * 1024 * width / height) / (width / height) / 32) * 32
        assert qwen_edit_source_size(image) == (h, w)
    wide = Image.new("RGB", (1216, 832))
    assert kontext_source_size(real, wide) == (832, 1248) and qwen_edit_source_size(wide) == (832, 1248)


@pytest.mark.parametrize("guidance_scale", [1.0, 2.0])
def test_kontext_matches_stock_pipeline_on_a_non_square_source(wide_sources, guidance_scale, monkeypatch):
    """The pipeline's default sizing (``_auto_resize=True``) on 2:1 sources: the preferred Kontext
    resolutions, divided by 16 for the tiny model's 2x VAE in both, pick 88 x 44; the source latents
    are 44 x 22, not square."""
    import diffusers.pipelines.flux.pipeline_flux_kontext as stock_module

    scaled = [(w // 16, h // 16) for w, h in stock_module.PREFERRED_KONTEXT_RESOLUTIONS]
    monkeypatch.setattr(stock_module, "PREFERRED_KONTEXT_RESOLUTIONS", scaled)
    adapter = load_adapter("tiny:flux_kontext", source_resize="pipeline")
    prompts = [ImagePrompt(t, p) for t, p in zip(TEXTS, wide_sources)]
    assert adapter.encode_sources(_images(wide_sources)).shape == (2, 4, 22, 44)
    x, ours = _rollout(adapter, prompts, guidance_scale)
    cfg = dict(negative_prompt=[""] * 2, true_cfg_scale=guidance_scale) if guidance_scale > 1 else {}
    with torch.no_grad():
        stock = adapter.pipeline(image=_images(wide_sources), prompt=TEXTS, height=PX, width=PX, num_inference_steps=2,
                                 output_type="latent", max_sequence_length=adapter.max_sequence_length,
                                 guidance_scale=adapter.guidance, latents=pack_latents(x), max_area=PX * PX, **cfg).images
    torch.testing.assert_close(unpack_latents(stock, PX // 2, PX // 2), ours, rtol=1e-4, atol=1e-4)
    square = load_adapter("tiny:flux_kontext", source_resize="square", image_resolution=32)
    _, squashed = _rollout(square, prompts, guidance_scale)
    assert (squashed - ours).abs().max() > 1e-3  # the squashed source conditions the model otherwise
    with pytest.raises(ValueError, match="resize to different sizes"):
        adapter.encode_prompts([prompts[0], ImagePrompt(TEXTS[1], _png(wide_sources[0].parent / "tall.png", 3, 80, 40))],
                               with_uncond=False)


def test_kontext_conditioning_rides_in_the_prompt_embeddings(kontext, sources):
    prompts = [ImagePrompt(TEXTS[0], sources[0]), ImagePrompt(TEXTS[0], sources[1])]
    e = kontext.encode_prompts(prompts, with_uncond=True)
    assert e.cond["image_latents"].shape == (2, 4, PX // 2, PX // 2) and e.uncond["image_latents"] is e.cond["image_latents"]
    x = kontext.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(1)).repeat(2, 1, 1, 1)
    t = kontext.make_schedule(4, PX, PX)[[1, 1]]
    with torch.no_grad():
        out = kontext.predict(x, t, PromptEmbeds(e.cond))
        rows = kontext.predict(x[1:], t[1:], e.select([1]).repeat_interleave(1))  # a slice keeps its source rows
        text_only = kontext.predict(x, t, kontext.encode_prompts([TEXTS[0]] * 2, with_uncond=False))
    assert (out[0] - out[1]).abs().max() > 1e-4  # same text, another source: another velocity
    torch.testing.assert_close(rows, out[1:], rtol=1e-4, atol=1e-5)
    assert (text_only[0] - out[0]).abs().max() > 1e-4  # plain prompts: FLUX.1 text-to-image
    with pytest.raises(ValueError, match="mixes"):
        kontext.encode_prompts([prompts[0], "plain"], with_uncond=False)


# ---- Qwen-Image-Edit -------------------------------------------------------------------------
def test_qwen_edit_rollout_matches_stock_pipeline(qwen_edit, sources, monkeypatch):
    """The pipeline resizes sources to a 1024 x 1024 area (``calculate_dimensions``): the test sets
    that area to the tiny model's 32 x 32 (the adapter's ``image_resolution``)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as stock_module

    monkeypatch.setattr(stock_module, "calculate_dimensions", lambda area, ratio: (PX, PX, None))
    prompts = [ImagePrompt(t, p) for t, p in zip(TEXTS, sources)]
    g = 3.0
    x, ours = _rollout(qwen_edit, prompts, g)
    with torch.no_grad():
        stock = qwen_edit.pipeline(image=_images(sources[:2]), prompt=TEXTS, height=PX, width=PX, num_inference_steps=2,
                                   output_type="latent", latents=pack_latents(x),
                                   negative_prompt=[qwen_edit.negative_prompt] * 2, true_cfg_scale=g).images
    torch.testing.assert_close(unpack_latents(stock, PX // 2, PX // 2), ours, rtol=1e-4, atol=1e-4)


def test_qwen_edit_matches_stock_pipeline_on_a_non_square_source(wide_sources, monkeypatch):
    """The pipeline's sizing (``calculate_dimensions`` at the source's aspect ratio) on 2:1 sources,
    its 1024 x 1024 area scaled to 64 x 64 for the tiny model in both (the adapter keeps its default
    ``source_area``): 96 x 32 pixels, latents 48 x 16, and the VL encoder sees that resized image.
    The stock pipeline is called with one source at a time: given a list, its ``image_processor.resize``
    leaves the images as they are and the VL encoder sees them unresized (the latents are resized
    either way)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as stock_module

    from diffalign.adapters.qwen_edit import SOURCE_AREA

    original = stock_module.calculate_dimensions
    monkeypatch.setattr(stock_module, "calculate_dimensions", lambda area, ratio: original(area * 64 * 64 // SOURCE_AREA, ratio))
    adapter = load_adapter("tiny:qwen_edit", source_resize="pipeline")
    prompts = [ImagePrompt(t, p) for t, p in zip(TEXTS, wide_sources)]
    e = adapter.encode_prompts(prompts, with_uncond=False)
    assert e.cond["image_latents"].shape == (2, 4, 16, 48)
    g = 3.0
    x, ours = _rollout(adapter, prompts, g)
    for i, (image, text) in enumerate(zip(_images(wide_sources), TEXTS)):
        with torch.no_grad():
            stock = adapter.pipeline(image=image, prompt=text, height=PX, width=PX, num_inference_steps=2,
                                     output_type="latent", latents=pack_latents(x[i:i + 1]),
                                     negative_prompt=adapter.negative_prompt, true_cfg_scale=g).images
        torch.testing.assert_close(unpack_latents(stock, PX // 2, PX // 2), ours[i:i + 1], rtol=1e-4, atol=1e-4)
    square = load_adapter("tiny:qwen_edit", source_resize="square", image_resolution=32)
    _, squashed = _rollout(square, prompts, g)
    assert (squashed - ours).abs().max() > 1e-3  # the squashed source conditions the model otherwise


def test_qwen_edit_text_encoder_sees_the_image(qwen_edit, sources):
    p = qwen_edit.pipeline
    prefix = p.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(p.tokenizer(prefix).input_ids) == p.prompt_template_encode_start_idx == 64  # the dropped system turn
    e = qwen_edit.encode_prompts([ImagePrompt(TEXTS[0], sources[0]), ImagePrompt(TEXTS[0], sources[1])], with_uncond=True)
    states, mask = e.cond["encoder_hidden_states"], e.cond["encoder_hidden_states_mask"]
    assert qwen_edit.vision_tokens == 4 and states.shape[1] == qwen_edit.max_sequence_length == 16 + 4 + 2
    assert (states[0] - states[1]).abs().max() > 1e-4  # same text, another image: other text states
    assert (e.uncond["encoder_hidden_states"][0] - e.uncond["encoder_hidden_states"][1]).abs().max() > 1e-4
    assert (states[:, mask[0] == 0] == 0).all() and e.cond["image_latents"].shape == (2, 4, PX // 2, PX // 2)
    with pytest.raises(ValueError, match="source image"):
        qwen_edit.encode_prompts(TEXTS, with_uncond=False)


# ---- the editing reward ------------------------------------------------------------------
def test_edit_consistency_by_hand(tmp_path):
    source = torch.zeros(3, PX, PX)
    source[:, :8] = 1.0  # top quarter white
    from PIL import Image

    Image.fromarray((source.permute(1, 2, 0).numpy() * 255).astype("uint8")).save(tmp_path / "s.png")
    small = tmp_path / "small.png"
    Image.fromarray((source.permute(1, 2, 0).numpy()[::2, ::2] * 255).astype("uint8")).save(small)
    same, shifted = source.clone(), (source + 0.25).clamp(0, 1)  # |diff| = 0.25 on 3/4 of the pixels
    r = reward_models.build("edit_consistency", instruction="brightness", instruction_weight=2.0, preservation_weight=0.5)
    meta = [{"source_image": str(tmp_path / "s.png")}, {"source_image": source}]
    out = r(torch.stack([same, shifted]), ["a", "b"], meta)
    keep = torch.tensor([1.0, 1 - 0.25 * 0.75])
    bright = torch.tensor([0.25, 0.25 + 0.75 * 0.25])
    torch.testing.assert_close(out, 2.0 * bright + 0.5 * keep)
    assert r.last_info["preservation"] == pytest.approx(float(keep.mean()))
    assert r.last_info["instruction"] == pytest.approx(float(bright.mean()))
    # a 16 px source is resized to the 32 px edit; identical content stays near 1
    only = reward_models.build("edit_consistency", instruction_weight=0.0)
    assert float(only(same[None], ["a"], [{"source_image": str(small)}])[0]) > 0.95
    with pytest.raises(RewardError, match="sample 0 has no source_image"):
        only(same[None], ["a"], [{}])
    with pytest.raises(RewardError, match="instruction .* is required"):
        reward_models.build("edit_consistency")
    with pytest.raises(RewardError, match="preservation must be one of"):
        reward_models.build("edit_consistency", instruction_weight=0, preservation="lpips")


def test_edit_consistency_clip_preservation(tmp_path, tiny_clip):
    model, tokenizer = tiny_clip
    model.save_pretrained(tmp_path / "clip")
    tokenizer.save_pretrained(tmp_path / "clip")
    r = reward_models.build("edit_consistency", instruction_weight=0.0, preservation="clip", clip_model=str(tmp_path / "clip"))
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, PX, PX, generator=gen), torch.rand(3, PX, PX, generator=gen).pow(3)
    out = r(torch.stack([a, b]), ["x", "y"], [{"source_image": a}, {"source_image": a}])
    assert out[0] == pytest.approx(1.0, abs=1e-5) and out[1] < out[0] - 1e-4


# ---- one training iteration --------------------------------------------------------------
@pytest.mark.parametrize("family", ["flux_kontext", "qwen_edit"])
def test_train_one_iteration(tmp_path, family):
    """The source images reach sampling, re-scoring (on-policy ratio 1) and the reward."""
    out = tmp_path / "run"
    assert run_cli("train", f"configs/tiny/flow_grpo_{family}.yaml", f"output_dir={out}", "max_iterations=1",
                   "eval.num_prompts=1", *FAST) == 0
    record = train_records(out)[0]
    assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and record["optimizer_steps"] == 1
    assert 0 < record["reward/preservation"] <= 1
    recorded = json.loads((out / "prompts.json").read_text())["train"]
    assert all(isinstance(r, dict) and r["image"].endswith(".png") for r in recorded)
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
