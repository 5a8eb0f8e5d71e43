"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): a UNet on DDPM timesteps.

Sampling uses DDIM built from the checkpoint's scheduler config (SD1.5 ships PNDM); v-prediction
checkpoints (SD2.x 768) are converted to epsilon. Both are shared with SDXL in
:class:`~diffalign.adapters._ddim.UNetDDIMMixin`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._ddim import FINAL_T, UNetDDIMMixin
from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_unet, tiny_vae
from ._util import batch_t, module_dtype
from .base import ModelAdapter, PromptEmbeds

# DDPO's LoRA targets: every attention projection of the UNet (self- and cross-attention).
SD15_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
__all__ = ["FINAL_T", "SD15_LORA_TARGETS", "SD15Adapter"]


class SD15Adapter(UNetDDIMMixin, ModelAdapter):
    """Adapter for ``StableDiffusionPipeline`` (epsilon or v-prediction checkpoints).

    Extra properties for the DDIM kernel: :attr:`alphas_cumprod` (``abar_t`` for every training
    timestep) and :attr:`final_alpha_cumprod` (``abar`` of the final step, ``t = -1``);
    :attr:`scheduler` is the ``DDIMScheduler`` built from the checkpoint's config (its
    ``clip_sample`` is False for SD1.5).
    """

    family = "sd15"
    prediction_type = "epsilon"
    default_resolution = 512
    default_lora_targets = SD15_LORA_TARGETS
    pipeline_class = "StableDiffusionPipeline"
    # The safety checker is never run here (we decode ourselves); skip loading its weights.
    pretrained_defaults = {"safety_checker": None, "requires_safety_checker": False}

    def __init__(self, pipeline, *, device="cpu", dtype=torch.float32):
        super().__init__(pipeline, device=device, dtype=dtype)
        self._init_ddim(pipeline)  # scheduler, model_prediction_type, vae_scale_factor, default_resolution

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "SD15Adapter":
        """A 2-level UNet (channels 8/16, cross-attention at the second level), a 2-layer CLIP
        of width 32, a 2x VAE; SD1.5's noise schedule shipped as a PNDM config like SD1.5."""
        from diffusers import PNDMScheduler, StableDiffusionPipeline
        from transformers import CLIPTextModel


        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer(16)
        text_width = 32
        text_config = tiny_clip_text_config(
            len(tokenizer), hidden_size=text_width, projection_dim=text_width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        unet = tiny_unet(cross_attention_dim=text_width, attention_head_dim=8)
        # SD1.5's scheduler_config.json (the noise schedule DDIM inherits).
        scheduler = PNDMScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
            set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1,
        )
        scheduler.register_to_config(clip_sample=False)  # SD1.5's file has it too; DDIM reads it
        pipe = StableDiffusionPipeline(
            vae=tiny_vae(4, scaling_factor=0.18215, shift_factor=None),  # SD1.5's VAE constant
            text_encoder=CLIPTextModel(text_config),
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        pe, neg = self.pipeline.encode_prompt(
            list(prompts), self.device, num_images_per_prompt=1, do_classifier_free_guidance=with_uncond, negative_prompt=None
        )
        return PromptEmbeds.named(("encoder_hidden_states",), (pe,), (neg,) if with_uncond else None)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Epsilon at ``(x, t)``; ``t`` are DDPM timesteps in ``[0, num_train_timesteps)``."""
        unet = self.pipeline.unet
        dtype = module_dtype(unet)
        t = batch_t(t, x.shape[0], x.device)

        def forward(xb, tb, kw):
            return unet(xb.to(dtype), tb, encoder_hidden_states=kw["encoder_hidden_states"].to(dtype), return_dict=False)[0]

        return self._as_epsilon(self._guided(forward, x, t, embeds, guidance_scale), x, t)
