"""CLIP score: prompt-image agreement measured by a CLIP model (transformers' ``CLIPModel``).

reward = scale * cos(E_img(x), E_txt(prompt))                      (default, scale = 100)
reward = scale * max(cos(E_img(x), E_txt(prompt)), 0)              (``clip_negative=True``)

The clipped form is CLIPScore as defined by Hessel et al. 2021 ("CLIPScore: A Reference-free
Evaluation Metric for Image Captioning"), who use w = 2.5; torchmetrics' ``CLIPScore`` uses
w = 100, which is the default here. The unclipped form is the default because RL advantages
need the signal below zero too (a clamp at zero gives every badly matching image the same reward).

Preprocessing runs on tensors (no PIL round trip), batched and differentiable:
resize the shortest side to the processor's size (bicubic, antialiased), centre crop to the
processor's crop size, normalise with the processor's mean / std. The numbers are read from the
model's ``preprocessor_config.json`` when present, else CLIP's own constants and the model's
``vision_config.image_size``. Torch's bicubic kernel (a = -0.75) differs slightly from PIL's
(a = -0.5), so resized pixels are close to, not identical with, ``CLIPImageProcessor``'s.

``__call__`` runs without gradients (RL rewards); ``score`` keeps the graph for direct reward
backpropagation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from diffalign.errors import RewardError
from reward_models.base import check_images, register
from reward_models.loading import (check_batch_size, components_dtype, first_line, frozen, hub_id_or_folder, parse_dtype,
                                   pooled_output, processor_config_or_none)

DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DEFAULT_SCALE = 100.0  # torchmetrics' CLIPScore weight; Hessel et al. use 2.5
# OpenAI CLIP's normalisation constants (same as CLIPImageProcessor's defaults).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Centre-crop offset of a side ``d`` pixels longer than the crop, as each library computes it.
CROP_OFFSETS = {
    "transformers": lambda d: d // 2,  # transformers.image_transforms.center_crop
    "torchvision": lambda d: int(round(d / 2.0)),  # torchvision.transforms.functional.center_crop (half to even)
}


@dataclass(frozen=True)
class ClipImageTransform:
    """Tensor version of ``CLIPImageProcessor``: ``(B, 3, H, W)`` in [0, 1] -> normalised pixels.

    ``resize``: an int resizes the shortest side to it keeping the aspect ratio (the long side
    becomes ``int(resize * long / short)`` as in transformers); ``(h, w)`` resizes to exactly that.
    ``crop``: ``(h, w)`` of the centre crop, or None for no crop.
    ``crop_offsets``: how the crop's top / left offset rounds half a pixel when the resized side
    minus the crop is odd. ``"transformers"``: ``d // 2`` (``CLIPImageProcessor``'s ``center_crop``,
    which CLIPScore, PickScore and the aesthetic scorers of DDPO / Flow-GRPO run);
    ``"torchvision"``: ``int(round(d / 2))`` (``transforms.CenterCrop``, Python's round half to
    even, which OpenAI's ``clip``, BLIP / ImageReward and open_clip / HPSv2 run). They differ by one
    pixel when ``d % 4 == 3``: SDXL's 832 x 1216 resized to 224 x 327, for one.
    """

    resize: int | tuple[int, int]
    crop: tuple[int, int] | None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    crop_offsets: str = "transformers"

    def __post_init__(self) -> None:
        if self.crop_offsets not in CROP_OFFSETS:
            raise RewardError(f"crop_offsets must be one of {sorted(CROP_OFFSETS)}, got {self.crop_offsets!r}")

    @classmethod
    def from_processor_config(cls, config: dict[str, Any] | None, image_size: int) -> "ClipImageTransform":
        """From a ``preprocessor_config.json`` dict; ``None`` gives CLIP's defaults at ``image_size``."""
        if not config:
            return cls(resize=image_size, crop=(image_size, image_size))
        size = config.get("size", image_size)
        if isinstance(size, dict):
            if "shortest_edge" in size:
                resize: int | tuple[int, int] = int(size["shortest_edge"])
            elif "height" in size and "width" in size:
                resize = (int(size["height"]), int(size["width"]))
            else:
                raise RewardError(f"clip_score: unsupported image processor size {size!r}")
        else:
            resize = int(size)
        crop = None
        if config.get("do_center_crop", True):
            crop_size = config.get("crop_size", image_size)
            if isinstance(crop_size, dict):
                crop = (int(crop_size["height"]), int(crop_size["width"]))
            else:
                crop = (int(crop_size), int(crop_size))
        if config.get("do_normalize", True):
            mean = tuple(float(v) for v in config.get("image_mean", CLIP_MEAN))
            std = tuple(float(v) for v in config.get("image_std", CLIP_STD))
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        return cls(resize=resize, crop=crop, mean=mean, std=std)  # type: ignore[arg-type]

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) after resizing and cropping an image of the given size."""
        if self.crop is not None:
            return self.crop
        return self._resized_size(height, width)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if isinstance(self.resize, tuple):
            return self.resize
        short, long = min(height, width), max(height, width)
        new_long = int(self.resize * long / short)
        return (self.resize, new_long) if height <= width else (new_long, self.resize)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] -> float32 ``(B, 3, h, w)`` normalised; keeps the graph."""
        x = images.float()
        new_h, new_w = self._resized_size(x.shape[-2], x.shape[-1])
        if (new_h, new_w) != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
            x = x.clamp(0.0, 1.0)  # bicubic overshoots; the uint8 reference path clips here too
        if self.crop is not None:
            crop_h, crop_w = self.crop
            if crop_h > new_h or crop_w > new_w:
                raise RewardError(f"clip_score: crop {self.crop} is larger than the resized image ({new_h}, {new_w})")
            offset = CROP_OFFSETS[self.crop_offsets]
            top, left = offset(new_h - crop_h), offset(new_w - crop_w)
            x = x[..., top : top + crop_h, left : left + crop_w]
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std


