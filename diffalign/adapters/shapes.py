"""Adapter for the embedded shapes model (:class:`~diffalign.shapes.pipeline.ShapesPipeline`).

Pixel-space rectified flow at 32x32: the "latent" is the image in ``[-1, 1]``, ``t`` is sigma
(1 = noise), the UNet predicts ``v = eps - x0`` and gets ``t * 1000`` as its timestep input.
The pretrained weights ship with the package (:data:`SHIPPED_MODEL_DIR`), so this family runs
offline on a laptop CPU.

LoRA targets: the UNet has attention only at the 16x16 and 8x8 levels and in the mid block, so
LoRA on the attention projections alone touches none of the 32x32 layers that draw edges and
small objects. The defaults add the resnet convolutions (``conv1``, ``conv2``; peft handles
``Conv2d`` LoRA) and the rest of the transformer blocks (``proj_in``, ``proj_out``,
feed-forward). Quick check on the earlier shipped model, whose attention was at 8x8 only
(supervised flow-matching LoRA fine-tune on held-out prompts, r 16, lr 3e-4, 40 steps of 32
images): held-out loss 0.0632 -> 0.0631 with attention only (131k LoRA parameters) vs 0.0632 ->
0.0617 with the defaults (626k).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Sequence

import torch

from diffalign.errors import ModelLoadError
from diffalign.shapes.model import TINY_CONFIG, build_pipeline
from diffalign.shapes.pipeline import SHIPPED_MODEL_DIR, ShapesPipeline
from ._util import module_dtype, pipeline_kwargs
from .base import ModelAdapter, PromptEmbeds


# from_pretrained keywords that say which Hub files to fetch: snapshot_download's
HUB_DOWNLOAD_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")


class ShapesAdapter(ModelAdapter):
    family: ClassVar[str] = "shapes"
    prediction_type: ClassVar[str] = "flow"
    default_resolution: ClassVar[int] = 32
    default_lora_targets: ClassVar[list[str]] = [
        "to_q", "to_k", "to_v", "to_out.0",  # self- and cross-attention (16x16, 8x8, mid block)
        "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",  # rest of the transformer blocks
        "conv1", "conv2",  # resnet convolutions at every resolution
    ]

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def default_model_path(cls) -> str:
        """The pretrained model shipped inside the package."""
        return SHIPPED_MODEL_DIR

    @classmethod
    def from_pretrained(cls, model_id: str | None = None, *, device="cpu", dtype=torch.float32, **kwargs) -> "ShapesAdapter":
        """Load a saved :class:`ShapesPipeline` folder or Hub repo (default: the shipped model).

        A Hub repo is downloaded first and loaded from its local copy: an exported repo names its
        own copy of the pipeline's code in ``model_index.json``, which diffusers would want to run
        from the Hub (``trust_remote_code``); diffalign loads it with its own class instead."""

        model_id = str(model_id or cls.default_model_path())
        try:
            source = model_id
            if not Path(model_id).expanduser().is_dir():
                from huggingface_hub import snapshot_download

                hub = {k: kwargs.pop(k) for k in HUB_DOWNLOAD_KWARGS if k in kwargs}
                source = snapshot_download(model_id, **hub)
            pipe = ShapesPipeline.from_pretrained(source, **pipeline_kwargs(dtype, kwargs))
        except (OSError, EnvironmentError, ValueError) as e:
            raise ModelLoadError(f"cannot load shapes model from {model_id!r}: {e}") from e
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device=device, dtype=dtype)

    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, words: Sequence[str] | None = None) -> "ShapesAdapter":
        """Random init, same architecture with narrower channels (see ``TINY_CONFIG``)."""
        pipe = build_pipeline(words, TINY_CONFIG, seed=seed)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device=device, dtype=dtype)

    # ---- the contract -------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (3, height, width)  # pixel space, no VAE

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        prompts = list(prompts)
        cond = self.pipeline.encode_prompt(prompts, self.device)
        uncond = None
        if with_uncond:
            empty = self.pipeline.encode_prompt([""], self.device)
            uncond = {"encoder_hidden_states": empty.expand(len(prompts), -1, -1).contiguous()}
        return PromptEmbeds({"encoder_hidden_states": cond}, uncond)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        unet = self.denoiser
        dtype = module_dtype(unet)

        def forward(xb, tb, kwargs):
            # UNet timestep input = sigma * 1000 (FlowMatchEulerDiscreteScheduler.timesteps).
            return unet(xb.to(dtype), tb * 1000.0, encoder_hidden_states=kwargs["encoder_hidden_states"].to(dtype)).sample

        return self._guided(forward, x, t, embeds, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1) / 2).clamp(0, 1)
