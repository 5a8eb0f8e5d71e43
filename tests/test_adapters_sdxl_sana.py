"""SDXL and Sana adapters on tiny random pipelines built in code.

The checks every adapter passes (shapes, CFG in one forward, Tweedie) run on both in
``test_adapters.py``. Here: save / load, schedule == stock scheduler, 2-step sample == the stock
pipeline, and what is particular to each family: SDXL's micro-conditioning and fp16 VAE upcast, Sana's integer timesteps, scheduler
variants and complex human instruction; and one training iteration of each through the CLI.
"""

import json
import os

import pytest
import torch

from diffalign.adapters import FAMILIES, PIPELINE_FAMILIES, load_adapter
from diffalign.errors import ModelLoadError
from tests.helpers.adapters import PROMPTS, PX, one_thread, tiny_adapters, times  # noqa: F401 (fixtures)

FAMILY_NAMES = ["sdxl", "sana"]
adapter = tiny_adapters(FAMILY_NAMES)


def test_registered():
    assert FAMILIES["sdxl"].endswith("SDXLAdapter") and FAMILIES["sana"].endswith("SanaAdapter")
    assert PIPELINE_FAMILIES["StableDiffusionXLPipeline"] == "sdxl" and PIPELINE_FAMILIES["SanaPipeline"] == "sana"


def test_tiny_build_facts(adapter):
    assert adapter.family in FAMILY_NAMES
    assert adapter.prediction_type == ("epsilon" if adapter.family == "sdxl" else "flow")
    assert adapter.default_resolution == PX
    assert not any(p.requires_grad for p in adapter.denoiser.parameters())
    assert not any(p.requires_grad for m in adapter.frozen_modules() for p in m.parameters())
    names = [n for n, _ in adapter.denoiser.named_modules()]
    for target in adapter.default_lora_targets:  # peft matches by suffix
        assert any(n == target or n.endswith("." + target) for n in names), target


def test_save_and_load_through_from_pretrained(adapter, tmp_path):
    adapter.pipeline.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert PIPELINE_FAMILIES[index["_class_name"]] == adapter.family
    options = {"complex_human_instruction": False, "max_sequence_length": 16} if adapter.family == "sana" else {}
    loaded = load_adapter(str(tmp_path), **options)
    assert type(loaded) is type(adapter)
    e_a = adapter.encode_prompts(PROMPTS, with_uncond=True)
    e_b = loaded.encode_prompts(PROMPTS, with_uncond=True)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(5))
    t = times(adapter)
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict(x, t, e_b, 3.0), adapter.predict(x, t, e_a, 3.0), rtol=0, atol=0)
    torch.testing.assert_close(loaded.make_schedule(6, PX, PX), adapter.make_schedule(6, PX, PX), rtol=0, atol=0)
    torch.testing.assert_close(loaded.decode(x), adapter.decode(x), rtol=0, atol=1e-6)
    if adapter.family == "sdxl":
        assert loaded.final_alpha_cumprod == adapter.final_alpha_cumprod
    assert type(load_adapter(str(tmp_path), family=adapter.family, **options)) is type(adapter)


@pytest.mark.parametrize("num_steps", [1, 10])
def test_schedule_matches_stock_scheduler(adapter, num_steps):
    from diffusers import DDIMScheduler

    sched = adapter.make_schedule(num_steps, PX, PX)
    assert sched.shape == (num_steps + 1,) and sched.dtype == torch.float32
    assert (sched[1:] < sched[:-1]).all()
    config = adapter.pipeline.scheduler.config
    if adapter.family == "sdxl":  # ships Euler; DDIM from the same config, as SD1.5
        assert type(adapter.pipeline.scheduler).__name__ == "EulerDiscreteScheduler"
        stock = DDIMScheduler.from_config(config)
        stock.set_timesteps(num_steps)
        assert stock.config.timestep_spacing == "leading" and stock.config.steps_offset == 1
        assert not stock.config.set_alpha_to_one and not stock.config.clip_sample
        assert sched[:-1].tolist() == stock.timesteps.float().tolist() and sched[-1] == -1
        return
    stock = type(adapter.pipeline.scheduler).from_config(config)  # what SanaPipeline calls
    stock.set_timesteps(num_steps)
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)
    # Sana's flow sigmas: shift * s / (1 + (shift - 1) s) over s = 1 - linspace(1, 1/1000, N+1),
    # largest first, without the final s = 0 (the schedule's own 0 is appended after).
    s = 1 - torch.linspace(1, 1 / 1000, num_steps + 1, dtype=torch.float64)
    expected = (3 * s / (1 + 2 * s)).flip(0)[:-1]
    torch.testing.assert_close(sched[:-1].double(), expected, rtol=1e-6, atol=1e-6)
    assert sched[-1] == 0
    # The transformer sees the scheduler's (integer) timesteps.
    assert adapter.integer_timesteps
    assert adapter.model_timestep(sched[:-1]).tolist() == stock.timesteps.float().tolist()


