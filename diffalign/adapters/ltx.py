"""LTX-Video text-to-video (``LTXPipeline``): a rectified-flow video DiT on a 32x-compressing VAE.

- Frames are one more latent axis, as for Wan: one latent is ``(C, T, h, w)`` with ``C = 128``,
  ``T = (num_frames - 1) / 8 + 1`` and ``h = H / 32`` for the released VAE. ``num_frames`` is an
  adapter option (the pipeline's 161 by default; ``8k + 1``). The pipeline works on packed
  latents (one token per latent voxel, ``(B, T h w, C)``); the adapter packs inside ``predict``,
  so samplers and kernels see the unpacked tensor.
- Text: T5-XXL through the pipeline's ``encode_prompt`` (``max_sequence_length`` 128 tokens,
  padded, with the attention mask the transformer uses). CFG with ``negative_prompt`` (``""``) in
  one batched forward; the pipeline's optional ``guidance_rescale`` (0 by default) is not used.
- The transformer gets the scheduler's ``1000 sigma`` and the rotary scale of the pipeline
  (``temporal compression / frame_rate``, spatial compression twice; adapter option
  ``frame_rate``, 25 as the pipeline).
- Sigmas as ``LTXPipeline`` sets them: ``linspace(1, 1/N, N)`` shifted with ``mu`` from the video
  tokens (the released scheduler shifts dynamically and stretches the last sigma with
  ``shift_terminal``, which leaves 1 step undefined, as for Qwen-Image).
- ``decode``: ``z * latents_std / scaling_factor + latents_mean``, then the VAE; a VAE with
  ``timestep_conditioning`` (LTX-Video 0.9.1+) decodes at ``decode_timestep`` (adapter option,
  the pipeline's 0 by default) without the pipeline's random ``decode_noise_scale`` mixing, so
  that a latent always decodes to the same video. Videos ``(B, F, 3, H, W)``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import ModelLoadError
from ._tiny import tiny_t5_config, tiny_t5_tokenizer
from ._util import module_dtype, scheduler_sigmas, shift_mu, to_unit_range
from .base import ModelAdapter, PromptEmbeds

LTX_MAX_SEQUENCE_LENGTH = 128  # LTXPipeline.__call__'s default T5 length
LTX_NUM_FRAMES = 161  # LTXPipeline.__call__'s default
LTX_FRAME_RATE = 25  # LTXPipeline.__call__'s default; sets the temporal rotary scale
# Self- (attn1) and cross-attention (attn2) projections of every block, as for Wan.
LTX_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class LTXAdapter(ModelAdapter):
    """Adapter for ``LTXPipeline`` (LTX-Video T2V).

    Args:
        pipeline: a loaded ``LTXPipeline``.
        num_frames: video frames per sample (``8k + 1`` for the released VAE; 161 by default).
        max_sequence_length: T5 tokens per prompt (128).
        negative_prompt: the prompt of the unconditional branch (``""``).
        frame_rate: frames per second the rotary time scale assumes (25).
        decode_timestep: the VAE's decode timestep when it is timestep-conditioned (0).
    """

    family = "ltx"
    prediction_type = "flow"
    default_resolution = 512  # the pipeline's default height (its default width is 704; ours are square)
    default_lora_targets = LTX_LORA_TARGETS
    pipeline_class = "LTXPipeline"
    options = ("num_frames", "max_sequence_length", "negative_prompt", "frame_rate", "decode_timestep")
    display_name = "LTX-Video"

    def __init__(
        self,
        pipeline,
        *,
        num_frames: int = LTX_NUM_FRAMES,
        max_sequence_length: int = LTX_MAX_SEQUENCE_LENGTH,
        negative_prompt: str = "",
        frame_rate: float = LTX_FRAME_RATE,
        decode_timestep: float = 0.0,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        self.temporal_factor = pipeline.vae_temporal_compression_ratio
        self.spatial_factor = pipeline.vae_spatial_compression_ratio
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise ModelLoadError(f"ltx: num_frames must be {self.temporal_factor}k + 1, got {num_frames}")
        if frame_rate <= 0:
            raise ModelLoadError(f"ltx: frame_rate must be > 0, got {frame_rate}")
        self.num_frames = num_frames
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.frame_rate = frame_rate
        self.decode_timestep = decode_timestep
        self.patch_size = pipeline.transformer_spatial_patch_size
        self.patch_size_t = pipeline.transformer_temporal_patch_size
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "LTXAdapter":
        """1 LTX block of width 16 (2 heads of 8), a 1-layer T5 of width 32, an LTX VAE with 8
        latent channels that compresses space and time 4x; 16 text tokens; 5 frames of 32 px =
        2 latent frames of 8 x 8 = 128 video tokens."""
        from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
        from transformers import T5EncoderModel

        kwargs.setdefault("max_sequence_length", 16)
        kwargs.setdefault("num_frames", 5)
        torch.manual_seed(seed)
        text_width, latent_channels = 32, 8
        tokenizer = tiny_t5_tokenizer(16)
        text_encoder = T5EncoderModel(tiny_t5_config(len(tokenizer), d_model=text_width))
        transformer = LTXVideoTransformer3DModel(
            in_channels=latent_channels, out_channels=latent_channels, patch_size=1, patch_size_t=1,
            num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=text_width,
        )
        vae = AutoencoderKLLTXVideo(
            latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )
        vae.latents_mean.normal_(0.0, 0.5)  # non-trivial statistics, so that decode tests the normalisation
        vae.latents_std.uniform_(0.5, 2.0)
        # LTX-Video's scheduler settings: dynamic shift from the video tokens, last sigma stretched to 0.1.
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
            base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
        )
        pipe = LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return self._latent_shape(
            height, width, multiple=max(32, self.spatial_factor * self.patch_size),  # the pipeline asks for multiples of 32
            channels=self.pipeline.transformer.config.in_channels, downsample=self.spatial_factor,
            frames=self.latent_frames, what="frame",
        )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        prompts = list(prompts)
        pe, mask, neg_pe, neg_mask = self.pipeline.encode_prompt(
            prompt=prompts,
            negative_prompt=[self.negative_prompt] * len(prompts),
            do_classifier_free_guidance=with_uncond,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        names = ("encoder_hidden_states", "encoder_attention_mask")
        return PromptEmbeds.named(names, (pe, mask), (neg_pe, neg_mask) if with_uncond else None)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``, ``x`` of shape ``(B, C, T, h, w)``; packed into tokens for the
        transformer and unpacked again."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        _, _, frames, h, w = x.shape
        p, pt = self.patch_size, self.patch_size_t
        rope_scale = (self.temporal_factor / self.frame_rate, self.spatial_factor, self.spatial_factor)

        def forward(xb, tb, kw):
            out = transformer(
                hidden_states=self.pipeline._pack_latents(xb.to(dtype), p, pt),
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                timestep=tb * self.num_train_timesteps,  # the scheduler's timesteps, 1000 sigma
                encoder_attention_mask=kw["encoder_attention_mask"],
                num_frames=frames // pt, height=h // p, width=w // p,
                rope_interpolation_scale=rope_scale,
                return_dict=False,
            )[0]
            return self.pipeline._unpack_latents(out, frames // pt, h // p, w // p, p, pt)

        return self._guided(forward, x, t, embeds, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, T, h, w)`` -> videos ``(B, F, 3, H, W)`` fp32 in ``[0, 1]``."""
        vae = self.pipeline.vae
        z = self.pipeline._denormalize_latents(latents.to(vae.device, vae.dtype), vae.latents_mean, vae.latents_std,
                                               vae.config.scaling_factor)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.full((z.shape[0],), self.decode_timestep, device=z.device, dtype=z.dtype)
        video = vae.decode(z, timestep, return_dict=False)[0]
        return to_unit_range(video.permute(0, 2, 1, 3, 4))  # (B, 3, F, H, W) in [-1, 1] -> frames second

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``LTXPipeline`` sets them: ``linspace(1, 1/N, N)`` shifted with
        ``mu = calculate_shift(video tokens)``, then 0."""
        scheduler = self.pipeline.scheduler
        _, frames, h, w = self.latent_shape(height, width)
        mu = shift_mu(scheduler.config, frames * h * w)
        sigmas = scheduler_sigmas(scheduler, num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        if not torch.isfinite(sigmas).all():  # shift_terminal stretches sigmas 1 .. 1/N: 0 / 0 for N = 1
            raise ValueError(f"LTX-Video's scheduler gives non-finite sigmas for {num_steps} step(s) (shift_terminal needs >= 2)")
        return sigmas
