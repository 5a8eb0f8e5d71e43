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

Source size (``source_resize``): ``"pipeline"`` (the default) resizes a source as
``FluxKontextPipeline.__call__`` does by default (``_auto_resize=True``): to the resolution of
diffusers' ``PREFERRED_KONTEXT_RESOLUTIONS`` whose aspect ratio is nearest the image's (its size
first floored to the VAE factor by the pipeline's ``get_default_height_width``), each side floored to
a multiple of 16 (VAE factor x packing), so a 1216 x 832 photo is encoded at 1248 x 832, not
squashed. The sources of one batch must come out at one size (their latents are stacked): a
batch whose sources fall on different preferred resolutions is a ``ValueError``. ``"square"``
resizes every source to ``image_resolution`` x ``image_resolution`` (default: the adapter's
default resolution, 1024 for FLUX.1 Kontext [dev]), whatever its aspect ratio: a choice of its
own, which conditions the model on a squashed image unlike the pipeline.
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


SOURCE_RESIZE_MODES = ("pipeline", "square")  # the stock pipeline's sizing, or image_resolution square


def check_source_resize(family: str, mode: str) -> str:
    if mode not in SOURCE_RESIZE_MODES:
        raise ModelLoadError(f"{family}: source_resize must be one of {', '.join(SOURCE_RESIZE_MODES)}, got {mode!r}")
    return mode


def kontext_source_size(pipeline, image) -> tuple[int, int]:
    """``(height, width)`` ``FluxKontextPipeline.__call__`` resizes ``image`` to by default
    (``_auto_resize=True``): the preferred Kontext resolution nearest its aspect ratio, sides
    floored to a multiple of ``2 x vae_scale_factor``."""
    from diffusers.pipelines.flux import pipeline_flux_kontext

    height, width = pipeline.image_processor.get_default_height_width(image)
    aspect = width / height
    _, width, height = min((abs(aspect - w / h), w, h) for w, h in pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS)
    multiple = pipeline.vae_scale_factor * 2
    return height // multiple * multiple, width // multiple * multiple


def batch_source_size(family: str, sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The one ``(height, width)`` every source of a batch resizes to; ValueError when they differ."""
    distinct = sorted(set(sizes))
    if len(distinct) > 1:
        shown = ", ".join(f"{h} x {w}" for h, w in distinct)
        raise ValueError(f"{family}: the source images of one batch resize to different sizes ({shown}); give "
                         f"sources of one aspect ratio, or set model.options.source_resize: square")
    return distinct[0]


def preprocess_sources(pipeline, images: list, height: int, width: int) -> tuple[list, torch.Tensor]:
    """``images`` resized to ``height x width`` by the pipeline's own image processor (its
    resampling) and as the pipeline's VAE input ``(B, 3, height, width)`` in [-1, 1]:
    (resized images, tensor)."""
    resized = [pipeline.image_processor.resize(image, height, width) for image in images]
    return resized, pipeline.image_processor.preprocess(resized, height, width)


class FluxKontextAdapter(FluxAdapter):
    """Adapter for ``FluxKontextPipeline``.

    Args:
        pipeline: a loaded ``FluxKontextPipeline``.
        source_resize: ``"pipeline"`` (default): the pipeline's own source size (the preferred
            Kontext resolution nearest the image's aspect ratio); ``"square"``: ``image_resolution``
            square (module docstring).
        image_resolution: with ``source_resize="square"``, the side (pixels) source images are
            resized to; a multiple of 16 (VAE factor x packing). Default: the adapter's default resolution.
        guidance, max_sequence_length: as :class:`~diffalign.adapters.flux.FluxAdapter`
            (FLUX.1 Kontext [dev] is guidance-distilled: ``guidance`` 3.5, the pipeline's default).
    """

    family = "flux_kontext"
    display_name = "FLUX.1 Kontext"
    pipeline_class = "FluxKontextPipeline"
    options = FluxAdapter.options + ("source_resize", "image_resolution")

    def __init__(
        self,
        pipeline,
        *,
        guidance: float = FLUX_DEV_GUIDANCE,
        max_sequence_length: Optional[int] = None,
        source_resize: str = "pipeline",
        image_resolution: Optional[int] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, guidance=guidance, max_sequence_length=max_sequence_length, **base)
        self.source_resize = check_source_resize("flux_kontext", source_resize)
        self.image_resolution = image_resolution or self.default_resolution
        multiple = 2 * self.vae_scale_factor
        if self.image_resolution <= 0 or self.image_resolution % multiple:
            raise ModelLoadError(f"flux_kontext: image_resolution must be a positive multiple of {multiple}, got {image_resolution}")

    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "FluxKontextAdapter":
        """The tiny FLUX.1 build of :meth:`FluxAdapter.build_tiny` as a ``FluxKontextPipeline``;
        source images are resized to 32 px square (16 x 16 latents, 64 more tokens): the pipeline's
        own sizes (about a megapixel) would give its 2x VAE some 65,000 source tokens. Pass
        ``source_resize="pipeline"`` for the pipeline's sizing."""
        kwargs.setdefault("source_resize", "square")
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
        """RGB images -> normalised source latents ``(B, C, h', w')`` at :meth:`source_size`, as
        ``FluxKontextPipeline.prepare_latents`` encodes them (before packing)."""
        pipe = self.pipeline
        _, pixels = preprocess_sources(pipe, images, *self.source_size(images))
        return pipe._encode_vae_image(pixels.to(device=self.device, dtype=pipe.vae.dtype), generator=None).float()

    def source_size(self, images: list) -> tuple[int, int]:
        """``(height, width)`` the batch's source images are resized to (``source_resize``)."""
        if self.source_resize == "square":
            return self.image_resolution, self.image_resolution
        return batch_source_size(self.family, [kontext_source_size(self.pipeline, image) for image in images])

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
