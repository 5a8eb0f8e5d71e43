"""HPS v2 / v2.1: Human Preference Score, an open_clip ViT-H/14 fine-tuned on human choices.

Wu et al. 2023, "Human Preference Score v2: A Solid Benchmark for Evaluating Human Preferences of
Text-to-Image Synthesis". The score is the cosine of open_clip's normalised image and text
features (no temperature), as in the authors' ``hpsv2.score``:

    s(x, c) = cos(E_img(x), E_txt(c))          (about 0.2-0.35 for real generations)

Weights: ``HPS_v2_compressed.pt`` (v2.0) or ``HPS_v2.1_compressed.pt`` (v2.1) from the hub repo
``xswu/HPSv2`` (or a local copy), loaded into ``open_clip.create_model_and_transforms("ViT-H-14")``
with ``pretrained=None``: the checkpoint holds every weight, so the 4 GB LAION weights the
reference code downloads first are skipped.

Preprocessing is open_clip's validation transform (``model.visual.preprocess_cfg``: resize the
shortest side, bicubic, torchvision's ``CenterCrop``, normalise) run on tensors by
:class:`ClipImageTransform` with torchvision's crop offsets. ``preprocess_val`` resamples PIL images
with PIL's bicubic, so resized pixels are close to, not identical with, its own.

open_clip (and through timm, torchvision) is imported only when the reward is built; it is the
``rewards`` extra. torchvision must match torch exactly (``torch==2.14.1 torchvision==0.29.1`` is
a working pair), or ``import open_clip`` fails.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from diffalign.errors import RewardError
from reward_models.base import register
from reward_models.clip_score import ClipImageTransform, ClipScore
from reward_models.loading import check_batch_size, components_dtype, first_line, parse_dtype, resolve_weights_file

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"2.0": "HPS_v2_compressed.pt", "2.1": "HPS_v2.1_compressed.pt"}
HPS_ARCHITECTURE = "ViT-H-14"  # open_clip model config name


def _brief(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line (load_state_dict's first line only says "Error(s) in loading")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def import_open_clip(reward: str) -> Any:
    """``import open_clip`` or a one-line RewardError saying how to install it."""
    try:
        import open_clip
    except Exception as exc:  # ModuleNotFoundError, or a torchvision built for another torch
        raise RewardError(
            f"{reward} needs open_clip, which cannot be imported ({first_line(exc)}): "
            "pip install 'diffalign[rewards]' with a matching torch/torchvision pair, "
            "e.g. torch==2.14.1 torchvision==0.29.1"
        ) from None
    return open_clip


def transform_from_open_clip(reward: str, preprocess_cfg: dict[str, Any]) -> ClipImageTransform:
    """Tensor version of open_clip's validation transform from ``model.visual.preprocess_cfg``."""
    size = preprocess_cfg.get("size", 224)
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    mode = preprocess_cfg.get("resize_mode", "shortest")
    interpolation = preprocess_cfg.get("interpolation", "bicubic")
    if interpolation != "bicubic":
        raise RewardError(f"{reward}: open_clip interpolation {interpolation!r} is not supported (bicubic only)")
    if mode == "shortest" and height == width:
        resize: int | tuple[int, int] = height
        crop: tuple[int, int] | None = (height, width)
    elif mode == "squash":
        resize, crop = (height, width), None
    else:
        raise RewardError(f"{reward}: open_clip resize mode {mode!r} with size {size!r} is not supported")
    mean = tuple(float(v) for v in preprocess_cfg["mean"])
    std = tuple(float(v) for v in preprocess_cfg["std"])
    return ClipImageTransform(resize=resize, crop=crop, mean=mean, std=std,  # type: ignore[arg-type]
                              crop_offsets="torchvision")  # open_clip's CenterCrop is torchvision's


