"""Z-Image, Wan2.2 (two experts) and LTX-Video adapters on tiny random pipelines; SD3.5 Large.

The checks of ``test_adapters_qwen_flux2_wan.py`` (shapes, CFG in one forward, per-sample times,
save / load, schedule == the pipeline's, a deterministic rollout == the pipeline's own
``__call__``) plus what is particular to each: Z-Image's reversed time, negated output and
unpadded text; Wan2.2's switch between its experts at ``boundary_ratio``, its second CFG scale,
the LoRA and the swapped copies on both experts, one LoRA file per expert; LTX-Video's packed
video tokens and decode; one training iteration of each through the CLI.
"""

import copy
import json

import pytest
import torch

from diffalign.adapters import FAMILIES, PIPELINE_FAMILIES, PromptEmbeds, load_adapter
from diffalign.errors import ModelLoadError
from tests.helpers.adapters import PROMPTS, PX, assert_loaded_equals, ode_rollout, one_thread, times  # noqa: F401 (fixtures)
from tests.helpers.tiny_run import FAST, run_cli

# Wan2.2 is the `wan` family with two experts; tiny:wan builds them when boundary_ratio is given.
# 0.7 puts the test times 1.0 and 0.60 (times(): steps 0 and 2 of 4) on different experts.
BUILDS = {"zimage": ("tiny:zimage", {}), "wan22": ("tiny:wan", {"boundary_ratio": 0.7}), "ltx": ("tiny:ltx", {})}


@pytest.fixture(scope="module", params=list(BUILDS))
def adapter(request):
    model_id, options = BUILDS[request.param]
    return load_adapter(model_id, seed=0, **options)


def test_registered():
    assert FAMILIES["zimage"].endswith(":ZImageAdapter") and PIPELINE_FAMILIES["ZImagePipeline"] == "zimage"
    assert FAMILIES["ltx"].endswith(":LTXAdapter") and PIPELINE_FAMILIES["LTXPipeline"] == "ltx"
    assert PIPELINE_FAMILIES["WanPipeline"] == "wan"  # Wan2.1 and Wan2.2 alike


def test_tiny_build_facts(adapter):
    assert not any(p.requires_grad for p in adapter.denoiser.parameters())
    frozen = adapter.frozen_modules()
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    parts = adapter.denoiser_parts()
    assert list(parts) == (["transformer", "transformer_2"] if adapter.family == "wan" else ["transformer"])
    for part in parts.values():  # no expert among the frozen modules; LoRA targets in each
        assert not any(m is part for m in frozen)
        names = [n for n, _ in part.named_modules()]
        for target in adapter.default_lora_targets:
            assert any(n == target or n.endswith("." + target) for n in names), target


def test_encode_predict_decode_shapes(adapter):
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    assert len(e) == 2 and e.uncond.keys() == e.cond.keys()
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, *adapter.latent_shape(PX, PX))
    with torch.no_grad():
        out = adapter.predict(x, times(adapter), e, guidance_scale=3.0)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    frames = (adapter.num_frames,) if adapter.family in ("wan", "ltx") else ()
    images = adapter.decode(x)
    assert images.shape == (2, *frames, 3, PX, PX) and images.min() >= 0 and images.max() <= 1
    with pytest.raises(ValueError):
        adapter.latent_shape(PX + 2, PX)


