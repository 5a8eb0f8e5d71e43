"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): a UNet on DDPM timesteps.

Sampling uses DDIM (the DDPO / SPO kernel), whatever scheduler the checkpoint ships (SD1.5
ships PNDM): a ``DDIMScheduler`` is built from the pipeline's scheduler config, so the betas,
``steps_offset`` and ``timestep_spacing`` are the checkpoint's. ``predict`` always returns an
epsilon prediction: a ``v_prediction`` checkpoint (SD2.x 768) is converted with
``eps = sqrt(abar_t) * v + sqrt(1 - abar_t) * x_t``; ``sample`` prediction is refused.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ModelLoadError
from ._util import batch_t, bcast, guided_forward, pipeline_kwargs, vae_decode
from .base import ModelAdapter, PromptEmbeds

# DDPO's LoRA targets: every attention projection of the UNet (self- and cross-attention).
SD15_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
FINAL_T = -1.0  # schedule entry meaning "the clean state", whose abar is final_alpha_cumprod


class SD15Adapter(ModelAdapter):
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

    def __init__(self, pipeline, *, device="cpu", dtype=torch.float32):
        from diffusers import DDIMScheduler

        super().__init__(pipeline, device=device, dtype=dtype)
        self.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
        self.model_prediction_type = self.scheduler.config.prediction_type  # what the UNet outputs
        if self.model_prediction_type not in ("epsilon", "v_prediction"):
            raise ModelLoadError(
                f"sd15: scheduler prediction_type {self.model_prediction_type!r} is not supported "
                "(supported: 'epsilon', 'v_prediction')"
            )
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.default_resolution = pipeline.unet.config.sample_size * self.vae_scale_factor

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_id: str, *, device="cpu", dtype=torch.float32, **kwargs):
        from diffusers import StableDiffusionPipeline

        # The safety checker is never run here (we decode ourselves); skip loading its weights.
        kwargs.setdefault("safety_checker", None)
        kwargs.setdefault("requires_safety_checker", False)
        pipe = StableDiffusionPipeline.from_pretrained(model_id, **pipeline_kwargs(dtype, kwargs))
        return cls(pipe, device=device, dtype=dtype)

    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "SD15Adapter":
        """A 2-level UNet (channels 8/16, cross-attention at the second level), a 2-layer CLIP
        of width 32, a 2x VAE; SD1.5's noise schedule shipped as a PNDM config like SD1.5."""
        from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel

        from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer(16)
        text_width = 32
        text_config = tiny_clip_text_config(
            len(tokenizer), hidden_size=text_width, projection_dim=text_width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        unet = UNet2DConditionModel(
            sample_size=16,  # latent size of a 32 px image
            in_channels=4,
            out_channels=4,
            block_out_channels=(8, 16),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=text_width,
            attention_head_dim=8,
            norm_num_groups=4,
        )
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

    # ---- DDIM quantities ----------------------------------------------------------------
    @property
    def alphas_cumprod(self) -> torch.Tensor:
        """``abar_t`` for ``t = 0 .. num_train_timesteps - 1`` (fp32, CPU)."""
        return self.scheduler.alphas_cumprod.float()

    @property
    def final_alpha_cumprod(self) -> torch.Tensor:
        """``abar`` of the state after the last DDIM step (``t = -1``): 1 with
        ``set_alpha_to_one``, else ``abar_0`` (SD1.5). A 0-dim fp32 tensor."""
        return torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32)

    def alpha_cumprod_at(self, t: torch.Tensor) -> torch.Tensor:
        """``abar_t`` for a tensor of timesteps, with ``t < 0`` mapping to the final value."""
        t = torch.as_tensor(t)
        table = self.alphas_cumprod.to(t.device)
        abar = table[t.long().clamp(min=0)]
        return torch.where(t < 0, self.final_alpha_cumprod.to(t.device), abar)

    # ---- the contract -------------------------------------------------------------------
    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipeline.unet

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.pipeline.text_encoder, self.pipeline.vae]

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        # Two halvings per down block beyond the first must divide the latent size.
        multiple = self.vae_scale_factor * 2 ** (len(self.pipeline.unet.config.block_out_channels) - 1)
        if height % multiple or width % multiple:
            raise ValueError(f"SD1.5 image size must be a multiple of {multiple}, got {height}x{width}")
        c = self.pipeline.unet.config.in_channels
        return (c, height // self.vae_scale_factor, width // self.vae_scale_factor)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        pe, neg = self.pipeline.encode_prompt(
            list(prompts), self.device, num_images_per_prompt=1, do_classifier_free_guidance=with_uncond, negative_prompt=None
        )
        return PromptEmbeds({"encoder_hidden_states": pe}, {"encoder_hidden_states": neg} if with_uncond else None)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Epsilon at ``(x, t)``; ``t`` are DDPM timesteps in ``[0, num_train_timesteps)``."""
        unet = self.pipeline.unet
        dtype = unet.dtype
        t = batch_t(t, x.shape[0], x.device)

        def forward(xb, tb, kw):
            return unet(xb.to(dtype), tb, encoder_hidden_states=kw["encoder_hidden_states"].to(dtype), return_dict=False)[0]

        out = guided_forward(forward, x, t, embeds, guidance_scale)
        if self.model_prediction_type == "v_prediction":  # guidance is linear, so convert after it
            abar = bcast(self.alpha_cumprod_at(t), x)
            out = abar.sqrt() * out + (1 - abar).sqrt() * x.float()
        return out

    def to_x0(self, model_output: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x0_hat = (x_t - sqrt(1 - abar_t) * eps) / sqrt(abar_t)``."""
        abar = bcast(self.alpha_cumprod_at(torch.as_tensor(t, device=x.device)), x)
        return (x.float() - (1 - abar).sqrt() * model_output.float()) / abar.sqrt()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.pipeline.vae, latents, self.pipeline.vae.dtype)

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The stock ``DDIMScheduler.set_timesteps(num_steps)`` timesteps (the checkpoint's
        spacing and ``steps_offset``), then ``-1`` for the clean state: ``num_steps + 1`` values."""
        from diffusers import DDIMScheduler

        scheduler = DDIMScheduler.from_config(self.scheduler.config)  # fresh: no shared step state
        scheduler.set_timesteps(num_steps, device="cpu")
        return torch.cat([scheduler.timesteps.float(), torch.tensor([FINAL_T])])
