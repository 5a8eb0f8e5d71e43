"""Shared pieces of the step kernels: the output dataclass and the Gaussian log-density."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StepOutput:
    """Result of one reverse step ``x_t -> x_{t'}``.

    Shapes: ``prev_sample``, ``mean`` are ``(B, *latent)``; ``log_prob`` is ``(B,)`` (fp32);
    ``std`` is the transition standard deviation, broadcastable to ``prev_sample`` (a 0-d
    tensor, or ``(B, 1, ..., 1)``). For deterministic (ODE) steps ``std`` is zero and
    ``log_prob`` is ``None``.
    """

    prev_sample: torch.Tensor
    log_prob: Optional[torch.Tensor]
    mean: torch.Tensor
    std: torch.Tensor
