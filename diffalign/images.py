"""Image utilities shared by training, evaluation, the DRM and the preference-pair code.

Images are ``(N, 3, H, W)`` tensors: float in [0, 1] as samplers return them, or uint8 in
[0, 255] as pair files store them. Videos (video models) are ``(N, F, 3, H, W)``, frames second.

Editing prompts carry the image an edit starts from: :class:`ImagePrompt` (a ``str`` with an
``image`` path), read by editing adapters (conditioning) and, through :func:`prompt_metadata`, by
rewards (the ``source_image`` entry of each sample's metadata).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F


class ImagePrompt(str):
    """An editing instruction with its source image: the text, and ``image``, the absolute path of
    the image the edit starts from.

    A ``str``, so every part that passes prompts along (prompt sampler, group planning, rollouts,
    evaluation) passes it unchanged, and text rewards read the instruction as before; an editing
    adapter's ``encode_prompts`` reads ``image`` and puts the source image's latents into the
    prompt embeddings, so the same conditioning is used for sampling and for re-scoring in an
    update. Equality and hash include the image (one instruction on two images is two prompts).
    String operations (``strip``, slicing, formatting) return plain text.
    """

    image: str

    def __new__(cls, text: str, image: str | Path) -> "ImagePrompt":
        prompt = super().__new__(cls, text)
        prompt.image = str(image)
        return prompt

    def __getnewargs__(self) -> tuple[str, str]:  # pickling (worker threads, process groups)
        return str(self), self.image

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True and getattr(other, "image", None) == self.image

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((str(self), self.image))

    def __repr__(self) -> str:
        return f"ImagePrompt({str(self)!r}, image={self.image!r})"


def prompt_image(prompt: str) -> str | None:
    """The source image path of an editing prompt (:class:`ImagePrompt`), else None."""
    return getattr(prompt, "image", None)


def prompt_metadata(prompts: Sequence[str]) -> list[dict]:
    """Per-sample reward metadata of ``prompts``: ``{"source_image": path}`` for an editing prompt,
    ``{}`` for plain text."""
    return [{"source_image": prompt_image(p)} if prompt_image(p) is not None else {} for p in prompts]


def prompt_record(prompt: str) -> str | dict:
    """A prompt as a run records it (``prompts.json``): the text, or ``{"prompt", "image"}`` for an
    editing prompt."""
    image = prompt_image(prompt)
    return str(prompt) if image is None else {"prompt": str(prompt), "image": image}


def prompt_from_record(record) -> str | None:
    """The inverse of :func:`prompt_record`; None for anything else."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("image"), str):
        return ImagePrompt(record["prompt"], record["image"])
    return None


def load_rgb(path: str | Path):
    """The image at ``path`` as an RGB ``PIL.Image`` (fully read: a damaged file fails here)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def to_tensor(image) -> torch.Tensor:
    """An RGB ``PIL.Image`` -> float ``(3, H, W)`` in [0, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255


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


def short_prompt(prompt: str) -> str:
    """A prompt without its ``a photo of`` head and first article: ``a photo of two red circles``
    -> ``two red circles``."""
    words = prompt.split()
    if [w.lower() for w in words[:3]] == ["a", "photo", "of"]:
        words = words[3:]
        if len(words) > 1 and words[0].lower() in ("a", "an"):
            words = words[1:]
    return " ".join(words)


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


PASS_COLOR = (22, 150, 60)  # green mark: the image passes ShapesEval
FAIL_COLOR = (200, 30, 30)  # red mark: it fails
LABEL_LINES = 3  # text lines under each tile; longer labels are cut with "..."


def _wrap(text: str, width: int, lines: int) -> list[str]:
    """``text`` broken at spaces into at most ``lines`` lines of at most ``width`` characters."""
    out: list[str] = []
    for word in text.split():
        if out and len(out[-1]) + 1 + len(word) <= width:
            out[-1] += " " + word
        else:
            out.append(word[:width])
    if len(out) > lines:
        out = out[:lines]
        out[-1] = out[-1][: max(width - 3, 1)] + "..."
    return out


def labelled_grid(images: torch.Tensor, labels: Sequence[str], marks: Sequence[bool | None] | None = None,
                  nrow: int = 4, tile: int = 128) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> uint8 grid of ``tile``-pixel tiles, each with its label under it.

    ``marks[i]`` True / False draws a green "pass" / red "fail" square in the tile's corner and
    starts its label with the word (None: no mark). Tiles are resized to ``tile`` pixels (nearest
    when enlarging, so small ShapesWorld images stay sharp) to keep the file a few hundred KB."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(images)
    if len(labels) != n or (marks is not None and len(marks) != n):
        raise ValueError(f"labelled_grid: {n} images, {len(labels)} labels, {len(marks or [])} marks")
    font = ImageFont.load_default()
    char_w, line_h = 6, 11  # the default bitmap font's cell, pixels
    text_h = LABEL_LINES * line_h + 4
    rows = math.ceil(n / nrow)
    canvas = Image.new("RGB", (nrow * (tile + 2) + 2, rows * (tile + text_h + 2) + 2), "white")
    draw = ImageDraw.Draw(canvas)
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        x, y = 2 + c * (tile + 2), 2 + r * (tile + text_h + 2)
        img = Image.fromarray(arr[i])
        enlarge = img.width <= tile and img.height <= tile
        canvas.paste(img.resize((tile, tile), Image.NEAREST if enlarge else Image.BICUBIC), (x, y))
        mark = None if marks is None else marks[i]
        text = labels[i]
        if mark is not None:
            color = PASS_COLOR if mark else FAIL_COLOR
            draw.rectangle((x + tile - 14, y + 2, x + tile - 3, y + 13), fill=color, outline="white")
            text = ("pass: " if mark else "FAIL: ") + text
        for j, line in enumerate(_wrap(text, tile // char_w, LABEL_LINES)):
            fill = (PASS_COLOR if mark else FAIL_COLOR) if (j == 0 and mark is not None) else (0, 0, 0)
            draw.text((x + 1, y + tile + 2 + j * line_h), line, fill=fill, font=font)
    return np.asarray(canvas)
