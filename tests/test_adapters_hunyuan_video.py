"""HunyuanVideo adapter on a tiny random pipeline built in code.

The checks of the other family test modules (shapes, CFG in one forward, per-sample times, save /
load, schedule == the pipeline's, a deterministic rollout and its decoded video == the pipeline's
own ``__call__``) plus what is particular to HunyuanVideo: the Llama prompt template whose 95
prefix tokens the pipeline crops, the embedded (distilled) guidance fed to the transformer in
every row, true CFG with the negative prompt, and one training iteration through the CLI.
"""

import json

import pytest
import torch

from diffalign.adapters import FAMILIES, PIPELINE_FAMILIES, PromptEmbeds, load_adapter
from diffalign.errors import ModelLoadError
from tests.helpers.adapters import PROMPTS, PX, assert_loaded_equals, ode_rollout, one_thread, times  # noqa: F401 (fixtures)
from tests.helpers.tiny_run import FAST, run_cli, train_records


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("tiny:hunyuan_video", seed=0)


def test_registered():
    assert FAMILIES["hunyuan_video"].endswith(":HunyuanVideoAdapter")
    assert PIPELINE_FAMILIES["HunyuanVideoPipeline"] == "hunyuan_video"


def test_tiny_build_facts(adapter):
    assert not any(p.requires_grad for p in adapter.denoiser.parameters())
    frozen = adapter.frozen_modules()
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    assert list(adapter.denoiser_parts()) == ["transformer"] and not any(m is adapter.denoiser for m in frozen)
    names = [n for n, _ in adapter.denoiser.named_modules()]
    for target in adapter.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


def test_encode_predict_decode_shapes(adapter):
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    assert set(e.cond) == {"encoder_hidden_states", "encoder_attention_mask", "pooled_projections"} == set(e.uncond)
    assert e.cond["encoder_hidden_states"].shape == (2, adapter.max_sequence_length, 16)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, 4, 2, PX // 2, PX // 2)  # 5 frames -> 2 latent frames (4x in time); 2x in space
    with torch.no_grad():
        out = adapter.predict(x, times(adapter), e, guidance_scale=3.0)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    videos = adapter.decode(x)
    assert videos.shape == (2, adapter.num_frames, 3, PX, PX) and videos.min() >= 0 and videos.max() <= 1
    with pytest.raises(ValueError, match="multiple of 16"):
        adapter.latent_shape(PX + 8, PX)


