"""Model adapters (SD3, FLUX, SD1.5) on tiny random pipelines built in code.

Besides shapes, these check parity with the stock diffusers pipelines: a 2-step sample through
``encode_prompts`` + ``make_schedule`` + ``predict`` equals the pipeline's own ``__call__``.
"""

import json

import numpy as np
import pytest
import torch

from diffalign.adapters import FAMILIES, PromptEmbeds, load_adapter
from diffalign.errors import ModelLoadError
from tests.helpers.adapters import PROMPTS, PX, one_thread, tiny_adapters, times  # noqa: F401 (fixtures)

FAMILY_NAMES = ["sd3", "flux", "sd15"]
adapter = tiny_adapters(FAMILY_NAMES)


# The checks every denoiser adapter must pass run on these too (SDXL and Sana have their own
# file for what is particular to them).
any_adapter = tiny_adapters(FAMILY_NAMES + ["sdxl", "sana"])


def test_tiny_build_facts(adapter):
    assert adapter.family in FAMILIES
    assert adapter.prediction_type == ("epsilon" if adapter.family == "sd15" else "flow")
    assert adapter.default_resolution == PX or adapter.family == "flux"
    assert not any(p.requires_grad for p in adapter.denoiser.parameters())
    assert adapter.config_summary()["denoiser_params"] > 0
    # Every default LoRA target names a module of the denoiser (peft matches by suffix).
    names = [n for n, _ in adapter.denoiser.named_modules()]
    for target in adapter.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


def test_encode_predict_decode_shapes(any_adapter):
    a = any_adapter
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    assert len(e) == 2 and e.uncond is not None and e.uncond.keys() == e.cond.keys()
    assert all(v.shape[0] == 2 for v in [*e.cond.values(), *e.uncond.values()])
    assert a.encode_prompts(PROMPTS, with_uncond=False).uncond is None

    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, *a.latent_shape(PX, PX)) and x.dtype == torch.float32
    with torch.no_grad():
        out = a.predict(x, times(a), e, guidance_scale=3.0)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()

    images = a.decode(x)
    assert images.shape == (2, 3, PX, PX) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    with pytest.raises(ValueError):
        a.latent_shape(PX + 1, PX)


def test_different_prompts_give_different_outputs(any_adapter):
    a = any_adapter
    e = a.encode_prompts(PROMPTS, with_uncond=False)
    x = a.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(1)).repeat(2, 1, 1, 1)
    t = times(a)[:1].repeat(2)
    with torch.no_grad():
        out = a.predict(x, t, e)
    assert (out[0] - out[1]).abs().max() > 1e-4


def test_cfg_is_one_batched_forward_of_the_formula(any_adapter):
    a = any_adapter
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(2))
    t, g = times(a), 4.5
    calls = []
    hook = a.denoiser.register_forward_hook(lambda module, args, output: calls.append(1))
    with torch.no_grad():
        guided = a.predict(x, t, e, guidance_scale=g)
        hook.remove()
        assert len(calls) == 1  # uncond and cond rows in one forward
        cond = a.predict(x, t, PromptEmbeds(e.cond))
        uncond = a.predict(x, t, PromptEmbeds(e.uncond))
        # guidance_scale 1 ignores uncond even when it is present.
        torch.testing.assert_close(a.predict(x, t, e, guidance_scale=1.0), cond, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(guided, uncond + g * (cond - uncond), rtol=1e-4, atol=1e-4)
    # the [uncond; cond] text batch is built on the first guided forward and reused by the next
    batch = e.guidance_batch()
    with torch.no_grad():
        assert torch.equal(a.predict(x, t, e, guidance_scale=g), guided)
    assert e.guidance_batch() is batch
    for k in e.cond:
        assert torch.equal(batch[k], torch.cat([e.uncond[k], e.cond[k]]))


def test_guidance_batch_is_not_kept_for_tensors_with_gradients():
    cond = torch.randn(2, 3, requires_grad=True)
    e = PromptEmbeds({"encoder_hidden_states": cond}, {"encoder_hidden_states": torch.zeros(2, 3)})
    first = e.guidance_batch()
    assert first["encoder_hidden_states"].requires_grad and e.guidance_batch() is not first
    frozen = PromptEmbeds({"encoder_hidden_states": cond.detach()}, {"encoder_hidden_states": torch.zeros(2, 3)})
    assert frozen.guidance_batch() is frozen.guidance_batch()
    assert frozen.select([1]).guidance_batch()["encoder_hidden_states"].shape == (2, 3)  # a new object: its own batch


def test_per_sample_times(any_adapter):
    a = any_adapter
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(3))
    t = times(a)
    assert t[0] != t[1]
    with torch.no_grad():
        both = a.predict(x, t, e, guidance_scale=2.0)
        for i in range(2):
            one = a.predict(x[i : i + 1], t[i : i + 1], e.select([i]), guidance_scale=2.0)
            torch.testing.assert_close(both[i : i + 1], one, rtol=1e-4, atol=1e-5)


