"""The embedded shapes model: diffusers round trip, adapter contract, shipped weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from diffalign.adapters.base import PromptEmbeds
from diffalign.adapters.shapes import ShapesAdapter
from diffalign.shapes.model import TINY_CONFIG, build_pipeline, build_tokenizer
from diffalign.shapes.pipeline import SHIPPED_MODEL_DIR, ShapesPipeline
from diffalign.shapes.world import split_prompts, vocabulary

SHIPPED = os.path.isfile(os.path.join(SHIPPED_MODEL_DIR, "model_index.json"))
needs_shipped = pytest.mark.skipif(not SHIPPED, reason=f"shipped weights not found in {SHIPPED_MODEL_DIR} (run scripts/pretrain_shapes.py)")
PROMPTS = ["a photo of a red circle", "a photo of two squares", ""]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return ShapesAdapter.build_tiny(seed=0)


@pytest.fixture(scope="module")
def shipped():
    if not SHIPPED:
        pytest.skip(f"shipped weights not found in {SHIPPED_MODEL_DIR}")
    return ShapesAdapter.from_pretrained(SHIPPED_MODEL_DIR)


def _sample(pipe, prompts, steps=3, cfg=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return pipe(prompts, num_inference_steps=steps, guidance_scale=cfg, generator=gen, output_type="pt").images


# ---- tokenizer --------------------------------------------------------------------------------
def test_every_vocabulary_word_is_one_token_and_round_trips(tmp_path):
    tok = build_tokenizer(vocabulary())
    tok.save_pretrained(tmp_path)
    loaded = type(tok).from_pretrained(tmp_path)
    seen = set()
    for t in (tok, loaded):
        for word in vocabulary():
            ids = t(word).input_ids
            assert len(ids) == 3, (word, t.convert_ids_to_tokens(ids))  # <bos> word <eos>
            assert t.convert_ids_to_tokens(ids[1]) == word + "</w>"
            assert t.decode(ids, skip_special_tokens=True) == word
            seen.add(ids[1])
    assert len(seen) == len(vocabulary())  # distinct ids, identical before and after saving
    prompt = "a photo of a red circle and a blue triangle"
    assert loaded(prompt).input_ids == tok(prompt).input_ids
    assert len(tok(prompt).input_ids) == 12 <= tok.model_max_length


def test_tokenizer_rejects_non_words():
    with pytest.raises(ValueError, match="letters only"):
        build_tokenizer(["red", "x2"])


# ---- diffusers round trip ---------------------------------------------------------------------
def test_tiny_pipeline_round_trips_through_diffusers(tmp_path):
    pipe = build_pipeline(config=TINY_CONFIG, seed=0)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "ShapesPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]

    loaded = ShapesPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    a, b = _sample(pipe, PROMPTS), _sample(loaded, PROMPTS)
    assert a.shape == (3, 3, 32, 32) and a.dtype == torch.float32
    assert 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, b)
    pil = loaded(PROMPTS[:1], num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    assert pil[0].size == (32, 32)


@pytest.mark.parametrize("encoder,model_class", [("bert", "BertModel"), ("t5", "T5EncoderModel")])
def test_bidirectional_encoders_see_the_relation_and_round_trip_through_the_adapter(tmp_path, encoder, model_class):
    """With a bidirectional ``text_encoder`` the first shape's token of "a circle left of a square"
    depends on the relation word after it (CLIP's causal attention makes it identical); the
    pipeline saves and loads through ``load_adapter`` like the CLIP one."""
    import dataclasses

    from diffalign.adapters import load_adapter

    prompts = ["a circle left of a square", "a circle right of a square"]
    clip = build_pipeline(config=TINY_CONFIG, seed=0)
    other = build_pipeline(config=dataclasses.replace(TINY_CONFIG, text_encoder=encoder), seed=0)
    circle = 2  # <bos> a circle ...
    c, t = clip.encode_prompt(prompts), other.encode_prompt(prompts)
    assert torch.equal(c[0, : circle + 1], c[1, : circle + 1])
    assert (t[0, circle] - t[1, circle]).abs().max() > 1e-4
    other.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["text_encoder"] == ["transformers", model_class]
    adapter = load_adapter(str(tmp_path))
    assert torch.equal(adapter.pipeline.encode_prompt(prompts), t)


def test_unknown_text_encoder_is_a_clear_error():
    import dataclasses

    with pytest.raises(ValueError, match="text_encoder"):
        build_pipeline(config=dataclasses.replace(TINY_CONFIG, text_encoder="gpt"))


# ---- adapter contract -------------------------------------------------------------------------
def test_adapter_basics(tiny):
    assert (tiny.family, tiny.prediction_type, tiny.default_resolution) == ("shapes", "flow", 32)
    assert tiny.latent_shape(32, 32) == (3, 32, 32)
    assert tiny.denoiser is tiny.pipeline.unet
    assert tiny.frozen_modules() == [tiny.pipeline.text_encoder]
    assert not any(p.requires_grad for p in tiny.pipeline.text_encoder.parameters())
    assert ShapesAdapter.default_model_path() == SHIPPED_MODEL_DIR

    sched = tiny.make_schedule(10, 32, 32)
    assert sched.shape == (11,) and sched.dtype == torch.float32
    assert sched[0] == 1.0 and sched[-1] == 0.0 and bool((sched[1:] < sched[:-1]).all())
    ref = type(tiny.pipeline.scheduler).from_config(tiny.pipeline.scheduler.config)
    ref.set_timesteps(10)
    torch.testing.assert_close(sched, ref.sigmas.float())

    x0 = torch.rand(2, 3, 32, 32) * 2 - 1
    eps, t = torch.randn_like(x0), torch.tensor([0.3, 0.9])
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    torch.testing.assert_close(tiny.to_x0(eps - x0, x_t, t), x0)  # exact velocity -> exact x0
    img = tiny.decode(torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5))
    torch.testing.assert_close(img[0, 0, 0], torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))


def test_cfg_is_one_forward_and_equals_two_forwards(tiny):
    prompts = PROMPTS[:2]
    embeds = tiny.encode_prompts(prompts, with_uncond=True)
    assert isinstance(embeds, PromptEmbeds) and len(embeds) == 2
    assert embeds.uncond["encoder_hidden_states"].shape == embeds.cond["encoder_hidden_states"].shape
    x, t, g = torch.randn(2, 3, 32, 32), torch.tensor([0.8, 0.4]), 4.0

    calls = []
    hook = tiny.denoiser.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    try:
        guided = tiny.predict(x, t, embeds, guidance_scale=g)
    finally:
        hook.remove()
    assert calls == [4]  # [uncond; cond] in one batched forward

    cond = tiny.predict(x, t, PromptEmbeds(embeds.cond), guidance_scale=1.0)
    uncond = tiny.predict(x, t, PromptEmbeds(embeds.uncond), guidance_scale=1.0)
    torch.testing.assert_close(guided, uncond + g * (cond - uncond), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tiny.predict(x, t, embeds, guidance_scale=1.0), cond)


def test_pipeline_sampler_matches_adapter_euler_loop(tiny):
    """The pipeline's __call__ (stock scheduler.step) == an Euler loop on adapter.predict."""
    prompts, steps, g = PROMPTS[:2], 4, 3.0
    noise = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ref = tiny.pipeline(prompts, num_inference_steps=steps, guidance_scale=g, latents=noise, output_type="latent").images
    embeds = tiny.encode_prompts(prompts, with_uncond=True)
    sigmas = tiny.make_schedule(steps, 32, 32)
    x = noise.clone()
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (s_next - s) * tiny.predict(x, s.expand(2), embeds, guidance_scale=g)
    torch.testing.assert_close(x, ref, atol=1e-5, rtol=1e-5)


def test_default_lora_targets_exist_in_unet(tiny):
    names = [n for n, _ in tiny.denoiser.named_modules()]
    for target in ShapesAdapter.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


# ---- coordinate channels ----------------------------------------------------------------------
def test_coordinate_planes_give_each_pixel_its_column_and_row():
    from diffalign.shapes.model import coordinate_planes

    planes = coordinate_planes(2, 3, 5)
    assert planes.shape == (2, 2, 3, 5)
    torch.testing.assert_close(planes[0, 0, 1], torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))  # x: left to right
    torch.testing.assert_close(planes[1, 1, :, 4], torch.tensor([-1.0, 0.0, 1.0]))  # y: top to bottom