# ---- parity with the stock pipelines -----------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_step_sample_matches_stock_pipeline(family):
    """diffalign's deterministic rollout (``sample_linear``, DDIM eta=0 / flow ODE) ==
    ``pipeline(..., output_type="latent")`` from the same noise."""
    from diffusers import DDIMScheduler

    from diffalign.sampling import build_kernel, sample_linear

    a = load_adapter(f"tiny:{family}")
    steps, g = 2, 3.0
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    kernel = build_kernel(a, "ddim" if family == "sdxl" else "flow_grpo", 0.0)
    traj = sample_linear(a, kernel, a.encode_prompts(PROMPTS, with_uncond=True), a.make_schedule(steps, PX, PX),
                         torch.zeros(steps, dtype=torch.bool), guidance_scale=g, height=PX, width=PX, noise=x)
    ours = traj.latents[:, -1]
    kwargs = dict(prompt=PROMPTS, latents=x, guidance_scale=g, height=PX, width=PX, num_inference_steps=steps, output_type="latent")
    with torch.no_grad():
        if family == "sdxl":
            a.pipeline.scheduler = DDIMScheduler.from_config(a.pipeline.scheduler.config)
            stock = a.pipeline(**kwargs, eta=0.0).images
        else:  # the stock DPM-Solver++ scheduler: first order on both steps of a 2-step run == Euler
            stock = a.pipeline(**kwargs, use_resolution_binning=False, max_sequence_length=a.max_sequence_length,
                               complex_human_instruction=None).images
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-4)


# ---- SDXL specifics ----------------------------------------------------------------------
def test_sdxl_micro_conditioning_and_zero_uncond():
    a = load_adapter("tiny:sdxl")
    assert a.time_ids(PX, 2 * PX).tolist() == [PX, 2 * PX, 0, 0, PX, 2 * PX]
    e = a.encode_prompts(PROMPTS, with_uncond=True)
    assert e.cond["encoder_hidden_states"].shape[-1] == a.denoiser.config.cross_attention_dim  # both CLIPs
    assert e.cond["text_embeds"].shape == (2, a.pipeline.text_encoder_2.config.projection_dim)
    assert all(v.abs().max() == 0 for v in e.uncond.values())  # force_zeros_for_empty_prompt
    x = a.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(8))
    t = torch.tensor([501.0])
    with torch.no_grad():
        default = a.predict(x, t, e.select([0]))
        fixed = load_adapter("tiny:sdxl", original_size=(512, 512), crops_coords_top_left=(8, 8), target_size=(1024, 1024))
        assert fixed.time_ids(PX, PX).tolist() == [512, 512, 8, 8, 1024, 1024]
        assert (fixed.predict(x, t, e.select([0])) - default).abs().max() > 1e-6  # time_ids reach the UNet


def test_sdxl_fp16_vae_is_upcast_only_when_the_config_says_so():
    from diffalign.adapters.sdxl import SDXLAdapter

    a = load_adapter("tiny:sdxl")
    assert a.pipeline.vae.config.force_upcast
    half = SDXLAdapter(a.pipeline, dtype=torch.float16)
    assert half.pipeline.vae.dtype == torch.float32 and half.pipeline.text_encoder.dtype == torch.float16
    z = torch.randn(1, *half.latent_shape(PX, PX))
    images = half.decode(z)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()

    b = load_adapter("tiny:sdxl")
    b.pipeline.vae.register_to_config(force_upcast=False)  # e.g. madebyollin/sdxl-vae-fp16-fix
    assert SDXLAdapter(b.pipeline, dtype=torch.float16).pipeline.vae.dtype == torch.float16