@register("hpsv2")
class HPSv2(ClipScore):
    """HPS v2 reward on open_clip (see the module docstring); ``hpsv2.1`` builds version 2.1.

    Args:
        checkpoint: a local checkpoint file, or a hub repo id holding ``HPS_v2[.1]_compressed.pt``.
        version: "2.0" or "2.1" (selects the file name in the hub repo).
        architecture: open_clip model config name the checkpoint fits.
        device: where the model runs.
        dtype: weights' dtype; scores are float32.
        batch_size: images (and distinct prompts) per forward pass.
    """

    name = "hpsv2"

    def __init__(
        self,
        checkpoint: str = HPS_REPO,
        version: str = "2.0",
        architecture: str = HPS_ARCHITECTURE,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        version = str(version)
        if version not in HPS_FILES:
            raise RewardError(f"hpsv2: unknown version {version!r}; use one of {sorted(HPS_FILES)}")
        self.name = "hpsv2" if version == "2.0" else "hpsv2.1"
        torch_dtype = parse_dtype(dtype)
        open_clip = import_open_clip(self.name)
        if ":" not in architecture and architecture not in open_clip.list_models():  # "hf-hub:" names pass
            message = f"unknown open_clip architecture {architecture!r} (HPS uses {HPS_ARCHITECTURE!r})"
            raise RewardError(f"{self.name}: {message}")
        path = resolve_weights_file(self.name, str(checkpoint), HPS_FILES[version])
        try:
            # open_clip's own checkpoint loader: unwraps {"state_dict": ...}, strips "module.", converts
            # older key layouts and loads strictly (open_clip 3 also refuses pickled code: weights_only).
            model, _, _ = open_clip.create_model_and_transforms(
                architecture, pretrained=path, precision="fp32", output_dict=True
            )
        except Exception as exc:  # unreadable file, or weights of another architecture
            message = f"cannot load {path!r} into open_clip {architecture!r}: {_brief(exc)}"
            raise RewardError(f"{self.name}: {message}") from None
        tokenizer = open_clip.get_tokenizer(architecture)
        self._setup_open_clip(model, tokenizer, device, torch_dtype, batch_size)
        self.model_id = str(checkpoint)

    @classmethod
    def from_components(  # type: ignore[override]
        cls,
        model: torch.nn.Module,
        tokenizer: Any,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> "HPSv2":
        """Wrap a built open_clip ``CLIP`` model and its tokenizer (moved and frozen in place)."""
        self = cls.__new__(cls)
        self._setup_open_clip(model, tokenizer, device, components_dtype(model, dtype), batch_size)
        self.model_id = type(model).__name__
        return self

    def _setup_open_clip(
        self, model: torch.nn.Module, tokenizer: Any, device: Any, dtype: torch.dtype, batch_size: int
    ) -> None:
        check_batch_size(self.name, batch_size)
        transform = transform_from_open_clip(self.name, model.visual.preprocess_cfg)
        # open_clip tokenizers pad / truncate to the context length themselves
        self._setup_scoring(model, tokenizer, transform, device, dtype, batch_size)
        self.scale = 1.0  # HPS is the plain cosine
        self.clip_negative = False

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels ``(B, 3, h, w)`` -> unit-norm float32 embeddings ``(B, D)``."""
        chunks = [self.model.encode_image(chunk) for chunk in pixel_values.split(self.batch_size)]
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """``N`` prompts -> unit-norm float32 embeddings ``(N, D)``."""
        chunks = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = self.tokenizer(list(prompts[start : start + self.batch_size])).to(self.device)
            chunks.append(self.model.encode_text(tokens))
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B,)`` scores; differentiable with respect to ``images``."""
        if len(prompts) != images.shape[0]:
            raise RewardError(f"{self.name}: got {images.shape[0]} images but {len(prompts)} prompts")
        return super().score(images, prompts)


@register("hpsv2.1")
def hpsv2_1(**kwargs: Any) -> HPSv2:
    """HPS v2.1 (retrained on higher-quality data; the version most RL papers report)."""
    if "version" in kwargs:
        raise RewardError("hpsv2.1: the version is fixed; use reward 'hpsv2' with version=... instead")
    return HPSv2(version="2.1", **kwargs)
