"""Preference pairs for training a DRM: from a Pick-a-Pic-layout file, or generated and labelled.

A :class:`PairSet` holds clean latents in the DRM's latent space (training noises them), the
prompt of each sample, and pairs of sample indices with a label.

**File source** (Pick-a-Pic v2 layout; one row per pair):

============  =========================================================================
``caption``   the prompt
``jpg_0``     image 0: a path (relative to the file's folder), raw bytes (parquet), or
              ``{"bytes": ..., "path": ...}`` as written by Hugging Face ``datasets``
``jpg_1``     image 1, the same
``label_0``   1 = image 0 preferred, 0 = image 1 preferred, 0.5 = tie (``label_1`` is
              read when ``label_0`` is absent, as ``1 - label_1``)
``has_label`` optional; rows with a false value are skipped
============  =========================================================================

``image_0`` / ``image_1`` and ``prompt`` are accepted as aliases. Formats: ``.jsonl``,
``.json`` (a list of rows), ``.csv`` and ``.parquet`` (needs pyarrow). Every referenced image is
checked before any work; missing ones are one error naming the first and the count.

**Generated source**: sample a model for each prompt several times (deterministic ODE, one seed
per sample), score with any registered reward (ShapesEval in the default world), and pair the
samples of a prompt whose rewards differ (label 1 for the higher one).
"""

from __future__ import annotations

import base64
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from diffalign.adapters.base import ModelAdapter
from diffalign.drm.model import DRMError
from diffalign.forward_process import encode_images
from diffalign.sampling import build_kernel, sample_linear

_PROMPT_KEYS = ("caption", "prompt")
_IMAGE_KEYS = (("jpg_0", "image_0"), ("jpg_1", "image_1"))


@dataclass
class PairSet:
    """``latents``: (S, *latent) fp32 clean latents; ``prompts``: S strings; ``pairs``: (P, 2)
    long indices of the two samples of each pair; ``label_0``: (P,) fp32, 1 when the first is
    preferred, 0 when the second is, 0.5 for a tie; ``rewards``: (S,) when generated, else None."""

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

    def subset(self, idx: torch.Tensor) -> "PairSet":
        return PairSet(self.latents, self.prompts, self.pairs[idx], self.label_0[idx], self.rewards)

    def split(self, eval_fraction: float, generator: torch.Generator) -> tuple["PairSet", "PairSet"]:
        """(train, eval) pairs by a random split of the *prompts* (no prompt in both)."""
        first_prompt = [self.prompts[int(i)] for i in self.pairs[:, 0]]
        unique = list(dict.fromkeys(first_prompt))
        order = torch.randperm(len(unique), generator=generator).tolist()
        n_eval = max(1, round(eval_fraction * len(unique))) if len(unique) > 1 else 0
        held = {unique[i] for i in order[:n_eval]}
        is_eval = torch.tensor([p in held for p in first_prompt], dtype=torch.bool)
        return self.subset(torch.nonzero(~is_eval).flatten()), self.subset(torch.nonzero(is_eval).flatten())


# ---- generated pairs --------------------------------------------------------------------------
@torch.no_grad()
def generate_pairs(
    adapter: ModelAdapter,
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
) -> PairSet:
    """Sample ``samples_per_prompt`` images per prompt (ODE, one noise per sample from ``seed``),
    score them with ``reward_fn`` and pair samples of the same prompt whose rewards differ by more
    than ``tie_tolerance`` (up to ``max_pairs_per_prompt`` random pairs per prompt)."""
    import reward_models

    gen = torch.Generator("cpu").manual_seed(seed)
    sample_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    ode = torch.zeros(num_steps, dtype=torch.bool)
    latents, rewards = [], []
    for start in range(0, len(sample_prompts), batch_size):
        chunk = sample_prompts[start : start + batch_size]
        embeds = adapter.encode_prompts(chunk, with_uncond=guidance_scale > 1)
        traj = sample_linear(adapter, kernel, embeds, schedule, ode, guidance_scale=guidance_scale, height=resolution,
                             width=resolution, generator=gen, keep_latents=False)
        latents.append(traj.latents[:, -1].float().cpu())
        scores = reward_fn(traj.images, chunk, [{} for _ in chunk])
        rewards.append(reward_models.check_reward_output("pairs.reward", scores, len(chunk)))
        log(f"  generated {min(start + batch_size, len(sample_prompts))}/{len(sample_prompts)} samples")
    latents_t, rewards_t = torch.cat(latents), torch.cat(rewards)
    pairs, labels = [], []
    for p in range(len(prompts)):
        base = p * samples_per_prompt
        cand = []
        for i in range(samples_per_prompt):
            for j in range(i + 1, samples_per_prompt):
                ri, rj = float(rewards_t[base + i]), float(rewards_t[base + j])
                if np.isfinite(ri) and np.isfinite(rj) and abs(ri - rj) > tie_tolerance:
                    cand.append((base + i, base + j, 1.0 if ri > rj else 0.0))
        if len(cand) > max_pairs_per_prompt:
            pick = torch.randperm(len(cand), generator=gen)[:max_pairs_per_prompt].tolist()
            cand = [cand[i] for i in sorted(pick)]
        for a, b, y in cand:
            if torch.rand((), generator=gen) < 0.5:  # preferred image first or second with equal odds
                a, b, y = b, a, 1.0 - y
            pairs.append((a, b))
            labels.append(y)
    pair_t = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return PairSet(latents_t, sample_prompts, pair_t, torch.tensor(labels, dtype=torch.float32), rewards_t)


