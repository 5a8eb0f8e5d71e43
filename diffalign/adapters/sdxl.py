"""Stable Diffusion XL (``StableDiffusionXLPipeline``): a UNet on DDPM timesteps, two CLIPs.

Text conditioning, as the pipeline's own ``encode_prompt`` builds it:

- ``encoder_hidden_states``: the penultimate hidden states of CLIP-L (``text_encoder``) and
  OpenCLIP-G (``text_encoder_2``) side by side, ``(B, 77, 768 + 1280)`` for SDXL 1.0;
- ``text_embeds``: the pooled, projected output of ``text_encoder_2`` ``(B, 1280)``, which goes
  with ``time_ids`` into the UNet's ``added_cond_kwargs``;
- the unconditional branch is all zeros when the pipeline says ``force_zeros_for_empty_prompt``
  (SDXL 1.0 base), else the encoded empty prompt.

``time_ids`` (SDXL's micro-conditioning) are ``(orig_h, orig_w, crop_top, crop_left, target_h,
target_w)``. They depend on the image size, not the prompt, so ``predict`` builds them from the
latent's size (the pipeline's defaults: original = target = image size, crop (0, 0)) unless the
adapter options ``original_size`` / ``crops_coords_top_left`` / ``target_size`` fix them.

Sampling is DDIM from the checkpoint's scheduler config (SDXL ships Euler), exactly as for SD1.5
(:class:`~diffalign.adapters._ddim.UNetDDIMMixin`).

VAE: SDXL 1.0's VAE overflows in fp16 and says so with ``force_upcast: true``; such a VAE is kept
in fp32 whatever ``dtype`` the adapter has (+ ~170 MB), as the pipeline upcasts it to decode. A VAE
with ``force_upcast: false`` (``madebyollin/sdxl-vae-fp16-fix``) stays in ``dtype``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._ddim import UNetDDIMMixin
from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_unet, tiny_vae
from ._util import batch_t, module_dtype, to_unit_range
from .base import ModelAdapter, PromptEmbeds
from .sd15 import SD15_LORA_TARGETS

Size = tuple[int, int]  # (height, width) in pixels


class SDXLAdapter(UNetDDIMMixin, ModelAdapter):
    """Adapter for ``StableDiffusionXLPipeline`` (epsilon or v-prediction checkpoints).

    Args:
        pipeline: a loaded ``StableDiffusionXLPipeline`` (both text encoders present).
        original_size, crops_coords_top_left, target_size: fixed SDXL micro-conditioning;
            ``None`` = the pipeline's defaults for the image being sampled.

    Extra properties for the DDIM kernel as in SD1.5: :attr:`alphas_cumprod`,
    :attr:`final_alpha_cumprod`, :attr:`scheduler`.
    """

    family = "sdxl"
    prediction_type = "epsilon"
    default_resolution = 1024
    default_lora_targets = SD15_LORA_TARGETS  # every attention projection of the UNet (DDPO / SPO)
    pipeline_class = "StableDiffusionXLPipeline"
    options = ("original_size", "crops_coords_top_left", "target_size")
    pretrained_defaults = {"add_watermarker": False}  # we decode ourselves; the watermark is never applied

    def __init__(
        self,
        pipeline,
        *,
        original_size: Optional[Size] = None,
        crops_coords_top_left: Size = (0, 0),
        target_size: Optional[Size] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        self._init_ddim(pipeline)  # scheduler, model_prediction_type, vae_scale_factor, default_resolution
        self.original_size = None if original_size is None else tuple(original_size)
        self.crops_coords_top_left = tuple(crops_coords_top_left)
        self.target_size = None if target_size is None else tuple(target_size)
        vae = pipeline.vae
        if vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
            vae.to(dtype=torch.float32)  # what the pipeline does around every decode, once

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "SDXLAdapter":
        """A 2-level UNet (channels 8/16, cross-attention at the second level) with SDXL's
        ``text_time`` added conditioning, a 2-layer CLIP and a 2-layer projected CLIP of width 16
        (32 wide side by side), a 2x VAE; SDXL 1.0's Euler scheduler config. 32 px images."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
        from transformers import CLIPTextModel, CLIPTextModelWithProjection


        torch.manual_seed(seed)
        text_len, clip_width, time_embed_dim = 16, 16, 8
        tokenizer, tokenizer_2 = tiny_clip_tokenizer(text_len), tiny_clip_tokenizer(text_len)
        config = tiny_clip_text_config(
            len(tokenizer), hidden_size=clip_width, projection_dim=clip_width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        unet = tiny_unet(
            cross_attention_dim=2 * clip_width,  # both CLIPs side by side
            attention_head_dim=(4, 8),
            use_linear_projection=True,  # as SDXL
            addition_embed_type="text_time",
            addition_time_embed_dim=time_embed_dim,
            # 6 time ids, each embedded in time_embed_dim, plus the pooled text of CLIP 2.
            projection_class_embeddings_input_dim=6 * time_embed_dim + clip_width,
        )
        # SDXL 1.0's scheduler_config.json (the noise schedule DDIM inherits).
        scheduler = EulerDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
            interpolation_type="linear", prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
            use_karras_sigmas=False,
        )
        scheduler.register_to_config(clip_sample=False, set_alpha_to_one=False, sample_max_value=1.0, skip_prk_steps=True)
        vae = tiny_vae(4, scaling_factor=0.13025, shift_factor=None)  # SDXL's VAE constant
        vae.register_to_config(force_upcast=True)  # as SDXL 1.0's VAE
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=CLIPTextModel(config),
            text_encoder_2=CLIPTextModelWithProjection(config),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer_2,
            unet=unet,
            scheduler=scheduler,
            force_zeros_for_empty_prompt=True,  # as SDXL 1.0 base
            add_watermarker=False,
        )
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        pe, neg_pe, pooled, neg_pooled = self.pipeline.encode_prompt(
            list(prompts), device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=with_uncond,
            negative_prompt=None,  # as the pipeline: zeros with force_zeros_for_empty_prompt, else ""
        )
        return PromptEmbeds.named(("encoder_hidden_states", "text_embeds"), (pe, pooled), (neg_pe, neg_pooled) if with_uncond else None)

    def time_ids(self, height: int, width: int) -> torch.Tensor:
        """SDXL micro-conditioning for a ``height x width`` image: fp32 ``(6,)``."""
        original = self.original_size or (height, width)
        target = self.target_size or (height, width)
        return torch.tensor([*original, *self.crops_coords_top_left, *target], dtype=torch.float32)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Epsilon at ``(x, t)``; ``t`` are DDPM timesteps in ``[0, num_train_timesteps)``."""
        unet = self.pipeline.unet
        dtype = module_dtype(unet)
        t = batch_t(t, x.shape[0], x.device)
        time_ids = self.time_ids(x.shape[2] * self.vae_scale_factor, x.shape[3] * self.vae_scale_factor)
        time_ids = time_ids.to(device=x.device, dtype=dtype)

        def forward(xb, tb, kw):
            added = {"text_embeds": kw["text_embeds"].to(dtype), "time_ids": time_ids.expand(xb.shape[0], -1)}
            return unet(
                xb.to(dtype), tb, encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                added_cond_kwargs=added, return_dict=False,
            )[0]

        return self._as_epsilon(self._guided(forward, x, t, embeds, guidance_scale), x, t)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: ``z / scaling_factor``, or ``z * std / scaling_factor + mean`` when the
        VAE config has per-channel ``latents_mean`` / ``latents_std``; decoded in the VAE's dtype
        (fp32 for a ``force_upcast`` VAE, see the module docstring)."""
        vae = self.pipeline.vae
        z = latents.to(device=vae.device, dtype=torch.float32)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean, device=z.device).view(1, -1, 1, 1)
            std = torch.tensor(std, device=z.device).view(1, -1, 1, 1)
            z = z * std / vae.config.scaling_factor + mean
        else:
            z = z / vae.config.scaling_factor
        return to_unit_range(vae.decode(z.to(vae.dtype), return_dict=False)[0])
