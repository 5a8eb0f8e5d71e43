"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image conditioned on a source image to edit.

The transformer, VAE, schedule, packing and norm-rescaled true CFG are Qwen-Image's
(:mod:`diffalign.adapters.qwen`). The source image conditions the model twice, as in
``QwenImageEditPipeline.__call__``:

- **text**: the Qwen2.5-VL encoder *sees* the image. The instruction goes into the edit chat
  template (a system prompt whose 64 tokens are dropped, then ``<|vision_start|>``, the image's
  vision tokens, ``<|vision_end|>``, the instruction); the processor turns the image into 14 px
  patches for the vision tower. The negative prompt (CFG) is encoded with the same image.
- **latents**: the image, VAE-encoded (the mode) and normalised with the per-channel statistics,
  is 2x2-packed and appended to the noisy latent's tokens (``img_shapes`` lists both grids); only
  the first tokens' output is the velocity.

Where the conditioning lives: prompts are :class:`~diffalign.images.ImagePrompt` s (text plus a
source image path, from a prompt file's ``prompts.image_column``); ``encode_prompts`` returns the
VL text states and the source latents (``image_latents``, the same in both CFG halves) as prompt
embeddings, so sampling and re-scoring in an update use the same conditioning.

Source size (``source_resize``): ``"pipeline"`` (the default) resizes a source as
``QwenImageEditPipeline.__call__`` does: to diffusers' ``calculate_dimensions(source_area,
width / height)``, the image's aspect ratio at an area of ``source_area`` pixels (the pipeline's
1024 x 1024), sides rounded to multiples of 32; the VL encoder sees that resized image too (as the
pipeline does when given one image: given a list, its ``image_processor.resize`` leaves the images
unresized for the VL encoder). The
sources of one batch must come out at one size (their latents are stacked): a batch whose sources
have other aspect ratios is a ``ValueError``. ``"square"`` resizes every source to
``image_resolution`` x ``image_resolution`` (default 1024), whatever its aspect ratio: a choice of
its own, which conditions the model on a squashed image unlike the pipeline. The generated image
is ``model.resolution`` square either way (the pipeline's own default output size is the source's
calculated size). Text: the VL states are cut or zero-padded to ``max_sequence_length`` (default:
512 text tokens plus the batch's vision tokens and their two markers), masked as in Qwen-Image.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ModelLoadError
from ._tiny import QWEN_EDIT_TEMPLATE_WORDS, QWEN_VISION_TOKENS, tiny_qwen2_tokenizer, tiny_qwen_vl_processor
from .base import PromptEmbeds
from .flux import pack_latents
from .flux_kontext import SOURCE_KEY, batch_source_size, check_source_resize, preprocess_sources, source_images
from .qwen import QWEN_MAX_SEQUENCE_LENGTH, QWEN_NEGATIVE_PROMPT, QwenImageAdapter, padded_text, tiny_qwen_parts

VISION_MARKERS = 2  # <|vision_start|> and <|vision_end|> around an image's vision tokens
TINY_TEXT_TOKENS = 16  # text tokens of the tiny build (Qwen-Image's tiny build uses the same)
SOURCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s target area for the source image (pixels)


def vision_tokens(processor, height: int, width: Optional[int] = None) -> int:
    """The number of vision tokens Qwen2.5-VL's processor gives a ``height x width`` image (its
    patches after the ``merge_size x merge_size`` merge); ``width`` defaults to ``height``."""
    image_processor = processor.image_processor
    width = height if width is None else width
    return image_processor.get_number_of_image_patches(height, width, {}) // image_processor.merge_size ** 2


def qwen_edit_source_size(image, area: int = SOURCE_AREA) -> tuple[int, int]:
    """``(height, width)`` ``QwenImageEditPipeline.__call__`` resizes ``image`` (a PIL image) to:
    diffusers' ``calculate_dimensions`` at ``area`` pixels and the image's aspect ratio."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(area, image.size[0] / image.size[1])
    return height, width


class QwenImageEditAdapter(QwenImageAdapter):
    """Adapter for ``QwenImageEditPipeline``.

    Args:
        pipeline: a loaded ``QwenImageEditPipeline``.
        source_resize: ``"pipeline"`` (default): the pipeline's own source size (the image's
            aspect ratio at ``source_area`` pixels); ``"square"``: ``image_resolution`` square.
        source_area: the target area (pixels) of ``"pipeline"`` sizing (default 1024 x 1024, the
            pipeline's).
        image_resolution: with ``source_resize="square"``, the side (pixels) source images are
            resized to (a multiple of 16; default 1024).
        max_sequence_length: text-encoder tokens kept per prompt after the template's prefix
            (vision tokens included); default 512 plus the batch's vision tokens and markers.
        negative_prompt: the prompt of the unconditional branch (default ``" "``).
    """

    family = "qwen_edit"
    display_name = "Qwen-Image-Edit"
    pipeline_class = "QwenImageEditPipeline"
    options = QwenImageAdapter.options + ("source_resize", "source_area", "image_resolution")

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: Optional[int] = None,
        negative_prompt: str = QWEN_NEGATIVE_PROMPT,
        source_resize: str = "pipeline",
        source_area: int = SOURCE_AREA,
        image_resolution: Optional[int] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        self.source_resize = check_source_resize("qwen_edit", source_resize)
        if int(source_area) <= 0:
            raise ModelLoadError(f"qwen_edit: source_area must be a positive number of pixels, got {source_area}")
        self.source_area = int(source_area)
        self.image_resolution = image_resolution or pipeline.default_sample_size * pipeline.vae_scale_factor
        multiple = 2 * pipeline.vae_scale_factor
        if self.image_resolution <= 0 or self.image_resolution % multiple:
            raise ModelLoadError(f"qwen_edit: image_resolution must be a positive multiple of {multiple}, got {image_resolution}")
        # square sources: one count for every batch; the pipeline's sizing: the batch's (see encode_prompts)
        self.vision_tokens = vision_tokens(pipeline.processor, self.image_resolution) if source_resize == "square" else None
        self.fixed_sequence_length = max_sequence_length is not None
        if max_sequence_length is None:
            max_sequence_length = QWEN_MAX_SEQUENCE_LENGTH + (self.vision_tokens or 0) + VISION_MARKERS
        super().__init__(pipeline, max_sequence_length=max_sequence_length, negative_prompt=negative_prompt, **base)

    def _text_limit(self, tokens: Optional[int] = None) -> int:
        """Qwen-Image's 1024 text tokens plus an image's vision tokens (default: the square
        source's; unknown before a batch under the pipeline's sizing: a bound of none) and markers."""
        tokens = self.vision_tokens if tokens is None else tokens
        if tokens is None:
            return 1 << 30
        return self.pipeline.tokenizer_max_length + tokens + VISION_MARKERS

    def sequence_length(self, tokens: int) -> int:
        """Text states kept for a batch whose images give ``tokens`` vision tokens."""
        if not self.fixed_sequence_length:
            return QWEN_MAX_SEQUENCE_LENGTH + tokens + VISION_MARKERS
        if self.max_sequence_length > self._text_limit(tokens):
            raise ValueError(f"qwen_edit: max_sequence_length {self.max_sequence_length} is more than the "
                             f"{self._text_limit(tokens)} tokens of this batch's template, text and image")
        return self.max_sequence_length

    def source_size(self, images: list) -> tuple[int, int]:
        """``(height, width)`` the batch's source images are resized to (``source_resize``)."""
        if self.source_resize == "square":
            return self.image_resolution, self.image_resolution
        return batch_source_size(self.family, [qwen_edit_source_size(image, self.source_area) for image in images])

    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "QwenImageEditAdapter":
        """The tiny Qwen-Image components (:func:`~diffalign.adapters.qwen.tiny_qwen_parts`) with a
        tokenizer that also holds the edit template's words (its 64-token prefix) and the vision
        tokens, and a Qwen2-VL processor (:func:`~diffalign.adapters._tiny.tiny_qwen_vl_processor`):
        a 32 px square source gives 4 vision tokens and 64 more latent tokens (the pipeline's own
        sizes, about a megapixel, would give its 2x VAE some 65,000; pass ``source_resize="pipeline"``
        and a small ``source_area`` for the pipeline's sizing)."""
        from diffusers import QwenImageEditPipeline

        kwargs.setdefault("source_resize", "square")
        kwargs.setdefault("image_resolution", 32)
        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer(extra_words=QWEN_EDIT_TEMPLATE_WORDS, extra_special=QWEN_VISION_TOKENS)
        ids = dict(image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                   video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
                   vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"))
        processor = tiny_qwen_vl_processor(tokenizer)
        pipe = QwenImageEditPipeline(tokenizer=tokenizer, processor=processor, **tiny_qwen_parts(tokenizer, **ids))
        if "max_sequence_length" not in kwargs and kwargs["source_resize"] == "square":
            kwargs["max_sequence_length"] = TINY_TEXT_TOKENS + vision_tokens(processor, kwargs["image_resolution"]) + VISION_MARKERS
        return cls(pipe, device=device, dtype=dtype, **kwargs)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        """The VL states of each instruction with its source image (and of the negative prompt
        with the same image for CFG), padded to ``max_sequence_length``, plus the source latents."""
        images = source_images(prompts, self.family)
        if images is None:
            raise ValueError("qwen_edit: every prompt needs a source image (a prompt file with prompts.image_column)")
        pipe = self.pipeline
        height, width = self.source_size(images)
        resized, pixels = preprocess_sources(pipe, images, height, width)
        length = self.sequence_length(vision_tokens(pipe.processor, height, width))

        def encode(texts):
            embeds, mask = pipe.encode_prompt(list(texts), image=resized, device=self.device)
            return padded_text(embeds, mask, length)

        latents = pipe._encode_vae_image(pixels.unsqueeze(2).to(device=self.device, dtype=pipe.vae.dtype), generator=None)
        latents = latents[:, :, 0].float()  # (B, C, h', w'): the single frame
        cond = {**encode(prompts), SOURCE_KEY: latents}
        uncond = {**encode([self.negative_prompt] * len(prompts)), SOURCE_KEY: latents} if with_uncond else None
        return PromptEmbeds(cond, uncond)

    def _source_tokens(self, kw: dict, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, tuple[int, int, int]]]:
        source = kw[SOURCE_KEY]
        h, w = source.shape[-2:]
        return pack_latents(source.to(dtype)), (1, h // 2, w // 2)