def test_prompt_template_crop(adapter):
    """The template's prefix is the pipeline's ``crop_start`` (95) tokens with the tiny tokenizer, as
    with the real one; the kept states are the Llama's third-to-last hidden states of the prompt's
    own tokens (plus ``<|eot_id|>``), right-padded, with the mask counting them."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    pipe, template = adapter.pipeline, DEFAULT_PROMPT_TEMPLATE["template"]
    crop = DEFAULT_PROMPT_TEMPLATE["crop_start"]
    prefix = pipe.tokenizer(template.split("{}")[0]).input_ids
    e = adapter.encode_prompts(PROMPTS, with_uncond=False).cond
    for i, prompt in enumerate(PROMPTS):
        ids = pipe.tokenizer(template.format(prompt)).input_ids
        assert len(prefix) == crop and ids[:crop] == prefix
        n = len(ids) - crop  # the prompt's tokens and <|eot_id|>
        assert pipe.tokenizer.decode(ids[crop:-1]) == prompt and ids[-1] == pipe.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        assert e["encoder_attention_mask"][i].tolist() == [1] * n + [0] * (adapter.max_sequence_length - n)
        with torch.no_grad():
            states = pipe.text_encoder(torch.tensor([ids]), output_hidden_states=True).hidden_states[-3][0]
        torch.testing.assert_close(e["encoder_hidden_states"][i, :n], states[crop:], rtol=1e-5, atol=1e-5)


def test_embedded_guidance_and_true_cfg(adapter):
    """``guidance`` reaches the transformer as ``1000 g`` in every row (cond and uncond alike);
    ``guidance_scale > 1`` is true CFG in one batched forward, row by row the same."""
    e = adapter.encode_prompts(PROMPTS, with_uncond=True)
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(2))
    t, g = times(adapter), 4.5

    def raw(kw, guidance):
        return adapter.pipeline.transformer(
            hidden_states=x, timestep=t * 1000, encoder_hidden_states=kw["encoder_hidden_states"],
            encoder_attention_mask=kw["encoder_attention_mask"].float(), pooled_projections=kw["pooled_projections"],
            guidance=torch.full((2,), guidance * 1000.0), return_dict=False)[0]

    with torch.no_grad():
        cond, uncond = adapter.predict(x, t, PromptEmbeds(e.cond)), adapter.predict(x, t, PromptEmbeds(e.uncond))
        guided = adapter.predict(x, t, e, guidance_scale=g)
        rows = [adapter.predict(x[i:i + 1], t[i:i + 1], e.select([i]), guidance_scale=g) for i in range(2)]
        torch.testing.assert_close(cond, raw(e.cond, adapter.guidance), rtol=1e-5, atol=1e-6)
        other = raw(e.cond, 1.0)
    torch.testing.assert_close(guided, uncond + g * (cond - uncond), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(guided, torch.cat(rows), rtol=1e-4, atol=1e-5)
    assert (cond - other).abs().max() > 1e-4  # the embedded guidance does act
    assert (cond - uncond).abs().max() > 1e-4  # prompt and negative prompt differ
    torch.testing.assert_close(adapter.to_x0(cond, x, t), x - t.view(-1, 1, 1, 1, 1) * cond)


def test_save_and_load_through_from_pretrained(adapter, tmp_path):
    adapter.pipeline.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert PIPELINE_FAMILIES[index["_class_name"]] == "hunyuan_video"
    loaded = load_adapter(str(tmp_path), num_frames=5, max_sequence_length=adapter.max_sequence_length, guidance=4.0)
    assert type(loaded) is type(adapter) and loaded.guidance == 4.0
    loaded.guidance = adapter.guidance
    assert_loaded_equals(loaded, adapter)


@pytest.mark.parametrize("true_cfg", [1.0, 3.0])
def test_sample_and_video_match_stock_pipeline(adapter, true_cfg):
    """A 3-step deterministic rollout == ``HunyuanVideoPipeline(..., output_type="latent")`` from the
    same noise, with the embedded guidance and without / with true CFG (the pipeline's
    ``true_cfg_scale`` with ``negative_prompt=""``), and its decoded video == the pipeline's
    ``output_type="pt"`` frames."""
    a, steps = adapter, 3
    x = a.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(7))
    traj = ode_rollout(a, x, true_cfg, steps, with_uncond=true_cfg > 1)
    call = dict(prompt=PROMPTS, height=PX, width=PX, num_inference_steps=steps, latents=x, guidance_scale=a.guidance,
                num_frames=a.num_frames, max_sequence_length=a.max_sequence_length)
    if true_cfg > 1:
        call.update(negative_prompt="", true_cfg_scale=true_cfg)
    with torch.no_grad():
        stock = a.pipeline(**call, output_type="latent").frames
        video = a.pipeline(**call, output_type="pt").frames  # (B, F, 3, H, W) in [0, 1]
    torch.testing.assert_close(stock, traj.latents[:, -1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(video, a.decode(traj.latents[:, -1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_steps", [1, 10])
def test_schedule_matches_the_pipeline(adapter, num_steps):
    import numpy as np

    stock = type(adapter.pipeline.scheduler).from_config(adapter.pipeline.scheduler.config)
    stock.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
    sched = adapter.make_schedule(num_steps, PX, PX)
    assert sched[0] == 1.0 and sched[-1] == 0.0 and len(sched) == num_steps + 1
    torch.testing.assert_close(sched, stock.sigmas.float(), rtol=0, atol=0)


def test_bad_options():
    with pytest.raises(ModelLoadError, match="num_frames must be 4k \\+ 1"):
        load_adapter("tiny:hunyuan_video", num_frames=6)
    with pytest.raises(ModelLoadError, match="max_sequence_length"):
        load_adapter("tiny:hunyuan_video", max_sequence_length=0)


def test_train_one_iteration(tmp_path):
    from safetensors.torch import load_file

    from diffalign.export import load_trained_adapter

    out = tmp_path / "run"
    assert run_cli("train", "configs/tiny/flow_grpo_hunyuan_video.yaml", f"output_dir={out}", "max_iterations=1",
                   "train.ema.enabled=false", "model.options.guidance=4.0", *FAST) == 0
    train = train_records(out)
    assert [r["iteration"] for r in train] == [0]
    assert train[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and train[0]["optimizer_steps"] == 1
    lora = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert any(v.any() for k, v in lora.items() if "lora_B" in k)  # moved away from its zero-initialised B
    trained, base = load_trained_adapter(out), load_adapter("tiny:hunyuan_video", num_frames=5, guidance=4.0)
    assert trained.guidance == 4.0  # the run's model.options come back with it
    e = base.encode_prompts(PROMPTS, with_uncond=False)
    x = base.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        moved = (trained.predict(x, torch.tensor([0.9, 0.3]), e) - base.predict(x, torch.tensor([0.9, 0.3]), e)).flatten(1).abs().amax(1)
    assert (moved > 0).all()
