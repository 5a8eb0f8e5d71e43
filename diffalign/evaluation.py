"""Held-out evaluation of a base model and trained runs, as a per-family table."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

import reward_models
from diffalign.sampling import sample_images


def evaluate_adapter(
    adapter,
    prompts: Sequence[str],
    *,
    reward: str = "shapes_eval",
    reward_kwargs: dict | None = None,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    resolution: int | None = None,
    seed: int = 1234,
    samples_per_prompt: int = 1,
    batch_size: int = 32,
    extra_rewards: Mapping[str, tuple[str, dict]] | None = None,
) -> dict[str, float]:
    """Sample every prompt ``samples_per_prompt`` times with a fixed seed and score it.

    Returns ``{"reward_mean": ..., **reward.last_info}`` (for ShapesEval: ``acc/<family>``
    and ``acc/overall``), plus ``{label: mean}`` for every ``label: (reward, kwargs)`` of
    ``extra_rewards``, scored on the same images (e.g. ShapesEval with partial credit)."""
    fn = reward_models.build(reward, device=str(adapter.device), **(reward_kwargs or {}))
    extra = {label: (name, reward_models.build(name, device=str(adapter.device), **(kw or {})))
             for label, (name, kw) in (extra_rewards or {}).items()}
    all_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    images = sample_images(adapter, all_prompts, num_steps=num_steps, guidance_scale=guidance_scale,
                           resolution=resolution or adapter.default_resolution, seed=seed, batch_size=batch_size)
    metadata = [{} for _ in all_prompts]
    scores = reward_models.check_reward_output(reward, fn(images, all_prompts, metadata), len(all_prompts))
    out = {"reward_mean": float(scores[torch.isfinite(scores)].mean())}
    out.update({k: float(v) for k, v in (getattr(fn, "last_info", None) or {}).items()})
    for label, (name, extra_fn) in extra.items():
        s = reward_models.check_reward_output(name, extra_fn(images, all_prompts, metadata), len(all_prompts))
        out[label] = float(s[torch.isfinite(s)].mean())
    return out


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """Rows = metrics (union of keys), columns = models. Plain text, aligned."""
    keys: list[str] = []
    for col in columns.values():
        keys += [k for k in col if k not in keys]
    keys.sort(key=lambda k: (k == "acc/overall", k == "reward_mean", k))
    names = list(columns)
    width = max([len(k) for k in keys] + [6])
    colw = [max(len(n), 8) for n in names]
    lines = [" " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, colw))]
    for k in keys:
        cells = []
        for n, w in zip(names, colw):
            v = columns[n].get(k)
            cells.append(("-" if v is None else f"{v:.3f}").rjust(w))
        lines.append(k.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)
