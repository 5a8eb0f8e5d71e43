"""The model axis: one adapter per diffusers pipeline family.

An adapter wraps a real diffusers pipeline and exposes exactly what samplers and algorithms
need, so that adding a model never touches an algorithm:

- ``encode_prompts``: text -> :class:`PromptEmbeds` (cond, and uncond for CFG), no grad;
- ``predict``: the denoiser output at ``(x, t)``, with CFG done in **one** batched forward;
- ``to_x0``: Tweedie / x0-prediction from a model output;
- ``decode``: latents -> images in ``[0, 1]`` (fp32, ``(B, 3, H, W)``);
- ``make_schedule``: the sampling times for ``num_steps`` steps;
- ``denoiser``: the trainable module (LoRA goes here); ``default_lora_targets``.

A family implements ``from_pretrained``, ``build_tiny``, ``encode_prompts`` and ``predict``; the
rest has defaults for the common diffusers layout, which a family overrides where it differs:
``denoiser`` (the pipeline's ``transformer`` or ``unet``), ``frozen_modules`` (every other torch
module of the pipeline), ``latent_shape`` (a transformer on VAE latents, see ``latent_packing``),
``decode`` (the VAE with ``scaling_factor`` / ``shift_factor``), and for flow models ``to_x0``
and ``make_schedule`` (the pipeline's own scheduler). Epsilon UNets take the last two (and
``latent_shape``) from ``_ddim.UNetDDIMMixin``.

Time convention (``t`` everywhere below): for flow models (``prediction_type == "flow"``)
``t`` is sigma in ``[0, 1]`` (1 = pure noise) and the model predicts velocity
``v = eps - x0``; for epsilon models ``t`` is the integer DDPM timestep (as float) and the
schedule ends with ``-1`` meaning "the final, clean state".
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, Sequence

import torch

from ._util import bcast, guided_forward, pipeline_kwargs, scheduler_sigmas, vae_decode

# ``model.dtype`` (and ``algorithm.quant.compute_dtype``) names -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PromptEmbeds:
    """Encoded prompts for a batch of B samples.

    ``cond`` maps the denoiser's keyword names (e.g. ``encoder_hidden_states``,
    ``pooled_projections``) to tensors whose first dimension is B. ``uncond`` holds the same
    keys for the empty / negative prompt (also first dimension B) or ``None`` when CFG is off.
    """

    cond: dict[str, torch.Tensor]
    uncond: Optional[dict[str, torch.Tensor]] = None

    def __len__(self) -> int:
        return next(iter(self.cond.values())).shape[0]

    def guidance_batch(self) -> dict[str, torch.Tensor]:
        """``[uncond; cond]`` per key (2B rows): the text inputs of a batched CFG forward.

        Concatenated on the first call and kept, as a pipeline concatenates its prompt embeddings
        once per call rather than once per step; a rollout or an update then reuses them at every
        step (for SD3's T5 states that is one copy of the largest inputs saved per forward). Not
        kept when a tensor requires grad. Kept apart for inference mode (a rollout) and outside it
        (an update): tensors made in inference mode cannot be saved for a backward. The dicts are
        not to be changed in place once used.
        """
        key = "_guidance_batch_inference" if torch.is_inference_mode_enabled() else "_guidance_batch"
        batch = self.__dict__.get(key)
        if batch is None:
            batch = {k: torch.cat([self.uncond[k], self.cond[k]]) for k in self.cond}
            if not any(v.requires_grad for v in batch.values()):
                self.__dict__[key] = batch
        return batch

    def _map(self, fn) -> "PromptEmbeds":
        return PromptEmbeds(
            {k: fn(v) for k, v in self.cond.items()},
            None if self.uncond is None else {k: fn(v) for k, v in self.uncond.items()},
        )

    def select(self, index) -> "PromptEmbeds":
        """Rows ``index`` (slice, list or LongTensor) of every tensor."""
        return self._map(lambda v: v[index])

    def repeat_interleave(self, n: int) -> "PromptEmbeds":
        return self._map(lambda v: v.repeat_interleave(n, dim=0))

    def to(self, device=None, dtype=None) -> "PromptEmbeds":
        return self._map(lambda v: v.to(device=device, dtype=dtype if v.is_floating_point() else None))

    @classmethod
    def named(cls, names: Sequence[str], cond: Sequence[torch.Tensor], uncond: Optional[Sequence[torch.Tensor]] = None) -> "PromptEmbeds":
        """``cond`` (and ``uncond``, ``None`` without CFG) keyed by the denoiser's keyword ``names``."""
        return cls(dict(zip(names, cond)), None if uncond is None else dict(zip(names, uncond)))

    @classmethod
    def from_encoder(cls, encode, prompts: Sequence[str], with_uncond: bool, negative_prompt: str = "") -> "PromptEmbeds":
        """``encode(texts) -> dict`` run on ``prompts``, and on as many ``negative_prompt`` for CFG."""
        prompts = list(prompts)
        return cls(encode(prompts), encode([negative_prompt] * len(prompts)) if with_uncond else None)

    @staticmethod
    def cat(items: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        cond = {k: torch.cat([e.cond[k] for e in items]) for k in items[0].cond}
        uncond = None
        if items[0].uncond is not None:
            uncond = {k: torch.cat([e.uncond[k] for e in items]) for k in items[0].uncond}
        return PromptEmbeds(cond, uncond)


class ModelAdapter(ABC):
    """Base class of all model adapters. See the module docstring for the contract."""

    family: ClassVar[str]  # "sd3", "flux", "sd15", "shapes", ...
    prediction_type: ClassVar[str]  # "flow" (velocity) or "epsilon"
    default_resolution: ClassVar[int] = 512
    default_lora_targets: ClassVar[list[str]] = []
    pipeline_class: ClassVar[str] = ""  # the diffusers pipeline from_pretrained loads, e.g. "FluxPipeline"
    options: ClassVar[tuple[str, ...]] = ()  # adapter options: the constructor's keyword-only arguments
    # from_pretrained keywords used unless given: pipeline arguments or adapter options that differ
    # for a real checkpoint (SD1.5: no safety checker; Sana: the complex human instruction on).
    pretrained_defaults: ClassVar[dict] = {}
    latent_packing: ClassVar[int] = 1  # latent patches the pipeline packs into channels (FLUX.1: 2x2); see latent_shape
    display_name: ClassVar[str] = ""  # the family in error messages ("SD3", "FLUX.2"); "" = family

    def __init__(self, pipeline, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.dtype = dtype
        self.detach_uncond = False  # CFG updates: uncond branch without gradient (train.detach_uncond)
        pipeline.to(self.device)
        # Frozen parts (text encoders, VAE) stay in `dtype`; the trainer decides about the denoiser.
        for module in self.frozen_modules():
            module.requires_grad_(False)
            _cast(module, dtype)
        _cast(self.denoiser, dtype)
        self.denoiser.requires_grad_(False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_id: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "ModelAdapter":
        """Load ``pipeline_class`` with its own ``from_pretrained`` (hub id or local folder).

        ``kwargs`` named in :attr:`options` go to the adapter's constructor, the rest to the
        pipeline's ``from_pretrained`` (``revision``, ``variant`` ...); :attr:`pretrained_defaults`
        fills in either kind when not given."""
        import diffusers

        kwargs = {**cls.pretrained_defaults, **kwargs}
        options = {name: kwargs.pop(name) for name in cls.options if name in kwargs}
        pipeline = getattr(diffusers, cls.pipeline_class).from_pretrained(model_id, **pipeline_kwargs(dtype, kwargs))
        return cls(pipeline, device=device, dtype=dtype, **options)

    @classmethod
    @abstractmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "ModelAdapter":
        """A tiny randomly initialised pipeline of this family built in code (offline);
        ``kwargs`` are adapter options (as for ``from_pretrained``)."""

    # ---- the contract -------------------------------------------------------------------
    @property
    def denoiser(self) -> torch.nn.Module:
        """The trainable network: the pipeline's ``transformer``, else its ``unet``."""
        transformer = getattr(self.pipeline, "transformer", None)
        return transformer if transformer is not None else self.pipeline.unet

    def denoiser_parts(self) -> dict[str, torch.nn.Module]:
        """The pipeline components that make up :attr:`denoiser`, by component name, in the
        pipeline's order: ``{"transformer": ...}`` (or ``"unet"``) for one network. A denoiser of
        several networks (Wan2.2's two experts) is a module whose children carry the components'
        names; its LoRA is saved and loaded part by part (``diffalign.export``)."""
        denoiser = self.denoiser
        for name, module in self.pipeline.components.items():
            if module is denoiser:
                return {name: module}
        raise RuntimeError("the adapter's denoiser is not a component of its pipeline")

    @contextmanager
    def swapped_denoiser(self, module: torch.nn.Module) -> Iterator[None]:
        """``module``, a copy of :attr:`denoiser` (the frozen reference of full fine-tuning, a
        low-precision copy), in place of the denoiser in the pipeline for the duration of the
        block; a denoiser of several parts is replaced by ``module``'s children of the same names."""
        parts = self.denoiser_parts()
        replacement = {name: module if len(parts) == 1 else getattr(module, name) for name in parts}
        for name, part in replacement.items():
            setattr(self.pipeline, name, part)
        try:
            yield
        finally:
            for name, part in parts.items():
                setattr(self.pipeline, name, part)

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Every torch module of the pipeline but the denoiser (text encoders, VAE, ...), in the
        order of their component names; these are never trained."""
        denoiser, components = self.denoiser, self.pipeline.components
        modules = (components[name] for name in sorted(components))
        return [m for m in modules if isinstance(m, torch.nn.Module) and m is not denoiser]

    def text_encoders(self) -> dict[str, torch.nn.Module]:
        """The modules :meth:`encode_prompts` runs, by component name: every torch module component
        named ``text_encoder*`` (diffusers' name for them: SD3's CLIP-L, CLIP-G and T5, FLUX.1's CLIP
        and T5, Wan's umT5, Qwen-Image's Qwen2.5-VL, ShapesWorld's encoder). A run may keep them off
        the device between encodings or free them (``model.text_encoders``,
        :mod:`diffalign.training.text_encoders`); a family whose encoders are named otherwise
        overrides this."""
        components = self.pipeline.components
        return {name: components[name] for name in sorted(components)
                if name.startswith("text_encoder") and isinstance(components[name], torch.nn.Module)}

    def release_text_encoders(self) -> None:
        """Drop the text encoders from the pipeline (their memory is freed once nothing else holds
        them); :meth:`encode_prompts` cannot run afterwards, so whoever calls this replaces it (a
        run's embedding cache, :mod:`diffalign.training.text_encoders`)."""
        for name in self.text_encoders():
            setattr(self.pipeline, name, None)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one latent (without batch) for an image of ``height x width`` pixels.

        By default a transformer on the latents of a VAE that downsamples ``vae_scale_factor``
        times, in ``patch x patch`` patches, so sizes are multiples of their product. The patch is
        the transformer's ``patch_size`` (SD3, Sana), or ``latent_packing`` when the pipeline
        packs patches into the transformer's input channels (FLUX.1, Qwen-Image: 2x2), so that a
        latent has ``in_channels / latent_packing^2`` channels. Other layouts override it.
        """
        config, packing, factor = self.denoiser.config, self.latent_packing, self.pipeline.vae_scale_factor
        patch = packing if packing > 1 else config.patch_size
        channels = config.in_channels // (packing * packing)
        return self._latent_shape(height, width, multiple=factor * patch, channels=channels, downsample=factor)

    @abstractmethod
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        """Encode prompts; ``with_uncond`` also encodes the empty prompt for CFG. Every part that
        needs embeddings calls this, so that a run may put its own encoding in place of the
        family's on the adapter object (``model.text_encoders``: offloaded encoders, an embedding
        cache; :mod:`diffalign.training.text_encoders`)."""

    @abstractmethod
    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Denoiser output at ``(x, t)``; ``t`` has shape ``(B,)``. When ``guidance_scale > 1``
        and ``embeds.uncond`` is set, uncond and cond go through one batched forward and the
        result is ``uncond + g * (cond - uncond)``. The output has x's shape and dtype fp32."""

    def to_x0(self, model_output: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Tweedie estimate of the clean latent from a model output (fp32). Flow models:
        ``x0_hat = x_t - t * v``; epsilon adapters override it (``_ddim.UNetDDIMMixin``)."""
        self._require_flow("to_x0")
        return x.float() - bcast(t, x) * model_output.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images ``(B, 3, H, W)`` fp32 in ``[0, 1]``. By default the pipeline's VAE in
        its own dtype, undoing ``z_model = (z_vae - shift_factor) * scaling_factor``
        (:func:`_util.vae_decode`); families with other latent statistics override it."""
        return vae_decode(self.pipeline.vae, latents, self.pipeline.vae.dtype)

    def decode_with_grad(self, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` with gradients flowing back to ``latents``, for losses through a
        differentiable reward (DRaFT, ReFL: ``diffalign.recipes.drft``). Every family's ``decode``
        is its decoding wrapped in ``@torch.no_grad()`` (no graph in rollouts and evaluations);
        this runs the function that decorator wraps (``functools.wraps`` keeps it as ``__wrapped__``),
        so a family's decoding is written once."""
        return inspect.unwrap(type(self).decode)(self, latents)

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """``num_steps + 1`` times ``t_0 > t_1 > ... > t_T`` (fp32, CPU). Flow: sigmas from the
        pipeline's scheduler config ending in 0; by default those of a fresh copy of the
        pipeline's own scheduler after ``set_timesteps(num_steps)``. Epsilon: DDIM timesteps
        ending in -1 (``_ddim.UNetDDIMMixin``)."""
        self._require_flow("make_schedule")
        return scheduler_sigmas(self.pipeline.scheduler, num_steps)

    def _require_flow(self, method: str) -> None:
        if self.prediction_type != "flow":
            raise NotImplementedError(f"{type(self).__name__} must implement {method} for {self.prediction_type!r} predictions")

    # ---- shared helpers -----------------------------------------------------------------
    def prepare_noise(self, batch_size: int, height: int, width: int, generator=None) -> torch.Tensor:
        """Initial noise ``x_T`` (fp32) on the adapter's device."""
        shape = (batch_size, *self.latent_shape(height, width))
        return torch.randn(shape, generator=generator, device=generator.device if generator is not None else "cpu").to(self.device)

    def _latent_shape(
        self, height: int, width: int, *, multiple: int, channels: int, downsample: int, frames: Optional[int] = None,
        what: str = "image",
    ) -> tuple[int, ...]:
        """``(channels, [frames,] height / downsample, width / downsample)`` for a size whose sides
        are multiples of ``multiple`` (VAE downsampling times patching); else ``ValueError``
        naming the family's ``display_name`` and ``what`` ("image", "frame")."""
        if height % multiple or width % multiple:
            raise ValueError(f"{self.display_name or self.family} {what} size must be a multiple of {multiple}, got {height}x{width}")
        return (channels, *(() if frames is None else (frames,)), height // downsample, width // downsample)

    def _guided(self, forward, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float, combine=None) -> torch.Tensor:
        """:func:`_util.guided_forward` with this adapter's ``detach_uncond``."""
        return guided_forward(forward, x, t, embeds, guidance_scale, self.detach_uncond, combine=combine)

    def config_summary(self) -> dict:
        """A few facts for logs and model cards."""
        n = sum(p.numel() for p in self.denoiser.parameters())
        return {"family": self.family, "prediction_type": self.prediction_type, "denoiser_params": n}


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` only when some floating-point parameter differs: diffusers' ``to``
    warns on every dtype cast (and refuses one on quantized models), even a no-op."""
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        module.to(dtype=dtype)