def test_to_x0_formula(any_adapter):
    a = any_adapter
    gen = torch.Generator().manual_seed(4)
    x = a.prepare_noise(2, PX, PX, generator=gen)
    out = torch.randn(x.shape, generator=gen)
    t = times(a)
    tb = t.view(-1, 1, 1, 1)
    if a.prediction_type == "flow":
        expected = x - tb * out
    else:
        abar = a.alphas_cumprod[t.long()].view(-1, 1, 1, 1)
        expected = (x - (1 - abar).sqrt() * out) / abar.sqrt()
    torch.testing.assert_close(a.to_x0(out, x, t), expected)


def test_save_and_load_through_from_pretrained(adapter, tmp_path):
    adapter.pipeline.save_pretrained(tmp_path)
    loaded = load_adapter(str(tmp_path))
    assert type(loaded) is type(adapter)
    e_a = adapter.encode_prompts(PROMPTS, with_uncond=True)
    e_b = loaded.encode_prompts(PROMPTS, with_uncond=True)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(5))
    t = times(adapter)
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict(x, t, e_b, 3.0), adapter.predict(x, t, e_a, 3.0), rtol=0, atol=0)
    torch.testing.assert_close(loaded.make_schedule(6, PX, PX), adapter.make_schedule(6, PX, PX), rtol=0, atol=0)
    # Forcing the right family works too.
    assert type(load_adapter(str(tmp_path), family=adapter.family)) is type(adapter)


# ---- schedules ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps", [1, 10])
def test_schedule_matches_stock_scheduler(adapter, num_steps):
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = adapter.make_schedule(num_steps, PX, PX)
    assert sched.shape == (num_steps + 1,) and sched.dtype == torch.float32
    assert (sched[1:] < sched[:-1]).all()
    config = adapter.pipeline.scheduler.config
    if adapter.family == "sd15":
        stock = DDIMScheduler.from_config(config)
        stock.set_timesteps(num_steps)
        assert stock.config.timestep_spacing == "leading" and stock.config.steps_offset == 1
        assert sched[:-1].tolist() == stock.timesteps.float().tolist() and sched[-1] == -1
        return
    stock = FlowMatchEulerDiscreteScheduler.from_config(config)
    if adapter.family == "flux":  # what FluxPipeline.__call__ does
        h = PX // adapter.vae_scale_factor
        mu = calculate_shift((h // 2) ** 2, 256, 4096, 0.5, 1.15)
        stock.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        assert config.shift == 3.0 and not config.use_dynamic_shifting
        stock.set_timesteps(num_steps)
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)
    assert sched[0] == 1.0 and sched[-1] == 0.0


def test_adapter_options_reach_tiny_builds():
    flux = load_adapter("tiny:flux", guidance=2.0, max_sequence_length=8)
    assert flux.guidance == 2.0 and flux.encode_prompts(["a cat"], with_uncond=False).cond["encoder_hidden_states"].shape[1] == 8
    assert load_adapter("tiny:sd3", max_sequence_length=8).max_sequence_length == 8


def test_adapter_options_are_the_constructor_keywords():
    """``from_pretrained`` hands the kwargs named in ``options`` to the constructor, the rest to
    the pipeline: the tuple must list exactly the constructor's keyword-only options."""
    import inspect

    from diffalign.adapters import adapter_class

    for family in FAMILIES:
        cls = adapter_class(family)
        if "from_pretrained" in vars(cls):  # shapes loads its own pipeline class
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("device", "dtype")]
        assert list(cls.options) == keywords, family


def test_sd15_final_alpha_and_alpha_lookup():
    a = load_adapter("tiny:sd15")
    assert a.alphas_cumprod.shape == (1000,)
    # SD1.5: set_alpha_to_one=False, so the final abar is abar_0.
    assert a.final_alpha_cumprod == a.alphas_cumprod[0]
    abar = a.alpha_cumprod_at(torch.tensor([999.0, 0.0, -1.0]))
    assert abar.tolist() == [a.alphas_cumprod[999].item(), a.alphas_cumprod[0].item(), a.final_alpha_cumprod.item()]