@register("clip_score")
class ClipScore:
    """CLIP score reward; see the module docstring for the formula.

    Args:
        model: hub id or local folder with a CLIP model, its tokenizer and (optionally) its
            ``preprocessor_config.json``.
        device: where the CLIP model runs; images are moved there.
        dtype: model weights' dtype (``"float32"``, ``"bfloat16"``, ...); scores are float32.
        batch_size: images (and distinct prompts) per forward pass.
        scale: ``w`` in ``w * cos``.
        clip_negative: use ``w * max(cos, 0)`` (CLIPScore as published) instead of ``w * cos``.
    """

    differentiable = True  # score() keeps the graph to the images (DRaFT / ReFL); PickScore and HPSv2 inherit it

    def __init__(
        self,
        model: str = DEFAULT_CLIP_MODEL,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        scale: float = DEFAULT_SCALE,
        clip_negative: bool = False,
    ) -> None:
        torch_dtype = parse_dtype(dtype)
        clip_model, tokenizer, processor_config = self._load(str(model), torch_dtype)
        self._setup(clip_model, tokenizer, processor_config, device, torch_dtype, batch_size, scale, clip_negative)
        self.model_id = str(model)

    @classmethod
    def from_components(
        cls,
        model: torch.nn.Module,
        tokenizer: Any,
        image_processor_config: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        scale: float = DEFAULT_SCALE,
        clip_negative: bool = False,
    ) -> "ClipScore":
        """Wrap an already-built ``CLIPModel`` and tokenizer (tests, or models shared with other code).

        ``image_processor_config`` is a ``preprocessor_config.json`` dict (None: CLIP's defaults).
        ``dtype=None`` keeps the model's own dtype. The model is moved, set to eval and frozen in place.
        """
        self = cls.__new__(cls)
        self._setup(model, tokenizer, image_processor_config, device, components_dtype(model, dtype), batch_size, scale,
                    clip_negative)
        self.model_id = type(model).__name__
        return self

    @staticmethod
    def _load(model: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, dict[str, Any] | None]:
        path = hub_id_or_folder("clip_score", "model", model)
        from transformers import AutoTokenizer, CLIPModel  # lazy: transformers takes seconds to import

        try:
            clip_model = CLIPModel.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # OSError (offline, missing files), ValueError (bad id / config), ...
            raise RewardError(f"clip_score: cannot load CLIP model {model!r}: {first_line(exc)}") from None
        return clip_model, tokenizer, processor_config_or_none(path)

    def _setup(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        processor_config: dict[str, Any] | None,
        device: str | torch.device | None,
        dtype: torch.dtype,
        batch_size: int,
        scale: float,
        clip_negative: bool,
    ) -> None:
        check_batch_size("clip_score", batch_size)
        image_size = int(model.config.vision_config.image_size)
        transform = ClipImageTransform.from_processor_config(processor_config, image_size)
        self._setup_scoring(model, tokenizer, transform, device, dtype, batch_size)
        # Prompts longer than the text encoder's positions are truncated (77 tokens for OpenAI CLIP).
        self.max_length = min(int(tokenizer.model_max_length), int(model.config.text_config.max_position_embeddings))
        self.scale = float(scale)
        self.clip_negative = bool(clip_negative)

    def _setup_scoring(self, model: torch.nn.Module, tokenizer: Any, transform: "ClipImageTransform",
                       device: str | torch.device | None, dtype: torch.dtype, batch_size: int) -> None:
        """What scoring reads in every CLIP-like reward (the subclasses too): the model frozen on
        ``device`` (None: the CPU) in ``dtype``, its tokenizer and image transform, the batch size."""
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.model = frozen(model, self.device, dtype)
        self.tokenizer = tokenizer
        self.transform = transform
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] -> pixel values ``(B, 3, h, w)`` on the model's device and dtype."""
        check_images(images)
        return self.transform(images.to(self.device)).to(self.dtype)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels ``(B, 3, h, w)`` -> unit-norm float32 embeddings ``(B, D)``."""
        chunks = [
            pooled_output(self.model.get_image_features(pixel_values=chunk)) for chunk in pixel_values.split(self.batch_size)
        ]
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """``N`` prompts -> unit-norm float32 embeddings ``(N, D)``."""
        chunks = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = self.tokenizer(
                list(prompts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            features = self.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            )
            chunks.append(pooled_output(features))
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B,)`` scores on the images' device; differentiable with respect to ``images``."""
        if len(prompts) != images.shape[0]:
            raise RewardError(f"clip_score: got {images.shape[0]} images but {len(prompts)} prompts")
        if images.shape[0] == 0:
            return torch.zeros(0, device=images.device)
        image_emb = self.image_embeddings(self.preprocess(images))
        # GRPO-style groups repeat each prompt many times: encode each distinct prompt once.
        position = {prompt: i for i, prompt in enumerate(dict.fromkeys(prompts))}
        text_emb = self.text_embeddings(list(position))
        index = torch.tensor([position[p] for p in prompts], device=text_emb.device)
        cosine = (image_emb * text_emb[index]).sum(dim=-1)  # (B,)
        if self.clip_negative:
            cosine = cosine.clamp(min=0.0)
        return (self.scale * cosine).to(images.device)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        with torch.set_grad_enabled(images.requires_grad and torch.is_grad_enabled()):  # a graph only when trained through
            return self.score(images, prompts)
