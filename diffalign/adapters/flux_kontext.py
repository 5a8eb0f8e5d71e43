"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 conditioned on a source image to edit.

The transformer is FLUX.1's. The source image is VAE-encoded (the distribution's mode, so the
same image always gives the same latents), normalised as FLUX.1 latents and 2x2-packed; its
tokens are appended to the noisy latent's tokens with RoPE ids ``(1, row, col)`` (the noisy
latent's are ``(0, row, col)``), and only the first tokens' output is the velocity, as in
``FluxKontextPipeline.__call__``.

Where the conditioning lives: prompts are :class:`~diffalign.images.ImagePrompt` s (text plus a
source image path, from a prompt file's ``prompts.image_column``). ``encode_prompts`` puts the
source latents ``(B, C, h', w')`` into the prompt embeddings under ``image_latents`` (the same
tensor in the unconditional half: true CFG changes the text only, as the pipeline), so every
sampler, kernel and update that carries prompt embeddings carries the same conditioning, for
sampling and for re-scoring alike. Plain text prompts give FLUX.1 text-to-image.

Source size: every source image is resized to ``image_resolution`` square (default: the
adapter's default resolution, 1024 for FLUX.1 Kontext [dev], the pipeline's preferred square
size), so that embeddings of any two batches can be concatenated. The pipeline instead picks the
preferred Kontext resolution nearest the image's aspect ratio (``_auto_resize``); a square
source at ``image_resolution`` gives the same latents.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ModelLoadError
from ..images import load_rgb, prompt_image
from .base import PromptEmbeds
from .flux import FLUX_DEV_GUIDANCE, FluxAdapter, latent_image_ids, pack_latents

SOURCE_KEY = "image_latents"  # the prompt-embedding key of the source image's latents


def source_images(prompts: Sequence[str], family: str) -> Optional[list]:
    """The source images (RGB ``PIL.Image``) of editing prompts, or None when no prompt has one;
    a batch that mixes prompts with and without a source image is a ``ValueError``."""
    paths = [prompt_image(p) for p in prompts]
    if all(path is None for path in paths):
        return None
    if any(path is None for path in paths):
        raise ValueError(f"{family}: a batch mixes prompts with and without a source image")
    return [load_rgb(path) for path in paths]


def preprocess_sources(pipeline, images: list, side: int) -> tuple[list, torch.Tensor]:
    """``images`` resized to ``side x side`` by the pipeline's own image processor (its resampling)
    and as the pipeline's VAE input ``(B, 3, side, side)`` in [-1, 1]: (resized images, tensor)."""
    resized = [pipeline.image_processor.resize(image, side, side) for image in images]
    return resized, pipeline.image_processor.preprocess(resized, side, side)


class FluxKontextAdapter(FluxAdapter):
    """Adapter for ``FluxKontextPipeline``.

    Args:
        pipeline: a loaded ``FluxKontextPipeline``.
        image_resolution: the side (pixels) source images are resized to before encoding;
            a multiple of 16 (VAE factor x packing). Default: the adapter's default resolution.
        guidance, max_sequence_length: as :class:`~diffalign.adapters.flux.FluxAdapter`
            (FLUX.1 Kontext [dev] is guidance-distilled: ``guidance`` 3.5, the pipeline's default).
    """

    family = "flux_kontext"
    display_name = "FLUX.1 Kontext"
    pipeline_class = "FluxKontextPipeline"
    options = FluxAdapter.options + ("image_resolution",)

    def __init__(
        self,
        pipeline,
        *,
        guidance: float = FLUX_DEV_GUIDANCE,
        max_sequence_length: Optional[int] = None,
        image_resolution: Optional[int] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, guidance=guidance, max_sequence_length=max_sequence_length, **base)
        self.image_resolution = image_resolution or self.default_resolution
        multiple = 2 * self.vae_scale_factor
        if self.image_resolution <= 0 or self.image_resolution % multiple:
            raise ModelLoadError(f"flux_kontext: image_resolution must be a positive multiple of {multiple}, got {image_resolution}")

    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "FluxKontextAdapter":
        """The tiny FLUX.1 build of :meth:`FluxAdapter.build_tiny` as a ``FluxKontextPipeline``;
        source images are resized to 32 px (16 x 16 latents, 64 more tokens)."""
        kwargs.setdefault("image_resolution", 32)
        return super().build_tiny(device=device, dtype=dtype, seed=seed, **kwargs)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        """FLUX.1's text embeddings, plus the source latents under ``image_latents`` in both
        halves when the prompts carry source images."""
        embeds = super().encode_prompts(prompts, with_uncond=with_uncond)
        images = source_images(prompts, self.family)
        if images is None:
            return embeds
        latents = self.encode_sources(images)
        for half in (embeds.cond, embeds.uncond):
            if half is not None:
                half[SOURCE_KEY] = latents
        return embeds

    @torch.no_grad()
    def encode_sources(self, images: list) -> torch.Tensor:
        """RGB images -> normalised source latents ``(B, C, h', w')`` at ``image_resolution``, as
        ``FluxKontextPipeline.prepare_latents`` encodes them (before packing)."""
        pipe = self.pipeline
        _, pixels = preprocess_sources(pipe, images, self.image_resolution)
        return pipe._encode_vae_image(pixels.to(device=self.device, dtype=pipe.vae.dtype), generator=None).float()

    def _source_tokens(self, kw: dict, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        source = kw.get(SOURCE_KEY)
        if source is None:
            return None
        h, w = source.shape[-2:]
        key = ("source", h, w, str(source.device), dtype, torch.is_inference_mode_enabled())
        if key not in self._constants:  # the ids depend on the shape only
            ids = latent_image_ids(h, w, source.device, dtype)
            ids[:, 0] = 1  # the pipeline's marker of the conditioning image
            self._constants[key] = ids
        return pack_latents(source.to(dtype)), self._constants[key]