def test_cfg_per_sample_times_and_prompts(adapter):
    """One batched CFG forward == uncond + g (cond - uncond) row by row; for Wan2.2 the two rows
    (times 1.0 and 0.60) go to different experts in the same call."""
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(2))
    t, g = times(adapter), 4.5
    with torch.no_grad():
        guided = adapter.predict(x, t, e, guidance_scale=g)
        cond = adapter.predict(x, t, PromptEmbeds(e.cond))
        uncond = adapter.predict(x, t, PromptEmbeds(e.uncond))
        rows = [adapter.predict(x[i:i + 1], t[i:i + 1], e.select([i]), guidance_scale=g) for i in range(2)]
        same_x = adapter.predict(x[:1].repeat(2, *[1] * (x.ndim - 1)), t[:1].repeat(2), PromptEmbeds(e.cond))
    torch.testing.assert_close(guided, uncond + g * (cond - uncond), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(guided, torch.cat(rows), rtol=1e-4, atol=1e-5)
    assert (same_x[0] - same_x[1]).abs().max() > 1e-4  # different prompts, different outputs
    torch.testing.assert_close(adapter.to_x0(cond, x, t), x - t.view(-1, *[1] * (x.ndim - 1)) * cond)


def test_save_and_load_through_from_pretrained(adapter, tmp_path):
    adapter.pipeline.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert PIPELINE_FAMILIES[index["_class_name"]] == adapter.family
    options = {"max_sequence_length": adapter.max_sequence_length}
    if adapter.family == "wan":
        assert index["boundary_ratio"] == 0.7 and index["transformer_2"][1] == "WanTransformer3DModel"
    if adapter.family in ("wan", "ltx"):
        options["num_frames"] = adapter.num_frames
    loaded = load_adapter(str(tmp_path), **options)
    assert type(loaded) is type(adapter) and list(loaded.denoiser_parts()) == list(adapter.denoiser_parts())
    assert_loaded_equals(loaded, adapter)


# ---- parity with the stock pipelines -----------------------------------------------------
def test_zimage_sample_matches_stock_pipeline():
    """A 2-step deterministic rollout == ``ZImagePipeline(..., output_type="latent")`` from the same
    noise; diffalign's CFG scale g is the pipeline's g - 1 (it computes cond + w (cond - uncond))."""
    a = load_adapter("tiny:zimage")
    steps, g = 2, 3.0
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    traj = ode_rollout(a, x, g, steps)
    with torch.no_grad():
        # a copy: ZImagePipeline writes the chat-templated prompts into the list it is given
        stock = a.pipeline(prompt=list(PROMPTS), height=PX, width=PX, num_inference_steps=steps, output_type="latent",
                           latents=x, guidance_scale=g - 1, max_sequence_length=a.max_sequence_length).images
    torch.testing.assert_close(stock, traj.latents[:, -1], rtol=1e-4, atol=1e-4)


def test_wan22_sample_across_the_boundary_matches_stock_pipeline():
    """4 steps (sigmas 1, 0.86, 0.60, 0.01) with the boundary at 0.7: two steps on each expert,
    each with its own CFG scale, == ``WanPipeline(..., guidance_scale_2=...)``."""
    a = load_adapter("tiny:wan", boundary_ratio=0.7, guidance_scale_2=2.0)
    steps, g = 4, 3.0
    sched = a.make_schedule(steps, PX, PX)
    assert (a.model_timestep(sched[:-1]) >= 700).tolist() == [True, True, False, False]
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    traj = ode_rollout(a, x, g, steps, schedule=sched)
    with torch.no_grad():
        stock = a.pipeline(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, output_type="latent", latents=x,
                           guidance_scale=g, guidance_scale_2=2.0, num_frames=a.num_frames,
                           max_sequence_length=a.max_sequence_length).frames
        one_scale = a.pipeline(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, output_type="latent",
                               latents=x, guidance_scale=g, num_frames=a.num_frames,
                               max_sequence_length=a.max_sequence_length).frames
    torch.testing.assert_close(stock, traj.latents[:, -1], rtol=1e-4, atol=1e-4)
    assert (stock - one_scale).abs().max() > 1e-4  # guidance_scale_2 does act on the low-noise steps


def test_ltx_sample_and_video_match_stock_pipeline():
    """A 3-step deterministic rollout == ``LTXPipeline(..., output_type="latent")`` (packed tokens)
    from the same noise, and its decoded video == the pipeline's ``output_type="pt"`` frames."""
    a = load_adapter("tiny:ltx")
    steps, g = 3, 3.0
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    assert x.shape == (2, 8, 2, PX // 4, PX // 4)  # 5 frames -> 2 latent frames; 4x spatial compression
    traj = ode_rollout(a, x, g, steps)
    call = dict(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, latents=a.pipeline._pack_latents(x),
                guidance_scale=g, num_frames=a.num_frames, max_sequence_length=a.max_sequence_length)
    with torch.no_grad():
        stock = a.pipeline(**call, output_type="latent").frames
        video = a.pipeline(**call, output_type="pt").frames  # (B, F, 3, H, W) in [0, 1]
    torch.testing.assert_close(stock, a.pipeline._pack_latents(traj.latents[:, -1]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(video, a.decode(traj.latents[:, -1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_steps", [1, 10])
def test_ltx_schedule_matches_the_pipeline(num_steps):
    import numpy as np
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    a = load_adapter("tiny:ltx")
    if num_steps == 1:  # shift_terminal: 0 / 0 in the scheduler
        with pytest.raises(ValueError, match="shift_terminal"):
            a.make_schedule(num_steps, PX, PX)
        return
    stock = type(a.pipeline.scheduler).from_config(a.pipeline.scheduler.config)
    stock.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=calculate_shift(2 * 8 * 8, 1024, 4096, 0.95, 2.05))
    torch.testing.assert_close(a.make_schedule(num_steps, PX, PX), stock.sigmas.float(), rtol=0, atol=0)
    with pytest.raises(ModelLoadError, match="num_frames"):
        load_adapter("tiny:ltx", num_frames=6)


@pytest.mark.parametrize("num_steps", [1, 10])
def test_zimage_schedule_matches_the_pipeline(num_steps):
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

    a = load_adapter("tiny:zimage")
    sched = a.make_schedule(num_steps, PX, PX)
    stock = type(a.pipeline.scheduler).from_config(a.pipeline.scheduler.config)
    stock.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=calculate_shift((PX // 4) ** 2))
    assert sched[0] == 1.0 and sched[-1] == 0.0
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)


# ---- family specifics --------------------------------------------------------------------
def test_zimage_reversed_time_and_unpadded_text():
    """predict == -transformer(x, 1 - sigma, the pipeline's unpadded per-prompt tokens)."""
    a = load_adapter("tiny:zimage")
    e = a.encode_prompts(PROMPTS, with_uncond=False).cond
    stock, _ = a.pipeline.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=a.max_sequence_length)
    for i, tokens in enumerate(stock):
        n = len(tokens)
        assert e["cap_mask"][i].sum() == n and not e["cap_mask"][i, n:].any()
        torch.testing.assert_close(e["cap_feats"][i, :n], tokens, rtol=0, atol=0)
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        raw = a.pipeline.transformer(list(x.unsqueeze(2).unbind(0)), 1 - t, stock, return_dict=False)[0]
        torch.testing.assert_close(a.predict(x, t, PromptEmbeds(e)), -torch.stack(raw).squeeze(2), rtol=1e-4, atol=1e-5)
    with pytest.raises(ModelLoadError, match="max_sequence_length"):
        load_adapter("tiny:zimage", max_sequence_length=0)


def test_wan22_boundary_step_picks_the_expert():
    """Timesteps >= boundary_ratio * 1000 run ``transformer``, smaller ones ``transformer_2``, each
    with its own CFG scale; the experts differ."""
    a = load_adapter("tiny:wan", boundary_ratio=0.5, guidance_scale_2=2.0)
    e = a.encode_prompts(PROMPTS[:1], with_uncond=True)
    x = a.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(3))

    def expert(transformer, sigma, g):
        kw = dict(hidden_states=x, timestep=torch.tensor([sigma * 1000]), return_dict=False)
        c = transformer(encoder_hidden_states=e.cond["encoder_hidden_states"], **kw)[0]
        u = transformer(encoder_hidden_states=e.uncond["encoder_hidden_states"], **kw)[0]
        return u + g * (c - u)

    with torch.no_grad():
        for sigma, transformer, g in [(0.5, a.pipeline.transformer, 4.0), (0.499, a.pipeline.transformer_2, 2.0)]:
            torch.testing.assert_close(a.predict(x, torch.tensor([sigma]), e, 4.0), expert(transformer, sigma, g), rtol=1e-4, atol=1e-5)
        assert (expert(a.pipeline.transformer, 0.5, 4.0) - expert(a.pipeline.transformer_2, 0.5, 4.0)).abs().max() > 1e-3


def test_wan22_options_and_refusals():
    one = load_adapter("tiny:wan")  # Wan2.1: one transformer
    assert one.experts is None and one.denoiser is one.pipeline.transformer
    with pytest.raises(ModelLoadError, match="guidance_scale_2"):
        type(one)(one.pipeline, guidance_scale_2=2.0)
    with pytest.raises(ModelLoadError, match="transformer_2"):
        type(one)(one.pipeline, boundary_ratio=0.875)
    assert one.pipeline.config.boundary_ratio is None  # a refused option leaves the pipeline as it was
    with pytest.raises(ModelLoadError, match="boundary_ratio"):
        load_adapter("tiny:wan", boundary_ratio=1.5)
    two = load_adapter("tiny:wan", boundary_ratio=0.875)
    again = type(two)(two.pipeline, boundary_ratio=0.5, num_frames=5)  # overrides the pipeline's switch too
    assert again.boundary_timestep == 500 and two.pipeline.config.boundary_ratio == 0.5


def test_wan22_lora_and_swapped_copy_cover_both_experts():
    """The LoRA lands on both experts; a swapped copy (the full fine-tuning reference, SOL-RL's
    low-precision copy) replaces both for the block and is undone after it."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    a = load_adapter("tiny:wan", boundary_ratio=0.7)
    a.denoiser.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=a.default_lora_targets))
    for part in a.denoiser_parts().values():
        assert any(isinstance(m, BaseTunerLayer) for m in part.modules())
    e = a.encode_prompts(PROMPTS, with_uncond=False)
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(4))
    t = times(a)  # one row per expert
    ref = copy.deepcopy(a.denoiser)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(1.5)
        before = a.predict(x, t, e)
        with a.swapped_denoiser(ref):
            assert a.pipeline.transformer is ref.transformer and a.pipeline.transformer_2 is ref.transformer_2
            swapped = a.predict(x, t, e)
        after = a.predict(x, t, e)
    assert ((swapped - before).flatten(1).abs().amax(1) > 1e-4).all()  # both rows (both experts) changed
    torch.testing.assert_close(after, before, rtol=0, atol=0)


# ---- one training iteration through the CLI ----------------------------------------------
@pytest.mark.parametrize("name", ["zimage", "wan22", "ltx"])
def test_train_one_iteration(tmp_path, name):
    from safetensors.torch import load_file

    from diffalign.export import load_trained_adapter, unchanged_weights

    out = tmp_path / "run"
    assert run_cli("train", f"configs/tiny/flow_grpo_{name}.yaml", f"output_dir={out}", "max_iterations=1",
                   "train.ema.enabled=false", *FAST) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["iteration"] for r in train] == [0]
    assert train[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and train[0]["optimizer_steps"] == 1
    assert unchanged_weights(out) is None
    files = ["pytorch_lora_weights.safetensors"] + (["pytorch_lora_weights_transformer_2.safetensors"] if name == "wan22" else [])
    assert sorted(f.name for f in (out / "final").glob("*.safetensors")) == files
    for f in files:  # every expert's LoRA moved away from its zero-initialised B
        assert any(v.any() for k, v in load_file(str(out / "final" / f)).items() if "lora_B" in k), f
    if name == "wan22":  # the export and its model card load each file into its expert
        assert json.loads((out / "final" / "diffalign.json").read_text())["lora_files"] == {
            "transformer": files[0], "transformer_2": files[1]}
    trained = load_trained_adapter(out)  # diffusers' own load_lora_weights (load_into_transformer_2 for the second)
    base = {"zimage": lambda: load_adapter("tiny:zimage"), "ltx": lambda: load_adapter("tiny:ltx", num_frames=5),
            "wan22": lambda: load_adapter("tiny:wan", boundary_ratio=0.875, num_frames=5)}[name]()
    e = base.encode_prompts(PROMPTS, with_uncond=False)
    x = base.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([0.95, 0.3])  # Wan2.2 (boundary 0.875): one row per expert
    with torch.no_grad():
        moved = (trained.predict(x, t, e) - base.predict(x, t, e)).flatten(1).abs().amax(1)
    assert (moved > 0).all()
    if name == "wan22":  # `diffalign export --format merged` fuses the LoRA of both experts
        from diffalign.export import merged_adapter

        with torch.no_grad():
            fused = merged_adapter(out).predict(x, t, e)
            torch.testing.assert_close(fused, trained.predict(x, t, e), rtol=1e-4, atol=1e-5)


# ---- SD3.5 Large: the sd3 adapter and its recipe -----------------------------------------
def test_sd35_large_layout_matches_stock_pipeline():
    """SD3.5 Large's MMDiT layout (RMS q/k norm, no dual-attention blocks) through the sd3 adapter:
    a 2-step deterministic rollout == ``StableDiffusion3Pipeline``'s."""
    from diffusers import SD3Transformer2DModel

    a = load_adapter("tiny:sd3")
    config = {k: v for k, v in a.pipeline.transformer.config.items() if not k.startswith("_")}
    a.pipeline.transformer = SD3Transformer2DModel(**{**config, "qk_norm": "rms_norm", "dual_attention_layers": ()})
    a = type(a)(a.pipeline)
    steps, g = 2, 3.5
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(8))
    traj = ode_rollout(a, x, g, steps)
    with torch.no_grad():
        stock = a.pipeline(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, output_type="latent", latents=x,
                           guidance_scale=g, max_sequence_length=a.max_sequence_length).images
    torch.testing.assert_close(stock, traj.latents[:, -1], rtol=1e-4, atol=1e-4)


def test_sd35_large_recipe_validates(tmp_path, capsys):
    from diffalign.config_files import load_config
    from tests.helpers.tiny_run import ROOT

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    recipe = "configs/sd3/flow_grpo_pickscore_large.yaml"
    assert run_cli("config", recipe, f"prompts.file={prompts}", f"prompts.eval_file={prompts}") == 0
    out = capsys.readouterr().out
    assert "stabilityai/stable-diffusion-3.5-large" in out and "images_per_iteration=144" in out
    cfg = load_config(ROOT / recipe)
    assert cfg.model.family == "sd3" and cfg.train.gradient_checkpointing and cfg.algorithm.name == "flow_grpo"


def test_wan22_loading_snippet_loads_both_experts():
    from diffalign.hub import loading_snippet

    meta = {"base_model": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "family": "wan", "lora_files": {
        "transformer": "pytorch_lora_weights.safetensors", "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}}
    code = loading_snippet(meta, "lora", "me/wan22-lora")
    assert 'pipe.load_lora_weights("me/wan22-lora")\n' in code
    assert 'pipe.load_lora_weights("me/wan22-lora", weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True)' in code