def test_sdxl_decode_undoes_per_channel_latent_statistics():
    a = load_adapter("tiny:sdxl")
    vae = a.pipeline.vae
    z = torch.randn(1, *a.latent_shape(PX, PX), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain = (vae.decode(z / vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
        torch.testing.assert_close(a.decode(z), plain)
        mean, std = [0.1, -0.2, 0.3, 0.0], [0.9, 1.1, 1.0, 0.8]
        vae.register_to_config(latents_mean=mean, latents_std=std)  # as the pipeline reads them
        unnorm = z * torch.tensor(std).view(1, 4, 1, 1) / vae.config.scaling_factor + torch.tensor(mean).view(1, 4, 1, 1)
        torch.testing.assert_close(a.decode(z), (vae.decode(unnorm).sample / 2 + 0.5).clamp(0, 1))


def test_sdxl_v_prediction_and_sample_prediction():
    from diffusers import EulerDiscreteScheduler

    from diffalign.adapters.sdxl import SDXLAdapter

    a = load_adapter("tiny:sdxl")
    e = a.encode_prompts(PROMPTS[:1], with_uncond=False)
    x = a.prepare_noise(1, PX, PX, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([501.0])
    with torch.no_grad():
        raw = a.predict(x, t, e)
        a.model_prediction_type = "v_prediction"
        eps = a.predict(x, t, e)
    abar = a.alphas_cumprod[501]
    torch.testing.assert_close(eps, abar.sqrt() * raw + (1 - abar).sqrt() * x)
    a.pipeline.scheduler = EulerDiscreteScheduler.from_config(a.pipeline.scheduler.config, prediction_type="sample")
    with pytest.raises(ModelLoadError, match="sdxl.*sample"):
        SDXLAdapter(a.pipeline)


# ---- Sana specifics ----------------------------------------------------------------------
def test_sana_flow_match_euler_scheduler_gives_float_timesteps():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffalign.adapters.sana import SanaAdapter

    a = load_adapter("tiny:sana")
    a.pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    b = SanaAdapter(a.pipeline, max_sequence_length=16)
    assert not b.integer_timesteps
    stock = FlowMatchEulerDiscreteScheduler(shift=3.0)
    stock.set_timesteps(5)
    sched = b.make_schedule(5, PX, PX)
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(b.model_timestep(sched[:-1]), stock.timesteps.float(), rtol=0, atol=0)


def test_sana_refuses_a_non_flow_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    from diffalign.adapters.sana import SanaAdapter

    a = load_adapter("tiny:sana")
    a.pipeline.scheduler = DPMSolverMultistepScheduler()  # epsilon prediction, no flow sigmas
    with pytest.raises(ModelLoadError, match="sana.*flow"):
        SanaAdapter(a.pipeline)


def test_sana_complex_human_instruction():
    from diffalign.adapters.sana import SanaAdapter, pipeline_default_instruction

    a = load_adapter("tiny:sana")
    assert a.complex_human_instruction is None and a.max_sequence_length == 16
    chi = SanaAdapter(a.pipeline, max_sequence_length=16, complex_human_instruction=True)
    assert chi.complex_human_instruction == pipeline_default_instruction() and len(chi.complex_human_instruction) > 3
    plain, with_chi = a.encode_prompts(PROMPTS, with_uncond=True), chi.encode_prompts(PROMPTS, with_uncond=True)
    for key in plain.cond:
        assert with_chi.cond[key].shape == plain.cond[key].shape  # first token + the last L - 1
        torch.testing.assert_close(with_chi.uncond[key], plain.uncond[key])  # never on the empty prompt
    assert (with_chi.cond["encoder_hidden_states"] - plain.cond["encoder_hidden_states"]).abs().max() > 1e-4
    custom = SanaAdapter(a.pipeline, max_sequence_length=16, complex_human_instruction=["Describe:"])
    assert custom.complex_human_instruction == ["Describe:"]


def test_sana_from_pretrained_turns_the_instruction_on(tmp_path):
    from diffalign.adapters.sana import pipeline_default_instruction

    load_adapter("tiny:sana").pipeline.save_pretrained(tmp_path)
    assert load_adapter(str(tmp_path)).complex_human_instruction == pipeline_default_instruction()  # as SanaPipeline.__call__
    assert load_adapter(str(tmp_path), complex_human_instruction=False).complex_human_instruction is None


def test_tiny_gemma_tokenizer_survives_save_and_load(tmp_path):
    from transformers import GemmaTokenizer

    from diffalign.adapters.sana import tiny_gemma_tokenizer

    tok = tiny_gemma_tokenizer()
    ids = tok(["a red circle", "zebra é"]).input_ids
    assert ids[0][0] == tok.bos_token_id and len(ids[0]) == 4  # <bos> a ▁red ▁circle
    assert tok.unk_token_id not in ids[1]  # byte fallback, not <unk>
    tok.save_pretrained(tmp_path)
    assert GemmaTokenizer.from_pretrained(tmp_path)(["a red circle", "zebra é"]).input_ids == ids


# ---- errors ------------------------------------------------------------------------------
def test_bad_ids_and_options_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no_such_option"):
        load_adapter("tiny:sdxl", no_such_option=1)
    with pytest.raises(ModelLoadError, match="guidance"):
        load_adapter("tiny:sana", guidance=2.0)  # a FLUX option
    with pytest.raises(ModelLoadError, match="'sana'.*'sdxl'"):
        load_adapter("tiny:sana", family="sdxl")
    # A folder that says SanaPipeline / SDXL but has no weights: one-line error naming the family.
    for class_name, family in [("SanaPipeline", "sana"), ("StableDiffusionXLPipeline", "sdxl")]:
        folder = tmp_path / family
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
        with pytest.raises(ModelLoadError) as info:
            load_adapter(str(folder))
        assert family in str(info.value) and "\n" not in str(info.value)


# ---- one training iteration through the CLI ----------------------------------------------
@pytest.mark.parametrize("config", ["configs/tiny/flow_grpo_ddim_sdxl.yaml", "configs/tiny/flow_grpo_sana.yaml"])
def test_train_one_iteration(repo_root, tmp_path, config):
    from diffalign.cli import main

    out = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        code = main(["train", config, f"output_dir={out}", "max_iterations=1", "log.progress_bar=false", "log.report=false",
                     "eval.at_start=false", "sampling.eval_num_steps=2", "eval.samples_per_prompt=1"])
    finally:
        os.chdir(cwd)
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["iteration"] for r in train] == [0]
    assert train[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and train[0]["optimizer_steps"] == 1
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
