"""OCR accuracy: how exactly an image spells the text its prompt asks for (Flow-GRPO's text
rendering task, Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL").

The target text is ``metadata["text"]`` when given, else the first double-quoted span of the prompt
(``A sign that says "OPEN SOON"`` -> ``OPEN SOON``). Both the target ``t`` and the recognised text
``r`` are compared without spaces and in lower case, as Flow-GRPO compares them::

    d = 0                        if t is a substring of r   (extra text around it is not penalised)
        min(lev(r, t), |t|)      otherwise                  (lev: Levenshtein distance)
    reward = 1 - d / |t|         in [0, 1]: 1 for the exact text, 0 for nothing readable

Flow-GRPO reads the text with PaddleOCR; here the reader is Tesseract 5 through ``tesserocr``
(a 6 MB wheel that bundles libtesseract) with its English model from Debian's
``tesseract-ocr-eng`` (``tessdata``), both offline and on the CPU.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register

QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')  # "straight" or \u201ccurly\u201d quotes
TESSDATA_DIRS = ("/usr/share/tesseract-ocr/5/tessdata", "/usr/share/tesseract-ocr/4.00/tessdata",
                 "/usr/share/tessdata", "/usr/local/share/tessdata", "/opt/homebrew/share/tessdata")
SPARSE_TEXT = 11  # Tesseract page segmentation mode: as much text as possible, in no particular order
INSTALL_HINT = "pip install 'diffalign[ocr]' and Debian's tesseract-ocr-eng (or set tessdata to a folder with eng.traineddata)"


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions
    turning ``a`` into ``b`` (dynamic programming over one row, O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, start=1):
        previous_diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, start=1):
            previous_diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous_diagonal + (ca != cb))
    return row[-1]


def normalise(text: str) -> str:
    """Flow-GRPO's comparison form: no whitespace, lower case."""
    return re.sub(r"\s+", "", text).lower()


def ocr_accuracy(recognised: str, target: str) -> float:
    """``1 - min(lev(r, t), |t|) / |t|`` on normalised text, 1 when ``t`` occurs in ``r`` (module docstring)."""
    r, t = normalise(recognised), normalise(target)
    if not t:
        raise ValueError("the target text is empty")
    distance = 0 if t in r else min(edit_distance(r, t), len(t))
    return 1.0 - distance / len(t)


def target_text(prompt: str, metadata: dict) -> str:
    """``metadata["text"]``, else the first quoted span of ``prompt``; a RewardError when neither is there."""
    if isinstance(metadata.get("text"), str) and normalise(metadata["text"]):
        return metadata["text"]
    match = QUOTED.search(prompt)
    if match is None or not normalise(match.group(1) or match.group(2) or ""):
        raise RewardError(f'ocr: prompt {prompt[:100]!r} has no text in double quotes ("...") and no metadata "text"')
    return match.group(1) if match.group(1) is not None else match.group(2)


def render_text(texts: Sequence[str], size: tuple[int, int] = (320, 96), font_size: int = 40) -> torch.Tensor:
    """Black text on white in Pillow's own font (no system fonts needed), ``size`` = (W, H): images
    ``(B, 3, H, W)`` in [0, 1] whose text is known, to check a reader (tests, benchmarks)."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=font_size)
    images = []
    for text in texts:
        image = Image.new("RGB", tuple(size), "white")
        ImageDraw.Draw(image).text((16, (size[1] - font_size) // 2), text, fill="black", font=font)
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


class TesseractReader:
    """Text in an image with Tesseract (``tesserocr``'s C API: the model loads once, ~20-70 ms an image)."""

    def __init__(self, lang: str = "eng", tessdata: str | None = None, page_segmentation_mode: int = SPARSE_TEXT) -> None:
        try:
            import tesserocr
        except ImportError:
            raise RewardError(f"ocr: tesserocr is not installed ({INSTALL_HINT})") from None
        folder = _find_tessdata(lang, tessdata)
        try:
            self.api = tesserocr.PyTessBaseAPI(path=folder.rstrip("/") + "/", lang=lang, psm=page_segmentation_mode)
        except RuntimeError as exc:
            raise RewardError(f"ocr: Tesseract cannot load language {lang!r} from {folder}: {exc}") from None

    def __call__(self, image) -> str:
        """``image``: a PIL RGB image -> the text read, lines joined by newlines."""
        self.api.SetImage(image)
        return self.api.GetUTF8Text()


def _find_tessdata(lang: str, tessdata: str | None) -> str:
    if not isinstance(lang, str) or not lang:
        raise RewardError(f"ocr: lang must be a Tesseract language such as 'eng', got {lang!r}")
    candidates = [tessdata] if tessdata else [os.environ.get("TESSDATA_PREFIX"), *TESSDATA_DIRS]
    files = [f"{part}.traineddata" for part in lang.split("+")]  # "eng+deu": both models
    for folder in filter(None, candidates):
        if all((Path(folder) / file).is_file() for file in files):
            return str(folder)
    where = f"tessdata={tessdata!r}" if tessdata else "TESSDATA_PREFIX or " + ", ".join(TESSDATA_DIRS)
    raise RewardError(f"ocr: no {' and '.join(files)} in {where} ({INSTALL_HINT})")


@register("ocr")
class OcrReward:
    """Reward = OCR accuracy of the prompt's quoted text (formula in the module docstring).

    Args:
        lang: Tesseract language(s), e.g. ``eng`` or ``eng+deu``.
        tessdata: folder holding ``<lang>.traineddata``; by default ``$TESSDATA_PREFIX`` or the usual
            system folders (Debian: ``/usr/share/tesseract-ocr/5/tessdata``).
        page_segmentation_mode: Tesseract's ``--psm``; 11 (sparse text) finds text anywhere in the image.
        device: accepted for the common factory signature; OCR runs on the CPU.
    """

    def __init__(self, lang: str = "eng", tessdata: str | None = None, page_segmentation_mode: int = SPARSE_TEXT,
                 device: str | torch.device | None = None) -> None:
        if isinstance(page_segmentation_mode, bool) or page_segmentation_mode not in range(14):
            raise RewardError(f"ocr: page_segmentation_mode must be an integer in [0, 13], got {page_segmentation_mode!r}")
        self.read = TesseractReader(lang, tessdata, page_segmentation_mode)
        self.last_info: dict[str, float] = {}
        self.last_texts: list[str] = []  # what was read in the last call, for inspection

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        from PIL import Image

        check_images(images)
        if len(prompts) != images.shape[0] or len(metadata) != images.shape[0]:
            raise RewardError(f"ocr: got {images.shape[0]} images, {len(prompts)} prompts and {len(metadata)} metadata entries")
        targets = [target_text(prompt, meta or {}) for prompt, meta in zip(prompts, metadata)]
        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        start = time.perf_counter()
        self.last_texts = [self.read(Image.fromarray(array, mode="RGB")) for array in pixels]
        scores = torch.tensor([ocr_accuracy(text, target) for text, target in zip(self.last_texts, targets)],
                              dtype=torch.float32)
        if len(scores):
            self.last_info = {"ocr_exact": (scores == 1).float().mean().item(),
                              "ocr_seconds_per_image": (time.perf_counter() - start) / len(scores)}
        return scores
