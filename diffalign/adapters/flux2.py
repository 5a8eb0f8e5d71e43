"""FLUX.2 [klein] (``Flux2KleinPipeline``): a rectified-flow MMDiT with a Qwen3 text encoder.

- Latents: the FLUX.2 VAE has 32 channels and 8x downsampling; the pipeline "patchifies" 2x2
  latent pixels into channels and normalises them with the VAE's batch-norm statistics, so the
  transformer works on ``(128, H/16, W/16)`` latents read as ``H/16 * W/16`` tokens of 128
  channels (no further packing). At the adapter boundary one latent is exactly that normalised,
  patchified ``(4C, h, w)`` tensor; ``predict`` flattens it into tokens, ``decode`` undoes the
  normalisation and the patchify before the VAE.
- Text: Qwen3 through the pipeline's ``encode_prompt``: the prompt in Qwen3's chat template
  (thinking off), padded to ``max_sequence_length`` tokens, and the hidden states of layers
  ``text_encoder_out_layers`` (9, 18, 27) side by side (``3 x 2560 = 7680`` channels for the 4B
  model's Qwen3-4B). Position ids: ``(t, h, w, l)`` with ``l`` the token index for text and
  ``(h, w)`` the latent position for image tokens.
- Guidance: the base klein models use classifier-free guidance with the empty negative prompt
  (the pipeline's ``guidance_scale``, default 4); the step-distilled ones
  (``is_distilled`` in the pipeline config) ignore it, and so does ``predict``.
- Schedule: ``linspace(1, 1/N, N)`` sigmas shifted with the pipeline's empirical
  ``mu = compute_empirical_mu(image tokens, N)`` (which depends on the number of steps), then 0;
  the transformer takes sigma.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._tiny import tiny_decoder_config, tiny_qwen2_tokenizer
from ._util import module_dtype, pipeline_sigmas, scheduler_sigmas, to_unit_range
from .base import ModelAdapter, PromptEmbeds
from .sd3 import FLOW_GRPO_LORA_TARGETS

FLUX2_MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline.__call__'s default text length
FLUX2_TEXT_LAYERS = (9, 18, 27)  # Qwen3 hidden states the pipeline stacks (text_encoder_out_layers)


def position_ids(batch: int, h: int, w: int, text_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(img_ids (B, h*w, 4), txt_ids (B, L, 4))`` as ``Flux2KleinPipeline`` builds them:
    image ``(0, row, col, 0)`` in row-major order, text ``(0, 0, 0, index)``."""
    img = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text_len))
    return img.expand(batch, -1, -1).to(device), txt.expand(batch, -1, -1).to(device)


