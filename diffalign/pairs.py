"""Preference pairs in the Pick-a-Pic layout: read, write, and generate them from a model + reward.

Pick-a-Pic (Kirstain et al. 2023) stores one comparison per row: ``caption``, two images
``jpg_0`` / ``jpg_1`` and ``label_0`` / ``label_1`` with ``label_0`` in {1 (image 0 preferred),
0 (image 1 preferred), 0.5 (tie)} and ``label_1 = 1 - label_0``. diffalign reads the same
columns from

- a JSON-lines file (or a folder holding ``pairs.jsonl``) whose ``jpg_0`` / ``jpg_1`` are image
  paths relative to the file, one JSON object per line:
  ``{"caption": "a photo of a red circle", "jpg_0": "images/0_a.png", "jpg_1": "images/0_b.png", "label_0": 1}``;
- a Parquet file with the Pick-a-Pic columns (image bytes inline; needs ``pyarrow``).

Everything is checked on load; a missing or unreadable image, a label outside {0, 0.5, 1}, or a
``label_1`` that is not ``1 - label_0`` is a one-line :class:`PairFileError` naming the file and
line. Images are held in memory as uint8 (fine for the ShapesWorld and for subsets of Pick-a-Pic;
the full 1M-pair set needs a streaming loader, which this module does not provide).

:func:`generate_pairs` makes such a set from any model and any registered reward: sample
``images_per_prompt`` images per prompt with the deterministic sampler, score them, and label
every pair of images of the same prompt by their rewards (equal rewards: a tie).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from diffalign.errors import DiffalignError

PAIRS_FILE = "pairs.jsonl"
IMAGES_DIR = "images"
LABELS = (0.0, 0.5, 1.0)


class PairFileError(DiffalignError):
    """A preference-pair file is missing, malformed, or holds bad images or labels."""


@dataclass
class PairSet:
    """``N`` preference pairs.

    ``images_0`` / ``images_1``: ``(N, 3, H, W)`` uint8; ``prompts``: ``N`` captions;
    ``label_0``: ``(N,)`` fp32 in {0, 0.5, 1} (1 = image 0 preferred).
    """

    images_0: torch.Tensor
    images_1: torch.Tensor
    prompts: list[str]
    label_0: torch.Tensor

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: Sequence[int] | torch.Tensor) -> "PairSet":
        idx = torch.as_tensor(index, dtype=torch.long)
        return PairSet(self.images_0[idx], self.images_1[idx], [self.prompts[i] for i in idx.tolist()], self.label_0[idx])

    @staticmethod
    def to_float(images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, 3, H, W)`` -> fp32 in ``[0, 1]``."""
        return images.float() / 255.0

    def strict(self) -> "PairSet":
        """Only the pairs with a winner (ties dropped), as Diffusion-DPO trains."""
        return self.select(torch.nonzero(self.label_0 != 0.5).flatten())

    def oriented(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(winners, losers)`` uint8 of the strict pairs, in the order of :meth:`strict`."""
        s = self.strict()
        first = (s.label_0 == 1.0)[:, None, None, None]
        return torch.where(first, s.images_0, s.images_1), torch.where(first, s.images_1, s.images_0)

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple["PairSet", "PairSet"]:
        """(train, held-out) split **by prompt**, so that held-out accuracy measures generalisation
        to new prompts; at least one prompt stays on each side when there are two or more."""
        prompts = sorted(set(self.prompts))
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(prompts))
        n_held = int(round(heldout_fraction * len(prompts)))
        if len(prompts) > 1:
            n_held = min(max(n_held, 1 if heldout_fraction > 0 else 0), len(prompts) - 1)
        held = {prompts[i] for i in order[:n_held]}
        idx_train = [i for i, p in enumerate(self.prompts) if p not in held]
        idx_held = [i for i, p in enumerate(self.prompts) if p in held]
        return self.select(idx_train), self.select(idx_held)

    @staticmethod
    def cat(items: Sequence["PairSet"]) -> "PairSet":
        return PairSet(torch.cat([p.images_0 for p in items]), torch.cat([p.images_1 for p in items]),
                       [x for p in items for x in p.prompts], torch.cat([p.label_0 for p in items]))


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _label(value, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) not in LABELS:
        raise PairFileError(f"{where}: {key} must be 0, 0.5 or 1, got {value!r}")
    return float(value)


def _decode(data: bytes | str | Path, where: str, resolution: Optional[int]) -> np.ndarray:
    """Image file / bytes -> uint8 (H, W, 3), resized (bicubic) to ``resolution`` when given."""
    from PIL import Image, UnidentifiedImageError

    try:
        src = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data)
        with Image.open(src) as img:
            img = img.convert("RGB")
            if resolution and img.size != (resolution, resolution):
                img = img.resize((resolution, resolution), Image.BICUBIC)
            return np.asarray(img, dtype=np.uint8).copy()
    except FileNotFoundError:
        raise PairFileError(f"{where}: image {str(data)!r} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        what = f"{str(data)!r}" if not isinstance(data, (bytes, bytearray)) else "(inline bytes)"
        raise PairFileError(f"{where}: image {what} cannot be read ({type(exc).__name__})") from None


def _build(rows: list[tuple[str, np.ndarray, np.ndarray, float]], source: str) -> PairSet:
    if not rows:
        raise PairFileError(f"pair file {source!r} holds no pairs")
    shapes = {r[1].shape for r in rows} | {r[2].shape for r in rows}
    if len(shapes) > 1:
        raise PairFileError(f"pair file {source!r}: images differ in size {sorted(shapes)[:3]}; pass a resolution to resize them")
    to_tensor = lambda arrays: torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # noqa: E731
    return PairSet(to_tensor([r[1] for r in rows]), to_tensor([r[2] for r in rows]), [r[0] for r in rows],
                   torch.tensor([r[3] for r in rows], dtype=torch.float32))


def _check_record(record, where: str) -> tuple[str, float]:
    if not isinstance(record, dict):
        raise PairFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("caption", "jpg_0", "jpg_1", "label_0"):
        if key not in record:
            raise PairFileError(f"{where}: missing key {key!r} (Pick-a-Pic layout: caption, jpg_0, jpg_1, label_0[, label_1])")
    if not isinstance(record["caption"], str):
        raise PairFileError(f"{where}: caption must be a string")
    label_0 = _label(record["label_0"], where, "label_0")
    if record.get("label_1") is not None:
        label_1 = _label(record["label_1"], where, "label_1")
        if label_1 != 1.0 - label_0:
            raise PairFileError(f"{where}: label_1 = {label_1:g} must equal 1 - label_0 = {1 - label_0:g}")
    return record["caption"], label_0


def read_pairs(path: str | Path, *, resolution: Optional[int] = None, limit: int = 0) -> PairSet:
    """Read a pair file (see the module docstring); ``limit`` > 0 reads the first ``limit`` pairs."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / PAIRS_FILE
    if not p.is_file():
        raise PairFileError(f"pair file {str(path)!r} does not exist")
    if p.suffix == ".parquet":
        return _read_parquet(p, resolution, limit)
    rows = []
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PairFileError(f"pair file {str(p)!r} cannot be read ({type(exc).__name__})") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            record = json.loads(line)
        except ValueError:
            raise PairFileError(f"{where}: not valid JSON") from None
        caption, label_0 = _check_record(record, where)
        images = []
        for key in ("jpg_0", "jpg_1"):
            if not isinstance(record[key], str):
                raise PairFileError(f"{where}: {key} must be an image path relative to the file")
            images.append(_decode(p.parent / record[key], where, resolution))
        rows.append((caption, images[0], images[1], label_0))
        if limit and len(rows) >= limit:
            break
    return _build(rows, str(p))


def _read_parquet(p: Path, resolution: Optional[int], limit: int) -> PairSet:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PairFileError(f"reading {str(p)!r} needs pyarrow (pip install pyarrow), or convert it to pairs.jsonl") from None
    try:
        table = pq.read_table(p, columns=None)
    except Exception as exc:
        raise PairFileError(f"pair file {str(p)!r} is not a readable Parquet file ({type(exc).__name__})") from None
    rows = []
    for n, record in enumerate(table.to_pylist()):
        where = f"{p} row {n}"
        caption, label_0 = _check_record(record, where)
        images = []
        for key in ("jpg_0", "jpg_1"):
            value = record[key]
            value = value.get("bytes") if isinstance(value, dict) else value
            if not isinstance(value, (bytes, bytearray)):
                raise PairFileError(f"{where}: {key} must hold image bytes")
            images.append(_decode(value, where, resolution))
        rows.append((caption, images[0], images[1], label_0))
        if limit and len(rows) >= limit:
            break
    return _build(rows, str(p))


# --------------------------------------------------------------------------------------------
# Writing and generating
# --------------------------------------------------------------------------------------------


def write_pairs(pairs: PairSet, folder: str | Path) -> Path:
    """Write ``folder/pairs.jsonl`` and PNGs under ``folder/images``; returns the JSONL path."""
    from PIL import Image

    folder = Path(folder)
    (folder / IMAGES_DIR).mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(len(pairs)):
        names = []
        for j, images in enumerate((pairs.images_0, pairs.images_1)):
            name = f"{IMAGES_DIR}/{i:06d}_{j}.png"
            Image.fromarray(images[i].permute(1, 2, 0).numpy()).save(folder / name)
            names.append(name)
        label_0 = float(pairs.label_0[i])
        lines.append(json.dumps({"caption": pairs.prompts[i], "jpg_0": names[0], "jpg_1": names[1],
                                 "label_0": label_0, "label_1": 1.0 - label_0}))
    out = folder / PAIRS_FILE
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    return out


def label_pairs(rewards: torch.Tensor, group_size: int, keep_ties: bool = True) -> list[tuple[int, int, float]]:
    """All within-group pairs ``(i, j, label_0)`` of consecutive groups of ``group_size`` rewards:
    ``label_0 = 1`` if ``r_i > r_j``, 0 if lower, 0.5 if equal (dropped unless ``keep_ties``).
    Non-finite rewards take part in no pair."""
    out = []
    r = rewards.float()
    for start in range(0, len(r), group_size):
        for i, j in combinations(range(start, min(start + group_size, len(r))), 2):
            if not (math.isfinite(float(r[i])) and math.isfinite(float(r[j]))):
                continue
            label = 1.0 if r[i] > r[j] else 0.0 if r[i] < r[j] else 0.5
            if label == 0.5 and not keep_ties:
                continue
            out.append((i, j, label))
    return out


@torch.no_grad()
def generate_pairs(
    adapter,
    prompts: Sequence[str],
    reward_fn: Callable,
    *,
    images_per_prompt: int = 4,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    resolution: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 32,
    keep_ties: bool = True,
    reward_name: str = "reward",
) -> tuple[PairSet, dict]:
    """Sample ``images_per_prompt`` images of every prompt (deterministic sampler, seed ``seed``),
    score them with ``reward_fn`` and pair them up with :func:`label_pairs`.

    Returns the pairs and statistics: ``images``, ``pairs``, ``ties`` (pairs with equal rewards,
    whether kept or not), ``reward_mean``.
    """
    import reward_models
    from diffalign.sampling import sample_images

    if images_per_prompt < 2:
        raise DiffalignError(f"generating pairs needs at least 2 images per prompt, got {images_per_prompt}")
    resolution = resolution or adapter.default_resolution
    expanded = [p for p in prompts for _ in range(images_per_prompt)]
    images = sample_images(adapter, expanded, num_steps=num_steps, guidance_scale=guidance_scale, resolution=resolution,
                           seed=seed, batch_size=batch_size)
    rewards = []
    for start in range(0, len(expanded), batch_size):
        chunk = slice(start, start + batch_size)
        value = reward_fn(images[chunk], expanded[chunk], [{} for _ in expanded[chunk]])
        rewards.append(reward_models.check_reward_output(reward_name, value, len(expanded[chunk])))
    rewards_t = torch.cat(rewards)
    all_pairs = label_pairs(rewards_t, images_per_prompt, keep_ties=True)
    ties = sum(1 for _, _, lab in all_pairs if lab == 0.5)
    chosen = [x for x in all_pairs if keep_ties or x[2] != 0.5]
    if not chosen:
        raise DiffalignError(f"generated {len(expanded)} images but {reward_name!r} gave every image of each prompt the "
                             "same reward: no preference pairs (use more images per prompt or a denser reward)")
    u8 = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    i_idx = torch.tensor([i for i, _, _ in chosen])
    j_idx = torch.tensor([j for _, j, _ in chosen])
    pairs = PairSet(u8[i_idx], u8[j_idx], [expanded[i] for i, _, _ in chosen],
                    torch.tensor([lab for _, _, lab in chosen], dtype=torch.float32))
    finite = torch.isfinite(rewards_t)
    stats = {"images": len(expanded), "pairs": len(pairs), "ties": ties,
             "reward_mean": float(rewards_t[finite].mean()) if finite.any() else float("nan")}
    return pairs, stats
