"""Qwen-Image, FLUX.2 [klein] and Wan2.1 (text-to-video) adapters on tiny random pipelines.

The checks of ``test_adapters.py`` (shapes, CFG in one forward, per-sample times, Tweedie,
save / load, schedule == the pipeline's, a 2-step deterministic rollout == the pipeline's own
``__call__``) plus what is particular to each family: Qwen-Image's norm-rescaled CFG and padded
text, FLUX.2's patchified latents and step-distilled variants, Wan's frame axis; the video
reward rule; one training iteration of each through the CLI.
"""

import json

import pytest
import torch

from diffalign.adapters import FAMILIES, PIPELINE_FAMILIES, PromptEmbeds, load_adapter
from diffalign.errors import ModelLoadError, RewardError
from tests.helpers.adapters import PROMPTS, PX, assert_loaded_equals, ode_rollout, one_thread, tiny_adapters, times  # noqa: F401 (fixtures)
from tests.helpers.tiny_run import FAST, run_cli

FAMILY_NAMES = ["qwen", "flux2", "wan"]
adapter = tiny_adapters(FAMILY_NAMES)


def guide(adapter, uncond, cond, g):
    """The family's CFG formula on unpacked outputs."""
    if adapter.family == "qwen":  # per packed token: comb rescaled to the cond norm
        from diffalign.adapters.flux import pack_latents, unpack_latents
        from diffalign.adapters.qwen import rescaled_cfg

        return unpack_latents(rescaled_cfg(pack_latents(uncond), pack_latents(cond), g), *cond.shape[2:])
    return uncond + g * (cond - uncond)


def test_registered_and_listed(capsys):
    for family, pipeline in [("qwen", "QwenImagePipeline"), ("flux2", "Flux2KleinPipeline"), ("wan", "WanPipeline")]:
        assert family in FAMILIES and PIPELINE_FAMILIES[pipeline] == family
    assert run_cli("list") == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in FAMILY_NAMES) and "temporal_consistency" in listed


def test_tiny_build_facts(adapter):
    assert adapter.prediction_type == "flow"
    assert not any(p.requires_grad for p in adapter.denoiser.parameters())
    assert not any(p.requires_grad for m in adapter.frozen_modules() for p in m.parameters())
    names = [n for n, _ in adapter.denoiser.named_modules()]
    for target in adapter.default_lora_targets:  # peft matches by suffix
        assert any(n == target or n.endswith("." + target) for n in names), target


def test_encode_predict_decode_shapes(adapter):
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    assert len(e) == 2 and e.uncond is not None and e.uncond.keys() == e.cond.keys()
    assert adapter.encode_prompts(PROMPTS, with_uncond=False).uncond is None
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, *adapter.latent_shape(PX, PX)) and x.dtype == torch.float32
    with torch.no_grad():
        out = adapter.predict(x, times(adapter), e, guidance_scale=3.0)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    images = adapter.decode(x)
    frames = (adapter.num_frames,) if adapter.family == "wan" else ()
    assert images.shape == (2, *frames, 3, PX, PX) and images.min() >= 0 and images.max() <= 1
    with pytest.raises(ValueError):
        adapter.latent_shape(PX + 2, PX)