class Flux2Adapter(ModelAdapter):
    """Adapter for ``Flux2KleinPipeline``.

    Args:
        pipeline: a loaded ``Flux2KleinPipeline``.
        max_sequence_length: Qwen3 tokens per prompt (default 512, as the pipeline).
        text_encoder_out_layers: the Qwen3 hidden states stacked into the conditioning
            (default ``(9, 18, 27)``, as the pipeline; the transformer's ``joint_attention_dim``
            must equal their number times the Qwen3 width).
    """

    family = "flux2"
    prediction_type = "flow"
    default_resolution = 1024
    # The double-stream attention projections (image to_*, text add_*), as for FLUX.1; the single-stream
    # blocks fuse q/k/v and the MLP into one projection (to_qkv_mlp_proj) and stay frozen.
    default_lora_targets = FLOW_GRPO_LORA_TARGETS
    pipeline_class = "Flux2KleinPipeline"
    options = ("max_sequence_length", "text_encoder_out_layers")
    display_name = "FLUX.2"

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: int = FLUX2_MAX_SEQUENCE_LENGTH,
        text_encoder_out_layers: Sequence[int] = FLUX2_TEXT_LAYERS,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = tuple(text_encoder_out_layers)
        self.is_distilled = bool(pipeline.config.get("is_distilled", False))
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.default_resolution = pipeline.default_sample_size * self.vae_scale_factor

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "Flux2Adapter":
        """1 double + 1 single block of width 32 (2 heads of 16), a 3-layer Qwen3 of width 16
        (its layers 1, 2, 3 stacked: 48 text channels), a 2x FLUX.2 VAE with 4 latent channels
        and random batch-norm statistics; 16 text tokens; 32 px images = 8 x 8 tokens of 16
        channels."""
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
        from transformers import Qwen3Config, Qwen3ForCausalLM


        kwargs.setdefault("max_sequence_length", 16)
        kwargs.setdefault("text_encoder_out_layers", (1, 2, 3))
        torch.manual_seed(seed)
        width, latent_channels = 16, 4
        tokenizer = tiny_qwen2_tokenizer()
        pad = tokenizer.pad_token_id
        text_encoder = Qwen3ForCausalLM(tiny_decoder_config(
            Qwen3Config, len(tokenizer), width=width, num_layers=3, head_dim=8, max_position_embeddings=64,
            bos_token_id=pad, eos_token_id=pad, pad_token_id=pad,
        ))
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * width,
            timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
            guidance_embeds=False,  # klein: no distilled guidance input
        )
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"), up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 8), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
            sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        vae.bn.running_mean.normal_(0.0, 0.5)  # non-trivial statistics, so that decode tests the normalisation
        vae.bn.running_var.uniform_(0.5, 2.0)
        # FLUX.2's scheduler: dynamic shifting with the mu the pipeline computes.
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
        pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        multiple = 2 * self.vae_scale_factor  # VAE downsampling, then 2x2 patchify
        channels = self.pipeline.transformer.config.in_channels
        return self._latent_shape(height, width, multiple=multiple, channels=channels, downsample=multiple)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        def encode(texts):
            pe, _text_ids = self.pipeline.encode_prompt(
                prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length,
                text_encoder_out_layers=self.text_encoder_out_layers,
            )
            return {"encoder_hidden_states": pe}

        return PromptEmbeds.from_encoder(encode, prompts, with_uncond)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``, ``x`` of shape ``(B, 4C, h, w)``; a step-distilled model
        ignores ``guidance_scale``, as its pipeline does."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        _, c, h, w = x.shape

        def forward(xb, tb, kw):
            n = xb.shape[0]
            text = kw["encoder_hidden_states"].to(dtype)
            img_ids, txt_ids = position_ids(n, h, w, text.shape[1], xb.device)
            out = transformer(
                hidden_states=xb.to(dtype).reshape(n, c, h * w).permute(0, 2, 1),  # (B, h*w, 4C) tokens
                timestep=tb.to(dtype),  # sigma: the pipeline passes timesteps / 1000
                guidance=None,
                encoder_hidden_states=text,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
            return out.permute(0, 2, 1).reshape(n, c, h, w)

        g = 1.0 if self.is_distilled else guidance_scale
        return self._guided(forward, x, t, embeds, g)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Adapter latents ``(B, 4C, h, w)`` -> the VAE's ``(B, C, 2h, 2w)`` (what the pipeline
        returns for ``output_type="latent"``): undo the batch-norm normalisation, then the patchify."""
        from diffusers import Flux2KleinPipeline

        vae = self.pipeline.vae
        z = latents.to(device=vae.device, dtype=vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.dtype)
        return Flux2KleinPipeline._unpatchify_latents(z * std + mean)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return to_unit_range(self.pipeline.vae.decode(self.vae_latents(latents), return_dict=False)[0])

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``Flux2KleinPipeline`` sets them: ``linspace(1, 1/N, N)`` (unless the
        scheduler uses its own flow sigmas) shifted with ``mu = compute_empirical_mu(h * w, N)``,
        then 0 appended."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        scheduler = self.pipeline.scheduler
        _, h, w = self.latent_shape(height, width)
        sigmas = pipeline_sigmas(num_steps, scheduler.config)
        return scheduler_sigmas(
            scheduler, num_steps, scheduler_class=FlowMatchEulerDiscreteScheduler, sigmas=sigmas,
            mu=compute_empirical_mu(h * w, num_steps),
        )