# ---- pairs from a file ------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if suffix == ".json":
            rows = json.loads(path.read_text())
            if not isinstance(rows, list):
                raise DRMError(f"pairs file {str(path)!r} must hold a JSON list of rows")
            return rows
        if suffix == ".csv":
            with open(path, newline="") as f:
                return list(csv.DictReader(f))
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DRMError(f"pairs file {str(path)!r}: reading parquet needs pyarrow (pip install pyarrow)") from None
            return pq.read_table(path).to_pylist()
    except ValueError as exc:
        raise DRMError(f"pairs file {str(path)!r} cannot be parsed: {exc}") from None
    raise DRMError(f"pairs file {str(path)!r}: unknown format {suffix!r} (use .jsonl, .json, .csv or .parquet)")


def _get(row: dict, keys: Sequence[str]):
    for k in keys:
        if k in row and row[k] is not None and row[k] != "":
            return row[k]
    return None


def _truthy(value) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "")


def _image_ref(value, folder: Path):
    """bytes, or a Path; base64 strings prefixed with ``base64:`` are decoded."""
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


def read_pairs_file(path: str | Path, *, drop_ties: bool = False) -> list[dict]:
    """Rows ``{"prompt", "image_0", "image_1", "label_0"}`` (images as bytes or Paths), after
    checking that every referenced image exists."""
    path = Path(path)
    if not path.is_file():
        raise DRMError(f"pairs file {str(path)!r} does not exist")
    rows = _read_rows(path)
    out, missing = [], []
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DRMError(f"pairs file {str(path)!r} row {n} is not a mapping")
        if "has_label" in row and not _truthy(row["has_label"]):
            continue
        prompt = _get(row, _PROMPT_KEYS)
        if prompt is None:
            raise DRMError(f"pairs file {str(path)!r} row {n} has no caption")
        images = []
        for keys in _IMAGE_KEYS:
            ref = _image_ref(_get(row, keys), path.parent)
            if ref is None:
                raise DRMError(f"pairs file {str(path)!r} row {n} has no {keys[0]}")
            if isinstance(ref, Path) and not ref.is_file():
                missing.append((n, ref))
            images.append(ref)
        label0, label1 = _get(row, ("label_0",)), _get(row, ("label_1",))
        try:
            label = float(label0) if label0 is not None else (1.0 - float(label1) if label1 is not None else None)
        except (TypeError, ValueError):
            label = float("nan")
        if label is None or not 0.0 <= label <= 1.0:
            raise DRMError(f"pairs file {str(path)!r} row {n}: label_0 must be 0, 0.5 or 1 (or label_1 given), got {label0!r}")
        if drop_ties and label == 0.5:
            continue
        out.append({"prompt": str(prompt), "image_0": images[0], "image_1": images[1], "label_0": label})
    if missing:
        n, ref = missing[0]
        raise DRMError(f"pairs file {str(path)!r}: {len(missing)} image(s) missing, first {str(ref)!r} (row {n})")
    if not out:
        raise DRMError(f"pairs file {str(path)!r} holds no labelled pairs")
    return out


def load_image(ref, resolution: int) -> torch.Tensor:
    """(3, R, R) fp32 in [0, 1]: centre crop to a square, resize to ``resolution``."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref).convert("RGB")
    except OSError as exc:
        raise DRMError(f"cannot read image {str(ref)[:80]!r}: {exc}") from None
    side = min(img.size)
    left, top = (img.width - side) // 2, (img.height - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.BICUBIC)
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)


@torch.no_grad()
def load_pairs_file(path: str | Path, adapter: ModelAdapter, resolution: int, *, drop_ties: bool = False,
                    batch_size: int = 16) -> PairSet:
    """Read a Pick-a-Pic-layout file and encode its images to the adapter's latents."""
    rows = read_pairs_file(path, drop_ties=drop_ties)
    refs = [r[k] for r in rows for k in ("image_0", "image_1")]
    latents = []
    for s in range(0, len(refs), batch_size):
        images = torch.stack([load_image(ref, resolution) for ref in refs[s : s + batch_size]])
        latents.append(encode_images(adapter, images).float().cpu())
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    pairs = torch.arange(2 * len(rows)).view(-1, 2)
    return PairSet(torch.cat(latents), prompts, pairs, torch.tensor([r["label_0"] for r in rows], dtype=torch.float32))
