"""The planner's architectures: each shipped config.json built on the meta device has the published
size, to 1 %. Counts are parameters plus floating buffers, the tensors a checkpoint stores (SD3's
position-embedding table is a buffer in diffusers and a parameter in the reference checkpoints)."""

from __future__ import annotations

import pytest

from diffalign.planner import components

# (hub id, component, published size, where it is published)
PUBLISHED = [
    # KerasHub preset stable_diffusion_3.5_medium: 3,371,793,763 parameters with CLIP-L (123.65M), CLIP-G
    # (694.66M) and the VAE (83.65M) -> the MMDiT-X 2.4698B
    ("stabilityai/stable-diffusion-3.5-medium", "transformer", 2.4698e9, "KerasHub SD3.5-M preset minus encoders and VAE"),
    ("stabilityai/stable-diffusion-3.5-large", "transformer", 8.1e9, "model card: 8.1 billion parameter MMDiT"),
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder", 123.65e6, "CLIP ViT-L/14 text tower with projection"),
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder_2", 694.66e6, "OpenCLIP ViT-bigG/14 text tower"),
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder_3", 4.76e9, "T5-v1.1-XXL encoder, 4.76B"),
    ("black-forest-labs/FLUX.1-dev", "transformer", 11.9e9, "FLUX.1 [dev]: 11.9B transformer (diffusers docs)"),
    ("black-forest-labs/FLUX.1-Kontext-dev", "transformer", 11.9e9, "FLUX.1 Kontext [dev]: the FLUX.1 transformer"),
    ("black-forest-labs/FLUX.1-dev", "text_encoder", 123.06e6, "CLIP ViT-L/14 text tower"),
    ("Qwen/Qwen-Image", "transformer", 20.4e9, "Qwen-Image: 20B MMDiT, 20.4B on its Hub page"),
    ("Qwen/Qwen-Image", "text_encoder", 8.29e9, "Qwen2.5-VL-7B-Instruct: 8.29B on its Hub page"),
    ("Qwen/Qwen-Image-Edit", "transformer", 20.4e9, "Qwen-Image-Edit: the Qwen-Image MMDiT"),
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "transformer", 1.42e9, "Wan2.1-T2V-1.3B: 1.42B (5.68 GB of fp32 safetensors)"),
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "transformer", 14.3e9, "Wan2.1-T2V-14B: 14.3B"),
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "transformer_2", 14.3e9, "Wan2.2-T2V-A14B: two 14B experts"),
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "text_encoder", 5.68e9, "umT5-XXL encoder: 5.68B"),
    ("hunyuanvideo-community/HunyuanVideo", "transformer", 12.8e9, "HunyuanVideo: 13B, 12.8B on its Hub page"),
    ("hunyuanvideo-community/HunyuanVideo", "text_encoder", 7.50e9, "Llama-3-8B without its 0.53B lm_head (8.03B)"),
    ("Lightricks/LTX-Video", "transformer", 1.92e9, "LTX-Video 0.9: 2B, 1.92B on its Hub page"),
    ("Tongyi-MAI/Z-Image-Turbo", "transformer", 6.15e9, "Z-Image: 6B, 6.15B on its Hub page"),
    ("Tongyi-MAI/Z-Image-Turbo", "text_encoder", 4.02e9, "Qwen3-4B: 4.02B on its Hub page"),
    ("Efficient-Large-Model/Sana_1600M_1024px_diffusers", "transformer", 1.6e9, "Sana 1600M"),
    ("Efficient-Large-Model/Sana_1600M_1024px_diffusers", "text_encoder", 2.61e9, "Gemma 2 2B: 2.61B"),
    ("runwayml/stable-diffusion-v1-5", "unet", 860e6, "model card: 860M UNet"),
    ("runwayml/stable-diffusion-v1-5", "vae", 83.65e6, "SD VAE (kl-f8): 83.65M"),
    ("stabilityai/stable-diffusion-xl-base-1.0", "unet", 2.567e9, "SDXL paper Table 1: 2.6B UNet (2.567B)"),
]


def _size(model_id: str, component: str) -> int:
    part = next(c for c in components.model_components(model_id) if c.name == component)
    return part.params + part.buffers


@pytest.mark.parametrize("model_id,component,published,source", PUBLISHED, ids=[f"{m}:{c}" for m, c, _, _ in PUBLISHED])
def test_component_matches_published_size(model_id, component, published, source):
    assert _size(model_id, component) == pytest.approx(published, rel=0.01), source


def test_pickscore_is_clip_h():
    # laion/CLIP-ViT-H-14 (PickScore's base): 986.1M parameters (open_clip's model table)
    assert components.reward_component("pickscore").params == pytest.approx(986.1e6, rel=0.01)


def test_every_shipped_model_has_a_denoiser_text_encoder_and_vae():
    for model_id in components.shipped_models():
        roles = {c.role for c in components.model_components(model_id)}
        assert roles == {"denoiser", "text_encoder", "vae"}, model_id


def test_unknown_model_names_the_key_and_folder():
    from diffalign.errors import ConfigError

    with pytest.raises(ConfigError, match="model.id.*no architecture shipped.*FLUX.1-dev"):
        components.model_folder("black-forest-labs/FLUX.1-devv")