def test_coordinate_unet_widened_from_a_plain_one_computes_the_same_and_round_trips(tmp_path):
    import dataclasses

    from diffalign.shapes.model import uses_coordinates, widen_for_coordinates

    plain = build_pipeline(config=TINY_CONFIG, seed=0)
    coord = build_pipeline(config=dataclasses.replace(TINY_CONFIG, coordinate_channels=True), seed=1)
    assert not uses_coordinates(plain.unet) and uses_coordinates(coord.unet)
    assert coord.unet.config.in_channels == 5 and coord.unet.config.out_channels == 3
    widen_for_coordinates(coord.unet, plain.unet)
    coord.text_encoder.load_state_dict(plain.text_encoder.state_dict())
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([700.0, 200.0])
    context = plain.encode_prompt(PROMPTS[:2])
    with torch.no_grad():
        ref = plain.unet(x, t, encoder_hidden_states=context).sample
        out = coord.unet(x, t, encoder_hidden_states=context).sample  # 3 channels in: the planes are appended
        out_kw = coord.unet(sample=x, timestep=t, encoder_hidden_states=context).sample
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, out_kw)

    with torch.no_grad():  # the new input weights now matter: the output depends on where a pixel is
        coord.unet.conv_in.weight[:, 3:] = 0.1
        moved = coord.unet(x, t, encoder_hidden_states=context).sample
    assert not torch.allclose(moved, ref, atol=1e-3)
    coord.save_pretrained(tmp_path)  # a plain diffusers UNet with 5 input channels ...
    assert json.loads((tmp_path / "unet" / "config.json").read_text())["in_channels"] == 5
    loaded = ShapesPipeline.from_pretrained(tmp_path)  # ... whose pipeline appends the planes again
    with torch.no_grad():
        torch.testing.assert_close(loaded.unet(x, t, encoder_hidden_states=context).sample, moved)
    adapter = ShapesAdapter(loaded)
    embeds = adapter.encode_prompts(PROMPTS[:2], with_uncond=False)
    with torch.no_grad():
        torch.testing.assert_close(adapter.predict(x, t / 1000.0, embeds), moved)


