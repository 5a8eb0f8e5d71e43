"""Z-Image (``ZImagePipeline``): a single-stream rectified-flow DiT (S3-DiT) with a Qwen3 text encoder.

What differs from the other flow families:

- **Reversed time and velocity.** The transformer takes ``1 - sigma`` (``(1000 - timestep) /
  1000`` in the pipeline) and predicts ``x0 - eps``; the pipeline steps with its negative. The
  adapter returns the usual velocity ``v = eps - x0`` (the negated output), so kernels, Tweedie and
  algorithms are unchanged.
- **Variable-length text.** The pipeline keeps only the unpadded tokens of each prompt (the
  second-to-last hidden state of Qwen3 on the prompt in Qwen3's chat template) and hands the
  transformer a *list* of per-prompt tensors. The adapter pads every prompt to
  ``max_sequence_length`` with zeros plus a boolean ``cap_mask`` so that batches concatenate, and
  unpads them again before each forward: the transformer sees exactly the pipeline's inputs.
- **CFG.** The pipeline's ``guidance_scale`` ``w`` computes ``cond + w (cond - uncond)``, i.e.
  diffalign's ``uncond + g (cond - uncond)`` with ``g = w + 1``: ``sampling.guidance_scale: 5``
  is the pipeline's ``guidance_scale=4`` (Z-Image's recommended base setting). The distilled
  Z-Image-Turbo runs without CFG (the pipeline's ``0``, diffalign's ``1``). The pipeline's
  optional ``cfg_normalization`` and ``cfg_truncation`` (off by default) are not used.
- **Sigmas** as ``ZImagePipeline`` sets them: ``linspace(1, 1/N, N)`` shifted by the scheduler
  (static ``shift`` for the released checkpoints; ``mu`` from the image tokens when it shifts
  dynamically), then 0.

Latents are the FLUX-style VAE's ``(16, H/8, W/8)`` (2x2 patches inside the transformer); decode
undoes ``scaling_factor`` / ``shift_factor`` as the default.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ModelLoadError
from ._tiny import tiny_decoder_config, tiny_qwen2_tokenizer, tiny_vae
from ._util import module_dtype, scheduler_sigmas, shift_mu
from .base import ModelAdapter, PromptEmbeds

ZIMAGE_MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default
# Every attention projection of the main layers and both refiners (the single-stream blocks).
ZIMAGE_LORA_TARGETS = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]


class ZImageAdapter(ModelAdapter):
    """Adapter for ``ZImagePipeline`` (Z-Image, Z-Image-Turbo).

    Args:
        pipeline: a loaded ``ZImagePipeline``.
        max_sequence_length: Qwen3 tokens per prompt, chat template included (512 as the pipeline).
        negative_prompt: the prompt of the unconditional branch (``""`` as the pipeline).
    """

    family = "zimage"
    prediction_type = "flow"
    default_resolution = 1024  # the pipeline's default size
    default_lora_targets = ZIMAGE_LORA_TARGETS
    pipeline_class = "ZImagePipeline"
    options = ("max_sequence_length", "negative_prompt")
    display_name = "Z-Image"

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: int = ZIMAGE_MAX_SEQUENCE_LENGTH,
        negative_prompt: str = "",
        **base,  # device, dtype: see ModelAdapter
    ):
        if max_sequence_length < 1:
            raise ModelLoadError(f"zimage: max_sequence_length must be >= 1, got {max_sequence_length}")
        super().__init__(pipeline, **base)
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.patch_size = pipeline.transformer.config.all_patch_size[0]
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "ZImageAdapter":
        """1 main layer and 1 layer per refiner of width 32 (2 heads of 16), a 2-layer Qwen3 of
        width 16, a 2x VAE with 4 latent channels; 16 text tokens; 32 px images = 8 x 8 tokens."""
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        kwargs.setdefault("max_sequence_length", 16)
        torch.manual_seed(seed)
        width, latent_channels = 16, 4
        tokenizer = tiny_qwen2_tokenizer()
        pad = tokenizer.pad_token_id
        text_encoder = Qwen3Model(tiny_decoder_config(
            Qwen3Config, len(tokenizer), width=width, num_layers=2, head_dim=8, max_position_embeddings=64,
            bos_token_id=pad, eos_token_id=pad, pad_token_id=pad,
        ))
        transformer = ZImageTransformer2DModel(
            in_channels=latent_channels, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
            cap_feat_dim=width, axes_dims=[4, 6, 6],  # sums to the head width 16
            axes_lens=[128, 64, 64],  # rotary positions: text tokens (padded to 32) + image rows / columns
        )
        vae = tiny_vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159)  # the FLUX VAE's constants
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # Z-Image-Turbo's static shift
        pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        def encode(texts):
            # _encode_prompt rewrites the list in place (chat template): hand it a copy
            embeds = self.pipeline.encode_prompt(
                list(texts), device=self.device, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length
            )[0]
            feats = embeds[0].new_zeros(len(embeds), self.max_sequence_length, embeds[0].shape[-1])
            mask = torch.zeros(len(embeds), self.max_sequence_length, dtype=torch.bool, device=feats.device)
            for i, e in enumerate(embeds):
                feats[i, : len(e)] = e
                mask[i, : len(e)] = True
            return {"cap_feats": feats, "cap_mask": mask}

        return PromptEmbeds.from_encoder(encode, prompts, with_uncond, self.negative_prompt)

    def model_timestep(self, t: torch.Tensor) -> torch.Tensor:
        """Sigma -> the transformer's time as the pipeline computes it: ``(1000 - 1000 sigma) / 1000``
        (the scheduler's timesteps are ``1000 sigma``)."""
        n = self.num_train_timesteps
        return (n - t.float() * n) / n

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity ``eps - x0`` at ``(x, t)``: minus the transformer's output (see the module docstring)."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)

        def forward(xb, tb, kw):
            feats, mask = kw["cap_feats"].to(dtype), kw["cap_mask"]
            out = transformer(
                list(xb.to(dtype).unsqueeze(2).unbind(0)),  # one (C, 1 frame, h, w) tensor per sample
                self.model_timestep(tb),
                [f[m] for f, m in zip(feats, mask)],  # the unpadded tokens of each prompt
                patch_size=self.patch_size,
                return_dict=False,
            )[0]
            return -torch.stack(out).squeeze(2)

        return self._guided(forward, x, t, embeds, guidance_scale)

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``ZImagePipeline`` sets them: ``linspace(1, 1/N, N)`` with the
        scheduler's shift (``mu`` from the image tokens, used when it shifts dynamically), then 0."""
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        scheduler = self.pipeline.scheduler
        _, h, w = self.latent_shape(height, width)
        mu = shift_mu(scheduler.config, (h // self.patch_size) * (w // self.patch_size))
        return scheduler_sigmas(scheduler, num_steps, sigmas=get_default_z_image_sigmas(num_steps), mu=mu)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        factor = self.pipeline.vae_scale_factor
        channels = self.pipeline.transformer.config.in_channels
        return self._latent_shape(height, width, multiple=factor * self.patch_size, channels=channels, downsample=factor)
