"""Helpers shared by the diffusers adapters (not part of the public API)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

if TYPE_CHECKING:  # base imports this module
    from .base import PromptEmbeds


def bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` of shape ``(B,)`` (or a scalar) viewed as ``(B, 1, ..., 1)`` to broadcast against x."""
    t = torch.as_tensor(t, device=x.device, dtype=torch.float32)
    if t.ndim == 0:
        return t
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def batch_t(t: torch.Tensor | float, batch_size: int, device) -> torch.Tensor:
    """Times as fp32 ``(B,)`` on ``device``; a scalar is repeated for the whole batch."""
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    if t.ndim == 0:
        t = t.expand(batch_size)
    if t.shape != (batch_size,):
        raise ValueError(f"t must have shape ({batch_size},) or be a scalar, got {tuple(t.shape)}")
    return t


def guided_forward(
    forward: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    x: torch.Tensor,
    t: torch.Tensor,
    embeds: PromptEmbeds,
    guidance_scale: float,
    detach_uncond: bool = False,
    combine: Optional[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = None,
) -> torch.Tensor:
    """Classifier-free guidance in one batched forward.

    ``forward(x, t, cond_kwargs)`` runs the denoiser on a batch. With ``guidance_scale > 1``
    and ``embeds.uncond`` set, the batch is ``[uncond; cond]`` (2B rows) and the result is
    ``uncond + g * (cond - uncond)`` in fp32 (or ``combine(uncond, cond, g)`` when a family's
    pipeline guides differently); otherwise only the cond rows are run. With ``detach_uncond``
    and gradients enabled, the uncond rows run in a separate forward without gradient (the
    backward then covers B rows, not 2B).
    """
    t = batch_t(t, x.shape[0], x.device)
    if guidance_scale > 1.0 and embeds.uncond is not None:
        if detach_uncond and torch.is_grad_enabled():
            with torch.no_grad():
                uncond = forward(x, t, embeds.uncond).float()
            cond = forward(x, t, embeds.cond).float()
        else:
            out = forward(torch.cat([x, x]), torch.cat([t, t]), embeds.guidance_batch()).float()
            uncond, cond = out.chunk(2)
        if combine is not None:
            return combine(uncond, cond, guidance_scale)
        return uncond + guidance_scale * (cond - uncond)
    return forward(x, t, embeds.cond).float()


def vae_decode(vae, latents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Model latents -> images ``(B, 3, H, W)`` fp32 in ``[0, 1]``, in the caller's grad mode (an
    adapter's ``decode`` runs it under no_grad, ``decode_with_grad`` with gradients).

    Undoes the latent normalisation ``z_model = (z_vae - shift) * scale`` that the pipelines
    apply when encoding (SD1.5 has no shift).
    """
    scale = vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    z = latents.to(device=vae.device, dtype=dtype) / scale + shift
    return to_unit_range(vae.decode(z, return_dict=False)[0])


def denormalize_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """``z * latents_std + latents_mean`` per channel (axis 1) in the VAE's device and dtype: the
    model latents of the Wan-style VAEs (Wan2.1, Qwen-Image) -> what the VAE decodes (in the
    caller's grad mode, as :func:`vae_decode`)."""
    z = latents.to(device=vae.device, dtype=vae.dtype)
    shape = (1, -1, *([1] * (z.ndim - 2)))
    mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
    std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
    return z * std + mean


def to_unit_range(image: torch.Tensor) -> torch.Tensor:
    """Decoded pixels in ``[-1, 1]`` -> fp32 in ``[0, 1]``."""
    return (image.float() / 2 + 0.5).clamp(0, 1)


def scheduler_sigmas(scheduler, num_steps: int, *, scheduler_class=None, **set_timesteps_kwargs) -> torch.Tensor:
    """The sigmas (``num_steps + 1`` values ending in 0, fp32 on CPU) of a fresh copy of
    ``scheduler`` (no shared step state; of ``scheduler_class`` when given, from the same config)
    after ``set_timesteps(num_steps, **set_timesteps_kwargs)``, as a pipeline calls it."""
    fresh = (scheduler_class or type(scheduler)).from_config(scheduler.config)
    fresh.set_timesteps(num_steps, device="cpu", **set_timesteps_kwargs)
    return fresh.sigmas.detach().to("cpu", torch.float32).clone()


def pipeline_sigmas(num_steps: int, config=None) -> Optional[np.ndarray]:
    """The sigmas FLUX-style pipelines hand ``set_timesteps`` to shift: ``linspace(1, 1/N, N)``;
    ``None`` (the scheduler's own) when a scheduler ``config`` is given and asks for
    ``use_flow_sigmas`` (FLUX.1 and FLUX.2 check it, Qwen-Image does not)."""
    if config is not None and config.get("use_flow_sigmas", False):
        return None
    return np.linspace(1.0, 1 / num_steps, num_steps)


def shift_mu(config, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """The resolution-dependent shift ``mu`` of ``calculate_shift`` (one function copied into the
    FLUX.1, SD3 and Qwen-Image pipelines) from the scheduler ``config``'s ``base_image_seq_len``,
    ``max_image_seq_len``, ``base_shift`` and ``max_shift`` (default ``max_shift`` when absent:
    1.15 as FLUX.1 / Qwen-Image, SD3 passes 1.16)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )


def pipeline_kwargs(dtype: torch.dtype, kwargs: Optional[dict]) -> dict:
    """Keyword arguments for ``Pipeline.from_pretrained``: the dtype plus whatever the caller
    passed through (``revision``, ``variant``, ``cache_dir``, ``local_files_only`` ...)."""
    out = dict(kwargs or {})
    if "dtype" not in out and "torch_dtype" not in out:
        out[_dtype_kwarg()] = dtype
    return out


def _dtype_kwarg() -> str:
    # diffusers renamed `torch_dtype` to `dtype` (the old name warns); older releases only know the old one.
    try:
        from diffusers.utils import deprecation_utils

        return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    except ImportError:
        return "torch_dtype"


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """dtype of a module's first parameter (its base weights; LoRA layers come later).

    diffusers' ``ModelMixin.dtype`` walks every submodule on each access (ms per forward on a
    real model); this is O(1).
    """
    return next(module.parameters()).dtype


def is_flow_scheduler(scheduler) -> bool:
    """A rectified-flow scheduler: ``FlowMatchEulerDiscreteScheduler``, or a multistep solver
    (DPM-Solver, UniPC) configured with ``use_flow_sigmas`` and ``prediction_type="flow_prediction"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return True
    config = scheduler.config
    return bool(config.get("use_flow_sigmas", False)) and config.get("prediction_type") == "flow_prediction"


def gives_integer_timesteps(scheduler) -> bool:
    """Whether ``scheduler`` hands the denoiser integer timesteps (DPM-Solver, UniPC: ``int64``
    ``floor(1000 sigma)``) rather than float ones (FlowMatchEuler: ``1000 sigma``)."""
    probe = type(scheduler).from_config(scheduler.config)  # fresh: no shared step state
    probe.set_timesteps(2, device="cpu")
    return not probe.timesteps.is_floating_point()


class RotaryCache:
    """Reuse a parameter-free position-embedding module's output while its ids do not change.

    A DiT recomputes its rotary embeddings from the token position ids on every forward (FLUX.1's
    ``transformer.pos_embed``: float64 ``cos`` / ``sin`` tables per axis), although the ids of a
    rollout are the same at every step. Installed on such a module (:func:`rotary_cache`), this
    keeps the last ``ids`` and the tuple they produced, and returns that tuple again for equal
    ids (same shape, dtype, device and values) while :meth:`active` is entered; outside it the
    module computes as before, so the stock pipeline ``__call__`` on the same object is
    untouched. The tables depend on no parameter and nothing writes to them, so sharing them
    between forwards (and with an update's backward) is safe.
    """

    def __init__(self, module: torch.nn.Module):
        self.compute = module.forward  # the module's own forward, bound
        self.enabled = False
        self.hits = 0  # forwards served from the cache
        self._ids: Optional[torch.Tensor] = None
        self._out = None
        self._inference = False  # whether _out was computed in inference mode
        module.forward = self._forward  # an instance attribute: nn.Module.__call__ calls it

    def _forward(self, ids: torch.Tensor):
        if not self.enabled:
            return self.compute(ids)
        last = self._ids
        # tables made in inference mode (a rollout) cannot be saved for an update's backward
        usable = torch.is_inference_mode_enabled() or not self._inference
        if usable and last is not None and last.shape == ids.shape and last.dtype == ids.dtype \
                and last.device == ids.device and torch.equal(last, ids):
            self.hits += 1
            return self._out
        out = self.compute(ids)
        self._ids, self._out = ids.detach().clone(), out
        self._inference = torch.is_inference_mode_enabled()
        return out

    @contextmanager
    def active(self):
        previous, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = previous


def rotary_cache(module: Optional[torch.nn.Module]) -> Optional[RotaryCache]:
    """The :class:`RotaryCache` of ``module``, installed on first use; ``None`` when there is no
    module or it has parameters or buffers (its output could then change without its ids)."""
    if module is None or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    cache = module.__dict__.get("_rotary_cache")
    if cache is None:
        cache = RotaryCache(module)
        module.__dict__["_rotary_cache"] = cache
    return cache