def test_coordinate_unet_trains_with_lora():
    import dataclasses

    from peft import LoraConfig

    pipe = build_pipeline(config=dataclasses.replace(TINY_CONFIG, coordinate_channels=True), seed=0)
    unet = pipe.unet
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([500.0, 100.0])
    loss = unet(x, t, encoder_hidden_states=pipe.encode_prompt(PROMPTS[:2])).sample.square().mean()
    loss.backward()
    grads = [p.grad for n, p in unet.named_parameters() if "lora" in n]
    assert grads and all(g is not None for g in grads)


# ---- shipped model ----------------------------------------------------------------------------
@needs_shipped
def test_shipped_model_is_small_and_loads(shipped):
    size = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(SHIPPED_MODEL_DIR) for f in files
    )
    assert size < 20e6
    assert shipped.denoiser.dtype == torch.float32
    assert shipped.pipeline.unet.config.block_out_channels == [32, 64, 128]


@needs_shipped
def test_shipped_model_loads_through_registry():
    adapters = pytest.importorskip("diffalign.adapters")
    if not hasattr(adapters, "load_adapter"):
        pytest.skip("diffalign.adapters.load_adapter does not exist yet")
    adapter = adapters.load_adapter("shapes")
    assert isinstance(adapter, ShapesAdapter)
    assert adapter.family == "shapes"


@needs_shipped
def test_shipped_model_draws_single_objects(shipped):
    reward_models = pytest.importorskip("reward_models")
    if "shapes_eval" not in reward_models.available():
        pytest.skip("reward 'shapes_eval' is not registered yet")
    from diffalign.shapes.world import prompt_family

    train = split_prompts(seed=0).train
    prompts = [p for p in train if prompt_family(p) in ("single_object", "colors")]
    prompts = (prompts * 4)[:16]
    images = _sample(shipped.pipeline, prompts, steps=10, cfg=2.0, seed=0)
    assert images.shape == (16, 3, 32, 32)
    assert images.min() >= 0 and images.max() <= 1
    scores = reward_models.build("shapes_eval")(images, prompts, [{} for _ in prompts])
    assert scores.float().mean() >= 0.1, scores


@needs_shipped
def test_shipped_model_has_the_default_architecture(shipped):
    """The shipped UNet is what ``ShapesModelConfig()`` builds (cross-attention at 16x16 and 8x8)."""
    from diffalign.shapes.model import ShapesModelConfig, build_unet

    built = build_unet(ShapesModelConfig()).config
    config = shipped.pipeline.unet.config
    def plain(value):  # a config read back from JSON holds lists where the built one holds tuples
        return list(value) if isinstance(value, (list, tuple)) else value

    for key in ("down_block_types", "up_block_types", "block_out_channels", "addition_embed_type", "cross_attention_dim"):
        assert plain(config[key]) == plain(built[key]), key
    assert list(config.down_block_types) == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]


@needs_shipped
def test_shipped_model_binds_colours_to_objects(shipped):
    """Colour attribution ("a red circle and a blue square") on training prompts: the shipped model
    draws both objects in their own colours in about a third of the images; the earlier model with
    cross-attention at 8x8 only did in 3 of these 32 (it painted both objects alike)."""
    from diffalign.shapes.world import prompt_family
    from reward_models import build

    train = split_prompts(seed=0).train
    prompts = [p for p in train if prompt_family(p) == "color_attr"][:32]
    images = _sample(shipped.pipeline, prompts, steps=20, cfg=4.0, seed=0)
    passed = int(build("shapes_eval")(images, prompts, [{} for _ in prompts]).sum())
    assert passed >= 7, f"{passed} of {len(prompts)} colour-attribution images passed"
