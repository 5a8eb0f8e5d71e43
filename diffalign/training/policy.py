"""The trained policy: LoRA adapters (or full fine-tuning), the frozen reference, EMA weights.

:func:`prepare_denoiser` makes the adapter's denoiser trainable as ``cfg.lora`` and ``cfg.train``
say; the :class:`Policy` it returns switches to the frozen reference model (the same network with
the LoRA adapter disabled, or a frozen copy for full fine-tuning) for KL terms.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch

from diffalign.errors import ConfigError


class Policy:
    """The peft layers of the denoiser (toggled for the reference) or, for full fine-tuning, a
    frozen copy taken at the start (``ref_denoiser``; None when no reference is needed)."""

    def __init__(self, adapter, lora: bool, lora_layers: list, ref_denoiser: Optional[torch.nn.Module]):
        self.adapter = adapter
        self.lora = lora
        self.lora_layers = lora_layers
        self.ref_denoiser = ref_denoiser

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[None]:
        """The frozen reference in place of the trained denoiser, for the duration of the block."""
        if self.lora:
            # Toggle the peft layers found once at setup: diffusers' disable_adapters() walks every
            # module and checks versions on each call (15 ms per forward on an SD3.5-sized model).
            for layer in self.lora_layers:
                layer.enable_adapters(False)
            try:
                yield
            finally:
                for layer in self.lora_layers:
                    layer.enable_adapters(True)
            return
        if self.ref_denoiser is None:
            raise RuntimeError("no reference model: set needs_reference before setup()")
        with self.adapter.swapped_denoiser(self.ref_denoiser):
            yield


def prepare_denoiser(adapter, cfg, needs_reference: bool) -> Policy:
    """Add the LoRA adapter (``cfg.lora``) or unfreeze the whole denoiser, copy the reference when
    full fine-tuning needs one, apply ``train.gradient_checkpointing`` / ``channels_last`` /
    ``detach_uncond``, and keep trainable weights in fp32 whatever the model dtype."""
    denoiser = adapter.denoiser
    ref_denoiser = None
    if cfg.lora.enabled:
        from peft import LoraConfig

        targets = cfg.lora.targets or list(adapter.default_lora_targets)
        init = {"gaussian": "gaussian", "default": True, "zeros_b": True}[cfg.lora.init]
        lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          init_lora_weights=init, target_modules=targets)
        try:
            denoiser.add_adapter(lora)
        except ValueError as exc:
            raise ConfigError(f"config key 'lora.targets' {targets} does not fit the denoiser: {str(exc).splitlines()[0]}") from None
    else:
        denoiser.requires_grad_(True)
        if needs_reference:
            ref_denoiser = copy.deepcopy(denoiser).requires_grad_(False).eval()
    from peft.tuners.tuners_utils import BaseTunerLayer

    lora_layers = [m for m in denoiser.modules() if isinstance(m, BaseTunerLayer)]
    if cfg.train.gradient_checkpointing and hasattr(denoiser, "enable_gradient_checkpointing"):
        denoiser.enable_gradient_checkpointing()
    if cfg.train.channels_last:
        denoiser.to(memory_format=torch.channels_last)
    adapter.detach_uncond = cfg.train.detach_uncond
    for p in denoiser.parameters():  # trainable weights in fp32 whatever the model dtype (mixed precision)
        if p.requires_grad:
            p.data = p.data.float()
    return Policy(adapter, cfg.lora.enabled, lora_layers, ref_denoiser)


class EMA:
    """Exponential moving average of the trainable parameters, for evaluation and export.

    Flow-GRPO applies ``ema = d * ema + (1 - d) * theta`` every ``every`` optimizer steps (decay 0.9,
    every 8), a short memory that smooths the last few updates. Two choices keep a short run's EMA
    from being the initial weights:

    - the first update comes at the first optimizer step (then steps 1 + every, 1 + 2 every, ...),
      not at step ``every``, which a run of fewer steps never reaches;
    - the decay warms up as diffusers' ``EMAModel`` does: the ``n``-th update (``n`` = 0, 1, ...)
      uses ``d_n = min(decay, (1 + n) / (10 + n))`` (0.1, 0.18, 0.25, ...), so early averages follow
      the trained weights instead of holding on to the initial ones.
    """

    WARMUP_OFFSET = 10  # d_n = (1 + n) / (WARMUP_OFFSET + n), diffusers' EMAModel without use_ema_warmup

    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int):
        self.params = params
        self.decay = decay
        self.every = every
        self.shadow = [p.detach().clone().float() for p in params]
        self.steps = 0  # optimizer steps seen
        self.updates = 0  # averages applied (n)

    def current_decay(self) -> float:
        """The decay the next update uses: ``min(decay, (1 + n) / (10 + n))``."""
        n = self.updates
        return min(self.decay, (1 + n) / (self.WARMUP_OFFSET + n))

    @torch.no_grad()
    def update(self) -> None:
        self.steps += 1
        if (self.steps - 1) % self.every:
            return
        d = self.current_decay()
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(p.detach().float(), alpha=1 - d)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily load the EMA weights into the model."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.clone() for s in self.shadow], "steps": self.steps, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)
        self.steps = state["steps"]
        # checkpoints written before the warm-up counted no updates: they applied one every `every` steps
        self.updates = state.get("updates", self.steps // self.every)