def test_sd15_v_prediction_is_converted_to_epsilon():
    a = load_adapter("tiny:sd15")
    e = a.encode_prompts(PROMPTS[:1], with_uncond=False)
    x = a.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([501.0])
    with torch.no_grad():
        raw = a.predict(x, t, e)  # the UNet output, read as epsilon
        a.model_prediction_type = "v_prediction"  # same UNet output, now read as v
        eps = a.predict(x, t, e)
    abar = a.alphas_cumprod[501]
    torch.testing.assert_close(eps, abar.sqrt() * raw + (1 - abar).sqrt() * x)


def test_sd15_refuses_sample_prediction():
    from diffusers import DDIMScheduler

    a = load_adapter("tiny:sd15")
    a.pipeline.scheduler = DDIMScheduler.from_config(a.pipeline.scheduler.config, prediction_type="sample")
    with pytest.raises(ModelLoadError, match="sample"):
        type(a)(a.pipeline)


# ---- parity with the stock pipelines -----------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_step_sample_matches_stock_pipeline(family):
    """Euler (flow) / DDIM eta=0 (sd15) with the adapter == ``pipeline(..., output_type="latent")``."""
    from diffusers import DDIMScheduler

    a = load_adapter(f"tiny:{family}")
    steps, g = 2, 3.0
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    sched = a.make_schedule(steps, PX, PX)
    ours = x.clone()
    with torch.no_grad():
        for s, s_next in zip(sched[:-1], sched[1:]):
            t = s.repeat(2)
            out = a.predict(ours, t, e, guidance_scale=g)
            if a.prediction_type == "flow":
                ours = ours + (s_next - s) * out
            else:
                abar_next = a.alpha_cumprod_at(s_next)
                ours = abar_next.sqrt() * a.to_x0(out, ours, t) + (1 - abar_next).sqrt() * out

    kwargs = dict(height=PX, width=PX, num_inference_steps=steps, output_type="latent")
    if family == "flux":  # FLUX.1-dev: distilled guidance in, true CFG with the empty negative prompt
        a.guidance = 2.0
        with torch.no_grad():
            ours_dev = x.clone()
            e_cond = PromptEmbeds(e.cond)
            for s, s_next in zip(sched[:-1], sched[1:]):
                ours_dev = ours_dev + (s_next - s) * a.predict(ours_dev, s.repeat(2), e_cond)
        from diffalign.adapters.flux import pack_latents, unpack_latents

        common = dict(kwargs, prompt=PROMPTS, latents=pack_latents(x), max_sequence_length=a.max_sequence_length)
        stock = a.pipeline(**common, guidance_scale=2.0).images
        torch.testing.assert_close(unpack_latents(stock, *x.shape[2:]), ours_dev, rtol=1e-4, atol=1e-4)
        a.guidance = 3.5
        stock = a.pipeline(**common, guidance_scale=3.5, negative_prompt=["", ""], true_cfg_scale=g).images
        stock = unpack_latents(stock, *x.shape[2:])
    elif family == "sd3":
        stock = a.pipeline(prompt=PROMPTS, latents=x, guidance_scale=g, max_sequence_length=a.max_sequence_length, **kwargs).images
    else:
        a.pipeline.scheduler = DDIMScheduler.from_config(a.pipeline.scheduler.config)
        stock = a.pipeline(prompt=PROMPTS, latents=x, guidance_scale=g, eta=0.0, **kwargs).images
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-4)


def test_flux_packing_is_the_pipelines():
    """pack / unpack are exactly FluxPipeline's own (static) packing, in fp32 and bf16."""
    from diffusers import FluxPipeline

    from diffalign.adapters.flux import pack_latents, unpack_latents

    for shape, dtype in [((2, 16, 8, 6), torch.float32), ((3, 4, 16, 16), torch.bfloat16)]:
        x = torch.randn(shape).to(dtype)
        b, c, h, w = shape
        tokens = pack_latents(x)
        assert tokens.is_contiguous()
        assert torch.equal(tokens, FluxPipeline._pack_latents(x, b, c, h, w))
        assert torch.equal(unpack_latents(tokens, h, w), x)
        # the pipeline unpacks from pixel sizes with vae_scale_factor 8: latent side = 2 * (px // 16)
        assert torch.equal(FluxPipeline._unpack_latents(tokens, h * 8, w * 8, 8), unpack_latents(tokens, h, w))


