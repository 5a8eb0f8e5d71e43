"""Image utilities shared by training, evaluation, the DRM and the preference-pair code.

Images are ``(N, 3, H, W)`` tensors: float in [0, 1] as samplers return them, or uint8 in
[0, 255] as pair files store them. Videos (video models) are ``(N, F, 3, H, W)``, frames second.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def image_grid(images: torch.Tensor, nrow: int) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> uint8 (rows*H + pad, nrow*W + pad, 3) grid with 1px gaps."""
    n, _, h, w = images.shape
    rows = math.ceil(n / nrow)
    grid = np.ones((rows * (h + 1) + 1, nrow * (w + 1) + 1, 3), dtype=np.uint8) * 255
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = arr[i]
    return grid


def frame_strips(videos: torch.Tensor, max_frames: int = 8) -> np.ndarray:
    """(N, F, 3, H, W) in [0, 1] -> uint8 grid with one row per video: up to ``max_frames``
    frames evenly spaced from the first to the last, left to right."""
    f = videos.shape[1]
    index = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    strips = videos[:, index]  # (N, F', 3, H, W)
    return image_grid(strips.flatten(0, 1), nrow=strips.shape[1])


def sample_grid(samples: torch.Tensor, nrow: int = 8) -> np.ndarray:
    """The grid of a batch of samples: images (N, 3, H, W) ``nrow`` per row, or videos
    (N, F, 3, H, W) as :func:`frame_strips` (one video per row)."""
    return frame_strips(samples) if samples.ndim == 5 else image_grid(samples, nrow=nrow)


def save_png(array: np.ndarray, path: Path, scale: int = 1) -> None:
    from PIL import Image

    img = Image.fromarray(array)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def resize(images: torch.Tensor, resolution: int) -> torch.Tensor:
    """uint8 ``(N, 3, H, W)`` resized (bicubic, antialiased) to ``resolution`` when needed."""
    if images.shape[-1] == resolution and images.shape[-2] == resolution:
        return images
    x = F.interpolate(images.float(), size=(resolution, resolution), mode="bicubic", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)
