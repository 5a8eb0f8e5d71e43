"""Preference pairs in the Pick-a-Pic layout: read, write, and generate them from a model + reward.

Pick-a-Pic (Kirstain et al. 2023) stores one comparison per row: ``caption``, two images
``jpg_0`` / ``jpg_1`` and ``label_0`` / ``label_1`` with ``label_0`` in {1 (image 0 preferred),
0 (image 1 preferred), 0.5 (tie)} and ``label_1 = 1 - label_0`` (``label_0`` is read as
``1 - label_1`` when only ``label_1`` is given). ``prompt`` and ``image_0`` / ``image_1`` are
accepted as aliases; rows with a false ``has_label`` are skipped. Files:

- JSON lines (or a folder holding ``pairs.jsonl``) whose images are paths relative to the file,
  one JSON object per line:
  ``{"caption": "a photo of a red circle", "jpg_0": "images/0_a.png", "jpg_1": "images/0_b.png", "label_0": 1}``;
- ``.json`` (a list of such rows) or ``.csv``;
- Parquet with the Pick-a-Pic columns (image bytes inline, or ``{"bytes": ..., "path": ...}`` as
  Hugging Face ``datasets`` writes them; needs ``pyarrow``).

Every row is checked and every referenced image found before any is decoded; a problem is a
one-line :class:`PairFileError` naming the file and line. Two in-memory forms:

- :class:`PairSet`: uint8 images (SPO's preference model, Diffusion-DPO); fine for the
  ShapesWorld and for subsets of Pick-a-Pic (the full 1M-pair set needs a streaming loader);
- :class:`LatentPairs`: clean latents of one model plus index pairs (the DRM, which noises them).

:func:`generate_pairs` / :func:`generate_latent_pairs` make such sets from any model and any
registered reward: sample several images per prompt deterministically, score them, and label the
pairs of images of the same prompt by their rewards (:func:`label_pairs`).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

import reward_models
from diffalign import progress
from diffalign.errors import DiffalignError
from diffalign.forward_process import encode_images
from diffalign.sampling import build_kernel, sample_linear
from diffalign.sampling.linear import SampleSpec

PAIRS_FILE = "pairs.jsonl"
IMAGES_DIR = "images"
LABELS = (0.0, 0.5, 1.0)
PROMPT_KEYS = ("caption", "prompt")
IMAGE_KEYS = (("jpg_0", "image_0"), ("jpg_1", "image_1"))


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


@dataclass
class LatentPairs:
    """Pairs over clean latents (the DRM's training data). ``latents``: (S, *latent) fp32;
    ``prompts``: S strings; ``pairs``: (P, 2) long indices of the two samples of each pair;
    ``label_0``: (P,) fp32, 1 when the first is preferred, 0 when the second is, 0.5 for a tie;
    ``rewards``: (S,) when generated, else None."""

    latents: torch.Tensor
    prompts: list[str]
    pairs: torch.Tensor
    label_0: torch.Tensor
    rewards: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.pairs.shape[0]

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor]:
        """(x0 of image 0 (b, *latent), x0 of image 1, prompts (b), label_0 (b,)) for pair rows ``idx``."""
        a, b = self.pairs[idx, 0], self.pairs[idx, 1]
        return self.latents[a], self.latents[b], [self.prompts[int(i)] for i in a], self.label_0[idx]

    def subset(self, idx: torch.Tensor) -> "LatentPairs":
        return LatentPairs(self.latents, self.prompts, self.pairs[idx], self.label_0[idx], self.rewards)

    def split(self, eval_fraction: float, generator: torch.Generator) -> tuple["LatentPairs", "LatentPairs"]:
        """(train, eval) pairs by a random split of the *prompts* (no prompt in both)."""
        first_prompt = [self.prompts[int(i)] for i in self.pairs[:, 0]]
        unique = list(dict.fromkeys(first_prompt))
        order = torch.randperm(len(unique), generator=generator).tolist()
        n_eval = max(1, round(eval_fraction * len(unique))) if len(unique) > 1 else 0
        held = {unique[i] for i in order[:n_eval]}
        is_eval = torch.tensor([p in held for p in first_prompt], dtype=torch.bool)
        return self.subset(torch.nonzero(~is_eval).flatten()), self.subset(torch.nonzero(is_eval).flatten())


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _label(value, where: str, key: str) -> float:
    if isinstance(value, str):  # CSV cells
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) not in LABELS:
        raise PairFileError(f"{where}: {key} must be 0, 0.5 or 1, got {value!r}")
    return float(value)


def _records(p: Path) -> list[tuple[str, object]]:
    """(where, record) of every row of a pair file: ``file:line`` for JSON lines, ``file row n`` else."""
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PairFileError(f"reading {str(p)!r} needs pyarrow (pip install pyarrow), or convert it to pairs.jsonl") from None
        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as exc:
            raise PairFileError(f"pair file {str(p)!r} is not a readable Parquet file ({type(exc).__name__})") from None
        return [(f"{p} row {n}", r) for n, r in enumerate(rows)]
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PairFileError(f"pair file {str(p)!r} cannot be read ({type(exc).__name__})") from None
    if suffix == ".csv":
        return [(f"{p} row {n}", r) for n, r in enumerate(csv.DictReader(io.StringIO(text)), start=1)]
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except ValueError:
            raise PairFileError(f"pair file {str(p)!r}: not valid JSON") from None
        if not isinstance(rows, list):
            raise PairFileError(f"pair file {str(p)!r} must hold a JSON list of rows")
        return [(f"{p} row {n}", r) for n, r in enumerate(rows, start=1)]
    out = []  # JSON lines
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{p}:{n}", json.loads(line)))
            except ValueError:
                raise PairFileError(f"{p}:{n}: not valid JSON") from None
    return out


def _get(row: dict, keys: Sequence[str]):
    for k in keys:
        if row.get(k) is not None and row[k] != "":
            return row[k]
    return None


def _image_ref(value, folder: Path):
    """Image bytes, or a Path (relative to the file's folder); ``base64:`` strings are decoded."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value.startswith("base64:"):
        return base64.b64decode(value[len("base64:"):])
    if isinstance(value, str):
        p = Path(value).expanduser()
        return p if p.is_absolute() else folder / p
    return None


def read_pair_rows(path: str | Path, *, drop_ties: bool = False, limit: int = 0) -> list[dict]:
    """Rows ``{"prompt", "image_0", "image_1", "label_0", "where"}`` of a pair file (images as bytes
    or Paths), checked, after finding every referenced image; ``limit`` > 0 keeps the first rows."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / PAIRS_FILE
    if not p.is_file():
        raise PairFileError(f"pair file {str(path)!r} does not exist")
    out, missing = [], []
    for where, record in _records(p):
        if not isinstance(record, dict):
            raise PairFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "has_label" in record and str(record["has_label"]).strip().lower() in ("0", "false", "no", ""):
            continue
        prompt = _get(record, PROMPT_KEYS)
        refs = [_image_ref(_get(record, keys), p.parent) for keys in IMAGE_KEYS]
        for key, value in (("caption", prompt), ("jpg_0", refs[0]), ("jpg_1", refs[1])):
            if value is None:
                raise PairFileError(f"{where}: missing key {key!r} (Pick-a-Pic layout: caption, jpg_0, jpg_1, label_0[, label_1])")
        if not isinstance(prompt, str):
            raise PairFileError(f"{where}: caption must be a string")
        label_1 = _label(record["label_1"], where, "label_1") if record.get("label_1") not in (None, "") else None
        if record.get("label_0") in (None, ""):
            if label_1 is None:
                raise PairFileError(f"{where}: missing key 'label_0' (Pick-a-Pic layout: caption, jpg_0, jpg_1, label_0[, label_1])")
            label_0 = 1.0 - label_1
        else:
            label_0 = _label(record["label_0"], where, "label_0")
        if label_1 is not None and label_1 != 1.0 - label_0:
            raise PairFileError(f"{where}: label_1 = {label_1:g} must equal 1 - label_0 = {1 - label_0:g}")
        if drop_ties and label_0 == 0.5:
            continue
        missing += [(where, r) for r in refs if isinstance(r, Path) and not r.is_file()]
        out.append({"prompt": prompt, "image_0": refs[0], "image_1": refs[1], "label_0": label_0, "where": where})
        if limit and len(out) >= limit:
            break
    if missing:
        where, ref = missing[0]
        raise PairFileError(f"{where}: image {str(ref)!r} does not exist ({len(missing)} image(s) missing in the file)")
    if not out:
        raise PairFileError(f"pair file {str(p)!r} holds no pairs")
    return out


def decode_image(ref, where: str, resolution: Optional[int], *, center_crop: bool = False) -> np.ndarray:
    """Image file / bytes -> uint8 (H, W, 3), centre-cropped to a square when asked and resized
    (bicubic) to ``resolution`` when given."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, (bytes, bytearray)) else str(ref)) as img:
            img = img.convert("RGB")
            if center_crop:
                side = min(img.size)
                left, top = (img.width - side) // 2, (img.height - side) // 2
                img = img.crop((left, top, left + side, top + side))
            if resolution and img.size != (resolution, resolution):
                img = img.resize((resolution, resolution), Image.BICUBIC)
            return np.asarray(img, dtype=np.uint8).copy()
    except FileNotFoundError:
        raise PairFileError(f"{where}: image {str(ref)!r} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        what = f"{str(ref)!r}" if not isinstance(ref, (bytes, bytearray)) else "(inline bytes)"
        raise PairFileError(f"{where}: image {what} cannot be read ({type(exc).__name__})") from None


def read_pairs(path: str | Path, *, resolution: Optional[int] = None, limit: int = 0) -> PairSet:
    """Read a pair file (see the module docstring) as images; ``limit`` > 0 reads the first ``limit`` pairs."""
    rows = read_pair_rows(path, limit=limit)
    images = [[decode_image(r[k], r["where"], resolution) for k in ("image_0", "image_1")] for r in rows]
    shapes = {a.shape for pair in images for a in pair}
    if len(shapes) > 1:
        raise PairFileError(f"pair file {str(path)!r}: images differ in size {sorted(shapes)[:3]}; pass a resolution to resize them")
    to_tensor = lambda arrays: torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # noqa: E731
    return PairSet(to_tensor([a for a, _ in images]), to_tensor([b for _, b in images]), [r["prompt"] for r in rows],
                   torch.tensor([r["label_0"] for r in rows], dtype=torch.float32))


@torch.no_grad()
def load_latent_pairs(path: str | Path, adapter, resolution: int, *, drop_ties: bool = False,
                      batch_size: int = 16) -> LatentPairs:
    """Read a pair file and encode its images (centre crop, resize) to the adapter's latents."""
    rows = read_pair_rows(path, drop_ties=drop_ties)
    refs = [(r[k], r["where"]) for r in rows for k in ("image_0", "image_1")]
    latents = []
    for s in range(0, len(refs), batch_size):
        arrays = [decode_image(ref, where, resolution, center_crop=True) for ref, where in refs[s : s + batch_size]]
        images = torch.from_numpy(np.stack(arrays).astype(np.float32) / 255.0).permute(0, 3, 1, 2)
        latents.append(encode_images(adapter, images).float().cpu())
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    pairs = torch.arange(2 * len(rows)).view(-1, 2)
    return LatentPairs(torch.cat(latents), prompts, pairs, torch.tensor([r["label_0"] for r in rows], dtype=torch.float32))


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


def label_pairs(rewards: torch.Tensor, group_size: int, keep_ties: bool = True,
                tie_tolerance: float = 0.0) -> list[tuple[int, int, float]]:
    """All within-group pairs ``(i, j, label_0)``, ``i < j``, of consecutive groups of ``group_size``
    rewards: ``label_0 = 1`` if ``r_i > r_j``, 0 if lower, 0.5 if they are within ``tie_tolerance``
    (dropped unless ``keep_ties``). Non-finite rewards take part in no pair."""
    out = []
    r = rewards.float()
    for start in range(0, len(r), group_size):
        for i, j in combinations(range(start, min(start + group_size, len(r))), 2):
            ri, rj = float(r[i]), float(r[j])
            if not (math.isfinite(ri) and math.isfinite(rj)):
                continue
            label = 0.5 if abs(ri - rj) <= tie_tolerance else 1.0 if ri > rj else 0.0
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
    sampling: SampleSpec = SampleSpec(),
    keep_ties: bool = True,
    reward_name: str = "reward",
) -> tuple[PairSet, dict]:
    """Sample ``images_per_prompt`` images of every prompt (deterministic sampler, ``sampling``),
    score them with ``reward_fn`` and pair them up with :func:`label_pairs`.

    Returns the pairs and statistics: ``images``, ``pairs``, ``ties`` (pairs with equal rewards,
    whether kept or not), ``reward_mean``.
    """
    if images_per_prompt < 2:
        raise DiffalignError(f"generating pairs needs at least 2 images per prompt, got {images_per_prompt}")
    expanded = [p for p in prompts for _ in range(images_per_prompt)]
    images = sampling.sample(adapter, expanded, progress=f"pairs: sampling {len(expanded)} images")
    rewards = []
    for start in range(0, len(expanded), sampling.batch_size):
        chunk = slice(start, start + sampling.batch_size)
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


@torch.no_grad()
def generate_latent_pairs(
    adapter,
    prompts: Sequence[str],
    reward_fn: Callable,
    *,
    samples_per_prompt: int,
    num_steps: int,
    guidance_scale: float,
    resolution: int,
    seed: int,
    batch_size: int = 32,
    max_pairs_per_prompt: int = 6,
    tie_tolerance: float = 1e-6,
    log: Callable[[str], None] = lambda msg: None,
) -> LatentPairs:
    """Sample ``samples_per_prompt`` images per prompt (ODE, one noise per sample from ``seed``),
    score them with ``reward_fn`` and pair samples of the same prompt whose rewards differ by more
    than ``tie_tolerance`` (:func:`label_pairs`; up to ``max_pairs_per_prompt`` random pairs per
    prompt, the preferred sample first or second with equal odds). Keeps the final latents."""
    gen = torch.Generator("cpu").manual_seed(seed)
    sample_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    ode = torch.zeros(num_steps, dtype=torch.bool)
    latents, rewards = [], []
    bar = progress.bar(total=len(range(0, len(sample_prompts), batch_size)) * num_steps, unit="step",
                       desc=f"pairs: sampling {len(sample_prompts)} images")
    for start in range(0, len(sample_prompts), batch_size):
        chunk = sample_prompts[start : start + batch_size]
        embeds = adapter.encode_prompts(chunk, with_uncond=guidance_scale > 1)
        traj = sample_linear(adapter, kernel, embeds, schedule, ode, guidance_scale=guidance_scale, height=resolution,
                             width=resolution, generator=gen, keep_latents=False, on_step=lambda _step: bar.update())
        latents.append(traj.latents[:, -1].float().cpu())
        scores = reward_fn(traj.images, chunk, [{} for _ in chunk])
        rewards.append(reward_models.check_reward_output("pairs.reward", scores, len(chunk)))
        log(f"  generated {min(start + batch_size, len(sample_prompts))}/{len(sample_prompts)} samples")
    bar.close()
    latents_t, rewards_t = torch.cat(latents), torch.cat(rewards)
    pairs, labels = [], []
    for p in range(len(prompts)):
        base = p * samples_per_prompt
        group = rewards_t[base : base + samples_per_prompt]
        cand = [(base + i, base + j, y) for i, j, y in label_pairs(group, samples_per_prompt, keep_ties=False,
                                                                  tie_tolerance=tie_tolerance)]
        if len(cand) > max_pairs_per_prompt:
            pick = torch.randperm(len(cand), generator=gen)[:max_pairs_per_prompt].tolist()
            cand = [cand[i] for i in sorted(pick)]
        for a, b, y in cand:
            if torch.rand((), generator=gen) < 0.5:  # preferred image first or second with equal odds
                a, b, y = b, a, 1.0 - y
            pairs.append((a, b))
            labels.append(y)
    pair_t = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return LatentPairs(latents_t, sample_prompts, pair_t, torch.tensor(labels, dtype=torch.float32), rewards_t)
