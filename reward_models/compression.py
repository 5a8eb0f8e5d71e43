"""Weight-free pixel rewards: JPEG (in)compressibility as in DDPO, and mean brightness.

JPEG compressibility (Black et al. 2023, "Training Diffusion Models with Reinforcement
Learning", Sec. 6.1): each image is encoded as a JPEG with PIL and the reward is the file size
in kilobytes (1 kB = 1000 bytes, as in ddpo-pytorch), negated for compressibility. The encoder
runs on the CPU on uint8 pixels, so these rewards are not differentiable.

``brightness`` is the mean pixel value in ``[0, 1]``: deterministic, instant and differentiable,
meant for quick tests and smoke runs, not for real training.
"""

from __future__ import annotations

import io
from typing import Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register

DEFAULT_JPEG_QUALITY = 95  # DDPO's setting; PIL documents qualities above 95 as wasteful
BYTES_PER_KB = 1000  # ddpo-pytorch divides by 1000, not 1024


def jpeg_sizes_kb(images: torch.Tensor, quality: int = DEFAULT_JPEG_QUALITY) -> torch.Tensor:
    """JPEG file size of each image in kB: ``(B, 3, H, W)`` in ``[0, 1]`` -> float32 ``(B,)`` on CPU."""
    from PIL import Image  # lazy: only needed when the reward is called

    check_images(images)
    pixels = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3), the layout PIL expects
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / BYTES_PER_KB)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegSize:
    """Reward ``sign * size_kb``: ``sign = -1`` rewards compressible images, ``+1`` incompressible."""

    def __init__(self, sign: float, quality: int = DEFAULT_JPEG_QUALITY) -> None:
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise RewardError(f"jpeg reward: quality must be an integer in [1, 100], got {quality!r}")
        self.sign = sign
        self.quality = quality
        self.last_info: dict[str, float] = {}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        sizes = jpeg_sizes_kb(images, self.quality)
        self.last_info = {"jpeg_size_kb": sizes.mean().item()} if len(sizes) else {}
        return self.sign * sizes


@register("jpeg_compressibility")
def jpeg_compressibility(device: str | torch.device | None = None, quality: int = DEFAULT_JPEG_QUALITY) -> JpegSize:
    """Reward = -(JPEG size in kB). ``device`` is accepted for the common factory signature and unused."""
    return JpegSize(sign=-1.0, quality=quality)


@register("jpeg_incompressibility")
def jpeg_incompressibility(device: str | torch.device | None = None, quality: int = DEFAULT_JPEG_QUALITY) -> JpegSize:
    """Reward = +(JPEG size in kB). ``device`` is accepted for the common factory signature and unused."""
    return JpegSize(sign=1.0, quality=quality)


class Brightness:
    """Reward = mean pixel value of each image over channels and pixels, in ``[0, 1]``."""

    differentiable = True  # a mean of the pixels: the gradient is 1 / (3 H W) per pixel

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        check_images(images)
        return images.float().mean(dim=(1, 2, 3))  # (B,), on the images' device, keeps the graph


@register("brightness")
def brightness(device: str | torch.device | None = None) -> Brightness:
    """Deterministic test reward: mean brightness. ``device`` is unused (computed where the images are)."""
    return Brightness()
