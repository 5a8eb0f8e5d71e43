"""Randomly initialised SD3 pipelines of a few sizes, built in code, big enough that the denoiser
dominates an iteration: the models of the overhead, branch-rollout and Sol-RL benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSize:
    layers: int  # SD3 joint transformer blocks
    heads: int  # attention heads
    head_dim: int  # width = heads * head_dim
    resolution: int  # image side in px; latents are resolution / 2 (the tiny VAE), tokens (resolution / 4)^2
    text_len: int  # tokens per text encoder: CLIP and T5 each, so 2 x text_len text tokens

    def describe(self) -> str:
        tokens = (self.resolution // 4) ** 2
        return (f"{self.layers} joint blocks x {self.heads} heads x {self.head_dim} dims (width {self.heads * self.head_dim}), "
                f"{self.resolution} px = {tokens} image + {2 * self.text_len} text tokens")


SIZES = {
    # = SD3Adapter.build_tiny: Python-bound, only for the smoke test
    "tiny": ModelSize(layers=2, heads=2, head_dim=8, resolution=32, text_len=16),
    # one CFG forward of a 4-sample chunk (8 rows): about 70 ms on one EPYC core, 1.1M parameters
    "small": ModelSize(layers=2, heads=4, head_dim=32, resolution=64, text_len=16),
    # about 6x small's time per forward, 9M parameters
    "medium": ModelSize(layers=4, heads=4, head_dim=64, resolution=64, text_len=16),
}

CLIP_WIDTH, T5_WIDTH = 16, 32  # the tiny text encoders of diffalign.adapters._tiny; cheap next to the denoiser


def build_sd3_pipeline(size: ModelSize, seed: int = 0):
    """A randomly initialised ``StableDiffusion3Pipeline``: the tiny text encoders, tokenizers and
    VAE of :mod:`diffalign.adapters._tiny` around an SD3 transformer of ``size``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    from diffalign.adapters._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_t5_config, tiny_t5_tokenizer, tiny_vae

    torch.manual_seed(seed)
    tok, tok2, tok3 = tiny_clip_tokenizer(size.text_len), tiny_clip_tokenizer(size.text_len), tiny_t5_tokenizer(size.text_len)

    def clip():
        return CLIPTextModelWithProjection(tiny_clip_text_config(
            len(tok), hidden_size=CLIP_WIDTH, projection_dim=CLIP_WIDTH, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))

    width = size.heads * size.head_dim
    transformer = SD3Transformer2DModel(
        sample_size=size.resolution // 2,  # latent side: the tiny VAE downsamples by 2
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=size.layers,
        attention_head_dim=size.head_dim,
        num_attention_heads=size.heads,
        joint_attention_dim=T5_WIDTH,  # the two CLIPs (2 x 16) are padded to the T5 width
        caption_projection_dim=width,
        pooled_projection_dim=2 * CLIP_WIDTH,
        pos_embed_max_size=max(32, size.resolution // 4),
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's shift
        vae=tiny_vae(4, scaling_factor=1.5305, shift_factor=0.0609),  # SD3's VAE constants
        text_encoder=clip(), tokenizer=tok,
        text_encoder_2=clip(), tokenizer_2=tok2,
        text_encoder_3=T5EncoderModel(tiny_t5_config(len(tok3), d_model=T5_WIDTH)), tokenizer_3=tok3,
    )