def test_cfg_per_sample_times_and_prompts(adapter):
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(2))
    t, g = times(adapter), 4.5
    with torch.no_grad():
        guided = adapter.predict(x, t, e, guidance_scale=g)
        cond = adapter.predict(x, t, PromptEmbeds(e.cond))
        uncond = adapter.predict(x, t, PromptEmbeds(e.uncond))
        torch.testing.assert_close(adapter.predict(x, t, e, guidance_scale=1.0), cond, rtol=1e-4, atol=1e-5)
        one = adapter.predict(x[1:], t[1:], e.select([1]), guidance_scale=g)
        same_x = adapter.predict(x[:1].repeat(2, *[1] * (x.ndim - 1)), t[:1].repeat(2), PromptEmbeds(e.cond))
    torch.testing.assert_close(guided, guide(adapter, uncond, cond, g), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(guided[1:], one, rtol=1e-4, atol=1e-5)
    assert (same_x[0] - same_x[1]).abs().max() > 1e-4  # different prompts, different outputs
    torch.testing.assert_close(adapter.to_x0(cond, x, t), x - t.view(-1, *[1] * (x.ndim - 1)) * cond)


def test_save_and_load_through_from_pretrained(adapter, tmp_path):
    adapter.pipeline.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert PIPELINE_FAMILIES[index["_class_name"]] == adapter.family
    options = {"max_sequence_length": adapter.max_sequence_length}  # the real default is 512
    if adapter.family == "flux2":
        options["text_encoder_out_layers"] = adapter.text_encoder_out_layers
    if adapter.family == "wan":
        options["num_frames"] = adapter.num_frames
    loaded = load_adapter(str(tmp_path), **options)
    assert type(loaded) is type(adapter)
    assert_loaded_equals(loaded, adapter)


# ---- parity with the stock pipelines -----------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_step_sample_matches_stock_pipeline(family):
    """diffalign's deterministic rollout (``sample_linear`` with the flow ODE, zero noise) ==
    ``pipeline(..., output_type="latent")`` from the same noise, CFG on."""
    from diffalign.adapters.flux import pack_latents, unpack_latents
    a = load_adapter(f"tiny:{family}")
    steps, g = 2, 3.0
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    traj = ode_rollout(a, x, g, steps)
    ours = traj.latents[:, -1]
    common = dict(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, output_type="latent",
                  max_sequence_length=a.max_sequence_length)
    with torch.no_grad():
        if family == "qwen":  # packed latents in and out; true CFG with the model card's negative prompt
            stock = a.pipeline(**common, latents=pack_latents(x), negative_prompt=[a.negative_prompt] * 2, true_cfg_scale=g).images
            stock = unpack_latents(stock, *x.shape[2:])
        elif family == "flux2":  # the pipeline returns the VAE's (un-normalised, un-patchified) latents
            stock = a.pipeline(**common, latents=x, guidance_scale=g, text_encoder_out_layers=a.text_encoder_out_layers).images
            ours = a.vae_latents(ours)
        else:
            stock = a.pipeline(**common, latents=x, guidance_scale=g, num_frames=a.num_frames).frames
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_steps", [1, 10])
def test_schedule_matches_the_pipeline(adapter, num_steps):
    """The sigmas the pipeline's own ``__call__`` sets (its ``retrieve_timesteps`` arguments)."""
    import numpy as np

    if adapter.family == "qwen" and num_steps == 1:  # shift_terminal: 0 / 0 in the scheduler, NaN in the pipeline too
        with pytest.raises(ValueError, match="shift_terminal"):
            adapter.make_schedule(num_steps, PX, PX)
        return
    sched = adapter.make_schedule(num_steps, PX, PX)
    assert sched.shape == (num_steps + 1,) and sched[0] == 1.0 and sched[-1] == 0.0 and (sched[1:] < sched[:-1]).all()
    stock = type(adapter.pipeline.scheduler).from_config(adapter.pipeline.scheduler.config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    _, h, w = adapter.latent_shape(PX, PX)[-3:]
    if adapter.family == "qwen":
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        stock.set_timesteps(sigmas=sigmas, mu=calculate_shift((h // 2) * (w // 2), 256, 8192, 0.5, 0.9))
    elif adapter.family == "flux2":
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        stock.set_timesteps(sigmas=sigmas, mu=compute_empirical_mu(h * w, num_steps))
    else:
        stock.set_timesteps(num_steps)
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)


# ---- family specifics --------------------------------------------------------------------
def test_qwen_template_prefix_and_padding():
    a = load_adapter("tiny:qwen")
    p = a.pipeline
    prefix = p.prompt_template_encode.split("{}")[0]
    assert len(p.tokenizer(prefix).input_ids) == p.prompt_template_encode_start_idx  # the 34 dropped tokens
    e = a.encode_prompts(PROMPTS, with_uncond=False).cond
    stock, mask = p.encode_prompt(PROMPTS, max_sequence_length=a.max_sequence_length)
    n = stock.shape[1]
    assert e["encoder_hidden_states"].shape[1] == a.max_sequence_length > n
    torch.testing.assert_close(e["encoder_hidden_states"][:, :n], stock)
    assert (e["encoder_hidden_states"][:, n:] == 0).all() and (e["encoder_hidden_states_mask"][:, n:] == 0).all()
    with pytest.raises(ModelLoadError, match="max_sequence_length"):
        load_adapter("tiny:qwen", max_sequence_length=2000)


def test_flux2_distilled_ignores_guidance():
    a = load_adapter("tiny:flux2")
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(3))
    t = times(a)
    a.is_distilled = True
    with torch.no_grad():
        torch.testing.assert_close(a.predict(x, t, e, guidance_scale=4.0), a.predict(x, t, PromptEmbeds(e.cond)))


def test_wan_frames_options_and_refusals():
    a = load_adapter("tiny:wan", num_frames=9)
    assert a.latent_shape(PX, PX) == (4, 5, PX // 2, PX // 2)  # (9 - 1) / 2 + 1 latent frames
    with pytest.raises(ModelLoadError, match="num_frames"):
        load_adapter("tiny:wan", num_frames=4)
    a.pipeline.register_to_config(boundary_ratio=0.875)  # a Wan2.2 two-expert pipeline
    with pytest.raises(ModelLoadError, match="Wan2.2"):
        type(a)(a.pipeline)


def test_wan_unipc_scheduler_integer_timesteps_and_two_step_parity():
    """The released Wan2.1 checkpoints ship UniPC with flow sigmas: integer timesteps for the
    transformer, and for 2 steps the same sample as the pipeline (first-order steps == Euler)."""
    from diffusers import UniPCMultistepScheduler

    a = load_adapter("tiny:wan")
    a.pipeline.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    a = type(a)(a.pipeline, num_frames=5, max_sequence_length=16)
    assert a.integer_timesteps
    sched = a.make_schedule(2, PX, PX)
    stock_scheduler = UniPCMultistepScheduler.from_config(a.pipeline.scheduler.config)
    stock_scheduler.set_timesteps(2)
    assert a.model_timestep(sched[:-1]).tolist() == stock_scheduler.timesteps.float().tolist()
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    traj = ode_rollout(a, x, 3.0, 2, schedule=sched)
    with torch.no_grad():
        stock = a.pipeline(prompt=PROMPTS, latents=x, guidance_scale=3.0, height=PX, width=PX, num_frames=5,
                           num_inference_steps=2, output_type="latent", max_sequence_length=16).frames
    torch.testing.assert_close(stock, traj.latents[:, -1], rtol=1e-4, atol=1e-4)


# ---- rewards on videos -------------------------------------------------------------------
def test_video_reward_is_the_mean_of_frame_rewards():
    import reward_models

    gen = torch.Generator().manual_seed(0)
    videos = torch.rand(2, 3, 3, 8, 8, generator=gen)
    seen = {}

    def per_image(images, prompts, metadata):
        seen["prompts"] = list(prompts)
        return images.mean(dim=(1, 2, 3))

    out = reward_models.call_reward(per_image, videos, ["a", "b"], [{}, {}])
    torch.testing.assert_close(out, videos.mean(dim=(2, 3, 4)).mean(dim=1))
    assert seen["prompts"] == ["a", "a", "a", "b", "b", "b"]
    images = videos[:, 0]
    torch.testing.assert_close(reward_models.call_reward(per_image, images, ["a", "b"], [{}, {}]), images.mean(dim=(1, 2, 3)))
    # A registered image reward (JPEG size) through the same rule.
    jpeg = reward_models.build("jpeg_compressibility")
    per_frame = torch.stack([jpeg(videos[:, f], ["a", "b"], [{}, {}]) for f in range(3)], dim=1).mean(dim=1)
    torch.testing.assert_close(reward_models.call_reward(jpeg, videos, ["a", "b"], [{}, {}]), per_frame)


def test_temporal_consistency_reward():
    import reward_models

    r = reward_models.build("temporal_consistency")
    assert reward_models.is_video_reward(r)
    still = torch.full((1, 4, 3, 8, 8), 0.3)
    flicker = torch.stack([torch.zeros(3, 8, 8), torch.ones(3, 8, 8)] * 2).unsqueeze(0)  # 0, 1, 0, 1
    ramp = torch.linspace(0, 1, 5).view(1, 5, 1, 1, 1).expand(1, 5, 3, 8, 8)  # steps of 1/4
    out = reward_models.call_reward(r, torch.cat([still, flicker, ramp[:, :4]]), ["a"] * 3, [{}] * 3)
    torch.testing.assert_close(out, torch.tensor([0.0, -1.0, -0.25]))
    with pytest.raises(RewardError, match="videos"):
        r(still[:, 0], ["a"], [{}])
    # Next to a per-frame reward in a weighted sum: each term follows the frame rule.
    both = reward_models.build("weighted", components=[{"name": "brightness"}, {"name": "temporal_consistency", "weight": 0.5}])
    videos = torch.cat([still, flicker])
    out = reward_models.call_reward(both, videos, ["a"] * 2, [{}] * 2)
    torch.testing.assert_close(out, torch.tensor([0.3, 0.5]) + 0.5 * torch.tensor([0.0, -1.0]))


# ---- one training iteration through the CLI ----------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_train_one_iteration(tmp_path, family):
    out = tmp_path / "run"
    overrides = FAST
    if family == "wan":  # the report, with frame strips before and after
        overrides = [o for o in FAST if o not in ("log.report=false", "eval.at_start=false")] + ["eval.at_start=true"]
    assert run_cli("train", f"configs/tiny/flow_grpo_{family}.yaml", f"output_dir={out}", "max_iterations=1", *overrides) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["iteration"] for r in train] == [0]
    assert train[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and train[0]["optimizer_steps"] == 1
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
    if family == "wan":
        evals = [r for r in records if r.get("eval")]
        assert [r["eval/frames"] for r in evals] == [5, 5]
        from PIL import Image

        grid = Image.open(out / "samples" / "eval-iter-000001.png")
        assert grid.size == (2 * (5 * (PX + 1) + 1), 2 * (2 * (PX + 1) + 1))  # 2 videos x 5 frames, 2x scale
        assert "one row per video" in (out / "report.md").read_text()
        from diffalign.export import load_trained_adapter

        assert load_trained_adapter(out).num_frames == 5  # model.options travel with the weights
