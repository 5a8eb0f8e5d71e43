"""Rollout samples between rollout and update (``rollout.offload_samples``).

A group's samples, kept from the rollout until the update uses them, are a :class:`~diffalign.sampling.Trajectory`
(latents ``(B, T+1, *latent)``, log-probs, images), the prompt embeddings, advantages and the
like. For a video model the latents and step records of a group are gigabytes: with
``rollout.offload_samples`` the trainer moves them to CPU memory after the rollout
(:meth:`~diffalign.trainer.Trainer.stash_samples`) and the update moves each micro-batch back
(:meth:`~diffalign.trainer.Trainer.to_device`); moves are exact copies, so the weights are those of
a run without it. :func:`to_device` is the one mover for every kind of sample.
"""

from __future__ import annotations

import dataclasses

import torch

from diffalign.adapters.base import PromptEmbeds


def to_device(item, device: torch.device):
    """``item`` with every tensor it holds on ``device``: a tensor, :class:`PromptEmbeds`, a
    dataclass of tensors (a trajectory), or a tuple / list / dict of them; anything else (None,
    numbers, prompts) as it is. A tensor already there is returned itself (no copy)."""
    if isinstance(item, torch.Tensor):
        return item.to(device)
    if isinstance(item, PromptEmbeds):
        return item.to(device)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, **{f.name: to_device(getattr(item, f.name), device)
                                           for f in dataclasses.fields(item) if f.init})
    if isinstance(item, (tuple, list)):
        return type(item)(to_device(x, device) for x in item)
    if isinstance(item, dict):
        return {k: to_device(v, device) for k, v in item.items()}
    return item