def test_flux_rotary_tables_are_computed_once_per_rollout_and_not_for_the_pipeline():
    """predict reuses FLUX's rotary tables across steps (same velocity as recomputing them); the
    stock pipeline on the same object still recomputes them; deep copies keep working."""
    import copy

    from diffalign.adapters._util import rotary_cache

    a = load_adapter("tiny:flux")
    pos_embed = a.pipeline.transformer.pos_embed
    calls = []
    compute = type(pos_embed).forward
    x = torch.randn(2, *a.latent_shape(PX, PX), generator=torch.Generator().manual_seed(0))
    e = a.encode_prompts(PROMPTS, with_uncond=False)
    with torch.no_grad():
        first = [a.predict(x, torch.full((2,), s), e) for s in (1.0, 0.5)]
        cache = pos_embed._rotary_cache
        assert cache.hits == 1  # the second step's tables came from the first
        for s, ours in zip((1.0, 0.5), first):
            cache._ids = None  # forget: recompute the tables
            assert torch.equal(a.predict(x, torch.full((2,), s), e), ours)
        assert cache.hits == 1
        pos_embed.forward.__self__.compute = lambda ids: (calls.append(1), compute(pos_embed, ids))[1]
        a.pipeline(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=2, output_type="latent",
                   max_sequence_length=a.max_sequence_length)
        assert len(calls) == 2 and cache.hits == 1  # the pipeline's own loop: one computation per step
        twin = copy.deepcopy(a.pipeline.transformer)
        out = twin(hidden_states=torch.randn(1, 16, 16), timestep=torch.ones(1), guidance=torch.ones(1),
                   pooled_projections=e.cond["pooled_projections"][:1], encoder_hidden_states=e.cond["encoder_hidden_states"][:1],
                   txt_ids=torch.zeros(e.cond["encoder_hidden_states"].shape[1], 3), img_ids=torch.zeros(16, 3), return_dict=False)[0]
        assert out.shape == (1, 16, 16)
    # only parameter-free modules are cached: a module with weights could change without its ids
    assert rotary_cache(torch.nn.Linear(2, 2)) is None and rotary_cache(None) is None


# ---- load_adapter resolution and errors --------------------------------------------------
def test_default_alias_resolves_lazily_through_the_shapes_family(monkeypatch, tmp_path):
    calls = []

    class FakeShapes:
        family = "shapes"

        @staticmethod
        def default_model_path():
            return tmp_path

        @classmethod
        def from_pretrained(cls, model_id, *, device, dtype, **kwargs):
            calls.append(model_id)
            return "adapter"

    import diffalign.adapters as adapters

    monkeypatch.setattr(adapters, "adapter_class", lambda family, model_id=None: FakeShapes)
    assert load_adapter("default") == "adapter" and load_adapter("shapes") == "adapter"
    assert calls == [str(tmp_path)] * 2


def test_local_folder_picks_family_from_model_index(monkeypatch, tmp_path):
    seen = {}

    class Fake:
        family = "flux"

        @classmethod
        def from_pretrained(cls, model_id, *, device, dtype, **kwargs):
            seen.update(model_id=model_id, kwargs=kwargs)
            return "ok"

    import diffalign.adapters as adapters

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    monkeypatch.setattr(adapters, "adapter_class", lambda family, model_id=None: Fake if family == "flux" else None)
    assert load_adapter(str(tmp_path), guidance=2.0) == "ok"
    assert seen == {"model_id": str(tmp_path), "kwargs": {"guidance": 2.0}}


def test_bad_ids_raise_model_load_error(tmp_path, monkeypatch):
    import diffalign.adapters as adapters

    def raises(model_id, match=None, **kwargs):
        with pytest.raises(ModelLoadError) as info:
            load_adapter(model_id, **kwargs)
        message = str(info.value)
        assert "\n" not in message
        assert str(model_id) in message or (match and match in message), message
        return message

    assert "does not exist" in raises("./no/such/model")
    assert "does not exist" in raises("~/no-such-model-dir-xyz")
    assert "known families" in raises("tiny:nope")
    assert "no_such_option" in raises("tiny:sd15", no_such_option=1)
    assert "'nope'" in raises("tiny:sd3", match="nope", family="nope")
    assert "no model_index.json" in raises(str(tmp_path))  # an empty folder
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    assert "KandinskyPipeline" in raises(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{not json")
    raises(str(tmp_path))
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    raises(str(a_file))

    # Hub ids: a Hub that cannot be reached is said at once, naming the closest local name
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    message = raises("shapess")
    assert "cannot be looked up (127.0.0.1 cannot be reached" in message and "did you mean 'shapes'?" in message
    # a Hub that answers "not found" at once

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(adapters, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert "family=" in raises("someone/some-model")
    # With a family given, from_pretrained itself fails (nothing cached, no downloads allowed).
    assert "sd3" in raises("someone/some-model", family="sd3", local_files_only=True)
