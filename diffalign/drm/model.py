"""The diffusion-based reward model (DRM): a denoiser backbone on noisy latents + a small head.

Paper: DRM / Step-GRPO (see ``docs/algorithms.md``). The backbone is a copy of a pretrained
diffusion denoiser (by default the policy's base checkpoint) that takes a **noisy latent**
``x_t``, its time ``t`` and the prompt, exactly as in sampling; its last blocks can be dropped
(``drop_last_blocks``). The hidden state after the last kept block goes through a small head

    features (B, C, h, w) -> GroupNorm -> MLP (per position) -> conv 3x3 -> mean pool -> MLP -> score (B,)

so the model scores a noisy state directly, with no decode and no rollout to the end.

How the backbone is cut, for any adapter family: the backbone runs through the adapter's own
``predict`` (so every family's conditioning — pooled text, FLUX packing, SDXL added conditions —
is handled by code that is already tested), and a forward hook on the last kept block stores its
output and stops the forward by raising :class:`_FeaturesReady`; the blocks after it and the
output layers are removed from the module (their weights are not kept). Kept blocks:

- UNets (shapes, SD1.5, SDXL): the down blocks, the mid block and all but the last
  ``drop_last_blocks`` up blocks (``drop == len(up_blocks)`` keeps the mid block only);
- transformers (SD3, FLUX, Sana): ``transformer_blocks`` then ``single_transformer_blocks``
  minus the last ``drop_last_blocks`` (at least one is kept); image tokens are laid out on
  their patch grid.

``t`` always follows the adapter's convention (sigma in [0, 1] for flow models, the DDPM index
for epsilon models); noising, encoding and the map from a noise level to ``t`` are the shared
forward process of :mod:`diffalign.forward_process`. A clean image is scored at t = 0
(:meth:`DiffusionRewardModel.score_images`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn

from diffalign.adapters import load_adapter
from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.errors import ConfigError, DiffalignError
from diffalign.forward_process import encode_images, model_time

FORMAT = "diffalign-drm"  # drm.json "format"
CONFIG_FILE = "drm.json"
WEIGHTS_FILE = "model.safetensors"
_EMBED_CACHE_SIZE = 4096  # prompts whose text embeddings are kept (text encoders are frozen)


class DRMError(DiffalignError):
    """A DRM folder is missing or malformed, or a DRM does not fit the model it should score."""


class _FeaturesReady(Exception):
    """Raised by the feature hook to stop the backbone after the last kept block."""


# ---- the head ---------------------------------------------------------------------------------
class DRMHead(nn.Module):
    """features (B, C, h, w) -> score (B,): GroupNorm, MLP per position (1x1 convs), a 3x3 conv,
    mean pooling, MLP. The last layer starts at zero, so an untrained DRM scores every input 0."""

    def __init__(self, in_channels: int, width: int = 128):
        super().__init__()
        self.norm = nn.GroupNorm(1, in_channels)  # features of different backbones differ in scale
        self.mlp_in = nn.Sequential(nn.Conv2d(in_channels, width, 1), nn.SiLU(), nn.Conv2d(width, width, 1), nn.SiLU())
        self.conv = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.SiLU())
        self.mlp_out = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 1))
        nn.init.zeros_(self.mlp_out[-1].weight)
        nn.init.zeros_(self.mlp_out[-1].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.mlp_in(self.norm(features.float())))
        return self.mlp_out(h.mean(dim=(2, 3))).squeeze(1)


# ---- cutting the backbone -------------------------------------------------------------------
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # in execution order
_OUTPUT_LAYERS = ("norm_out", "proj_out", "conv_norm_out", "conv_act", "conv_out")


def num_droppable_blocks(denoiser: nn.Module) -> int:
    """Largest valid ``drop_last_blocks`` for this denoiser."""
    if hasattr(denoiser, "up_blocks") and hasattr(denoiser, "mid_block"):
        return len(denoiser.up_blocks)
    total = sum(len(getattr(denoiser, name)) for name in _BLOCK_LISTS if getattr(denoiser, name, None) is not None)
    if total == 0:
        raise DRMError(f"{type(denoiser).__name__}: no blocks to cut a DRM backbone from")
    return total - 1


def cut_backbone(denoiser: nn.Module, drop_last_blocks: int) -> nn.Module:
    """Remove the last ``drop_last_blocks`` blocks and the output layers in place; return the
    block whose output is the feature map (see the module docstring)."""
    limit = num_droppable_blocks(denoiser)
    if not 0 <= drop_last_blocks <= limit:
        raise ConfigError(f"config key 'drm.drop_last_blocks' must be in [0, {limit}] for {type(denoiser).__name__}, got {drop_last_blocks}")
    if hasattr(denoiser, "up_blocks") and hasattr(denoiser, "mid_block"):
        keep = len(denoiser.up_blocks) - drop_last_blocks
        denoiser.up_blocks = nn.ModuleList(list(denoiser.up_blocks)[:keep])
        tap = denoiser.up_blocks[-1] if keep else denoiser.mid_block
    else:
        lists = [(name, getattr(denoiser, name)) for name in _BLOCK_LISTS if getattr(denoiser, name, None) is not None]
        keep = sum(len(blocks) for _, blocks in lists) - drop_last_blocks
        tap = None
        for name, blocks in lists:
            kept = list(blocks)[: max(keep, 0)]
            keep -= len(kept)
            setattr(denoiser, name, nn.ModuleList(kept))
            if kept:
                tap = kept[-1]
    for name in _OUTPUT_LAYERS:  # never reached: the forward stops at the tap
        if isinstance(getattr(denoiser, name, None), nn.Module):
            setattr(denoiser, name, nn.Identity())
    return tap


def _as_feature_map(output, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A block's output as (B, C, h, w): conv maps pass through; (B, N, D) image tokens are laid
    out on their patch grid; tuples (joint blocks return (text, image)) give their last element."""
    if isinstance(output, (tuple, list)):
        output = output[-1]
    if output.ndim == 4:
        return output
    if output.ndim != 3:
        raise DRMError(f"DRM backbone features have unexpected shape {tuple(output.shape)}")
    b, n, d = output.shape
    h, w = latent_hw
    for patch in (1, 2, 4, 8, 16):
        if h % patch == 0 and w % patch == 0 and (h // patch) * (w // patch) == n:
            return output.transpose(1, 2).reshape(b, d, h // patch, w // patch)
    raise DRMError(f"DRM backbone: {n} tokens do not form the patch grid of a {h}x{w} latent")


# ---- the model --------------------------------------------------------------------------------
class DiffusionRewardModel(nn.Module):
    """Scores noisy latents: ``score_latents(latents (B, *latent), t (B,), prompts) -> (B,)``.

    Build one from a base checkpoint with :meth:`from_base`, load a trained one with :meth:`load`.
    ``adapter`` is the DRM's own copy of the base model (its text encoders encode the prompts;
    its denoiser, cut, is the backbone — trained or frozen, independently of any policy).
    """

    def __init__(self, adapter: ModelAdapter, *, base_model: str, drop_last_blocks: int = 1, head_width: int = 128,
                 resolution: int = 0, pretrained: bool = True):
        super().__init__()
        self.adapter = adapter
        self.base_model = base_model
        self.drop_last_blocks = drop_last_blocks
        self.head_width = head_width
        self.resolution = resolution or adapter.default_resolution
        self.pretrained = pretrained
        self.info: dict = {}  # drm.json of a loaded model (training results)
        self.backbone = adapter.denoiser
        # the hook handle, not the block: the block is already a submodule of the backbone
        self._hook_handle = cut_backbone(self.backbone, drop_last_blocks).register_forward_hook(self._hook)
        self._captured = None
        if not pretrained:  # ablation: the same architecture from random weights
            for module in self.backbone.modules():
                if hasattr(module, "reset_parameters") and module is not self.backbone:
                    module.reset_parameters()
        self.backbone.float()
        self._embed_cache: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            latent = adapter.latent_shape(self.resolution, self.resolution)
            probe = self.features(torch.zeros(1, *latent, device=adapter.device), torch.full((1,), 0.5 if adapter.prediction_type == "flow" else 500.0),
                                  self.embed([""]))
        self.feature_channels = probe.shape[1]
        self.head = DRMHead(self.feature_channels, head_width).to(adapter.device)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_base(cls, base_model: str, *, drop_last_blocks: int = 1, head_width: int = 128, resolution: int = 0,
                  pretrained: bool = True, family: str = "auto", device="cpu") -> "DiffusionRewardModel":
        adapter = load_adapter(base_model, family=family, device=device, dtype=torch.float32)
        return cls(adapter, base_model=base_model, drop_last_blocks=drop_last_blocks, head_width=head_width,
                   resolution=resolution, pretrained=pretrained)

    def drm_config(self) -> dict:
        return {
            "format": FORMAT, "version": 1, "base_model": self.base_model, "family": self.adapter.family,
            "prediction_type": self.adapter.prediction_type, "drop_last_blocks": self.drop_last_blocks,
            "head_width": self.head_width, "resolution": self.resolution, "pretrained": self.pretrained,
            "feature_channels": self.feature_channels, "backbone_class": type(self.backbone).__name__,
        }

    def save(self, path: str | os.PathLike, extra: Optional[dict] = None) -> Path:
        """Write ``drm.json`` (config + ``extra``, e.g. training results) and ``model.safetensors``."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps({**self.drm_config(), **(extra or {})}, indent=2))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, device="cpu") -> "DiffusionRewardModel":
        """A DRM saved by :meth:`save` (base model rebuilt from ``base_model``, then the weights)."""
        from safetensors.torch import load_file

        folder = Path(path)
        cfg_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not cfg_file.is_file() or not weights.is_file():
            raise DRMError(f"{str(folder)!r} is not a DRM folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}; train one with diffalign train-reward)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except ValueError as exc:
            raise DRMError(f"{str(cfg_file)!r} is not valid JSON: {exc}") from None
        if cfg.get("format") != FORMAT:
            raise DRMError(f"{str(cfg_file)!r} is not a diffalign DRM config (format {cfg.get('format')!r})")
        model = cls.from_base(cfg["base_model"], drop_last_blocks=cfg["drop_last_blocks"], head_width=cfg["head_width"],
                              resolution=cfg["resolution"], family=cfg.get("family", "auto"), device=device)
        missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
        if missing or unexpected:
            raise DRMError(f"{str(weights)!r} does not match the DRM built from {cfg['base_model']!r}: "
                           f"{len(missing)} missing, {len(unexpected)} unexpected tensors")
        model.info = cfg
        return model.eval().requires_grad_(False)

    # ---- forward ---------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    def _hook(self, module, args, output):
        self._captured = output
        raise _FeaturesReady

    def embed(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Text embeddings (no uncond: the DRM scores without guidance), cached per prompt."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._embed_cache]
        if missing:
            if len(self._embed_cache) + len(missing) > _EMBED_CACHE_SIZE:
                self._embed_cache.clear()
            enc = self.adapter.encode_prompts(missing, with_uncond=False)
            for i, p in enumerate(missing):
                self._embed_cache[p] = {k: v[i : i + 1] for k, v in enc.cond.items()}
        keys = self._embed_cache[prompts[0]].keys()
        return PromptEmbeds({k: torch.cat([self._embed_cache[p][k] for p in prompts]) for k in keys})

    def features(self, latents: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """(B, C, h, w) output of the last kept block at ``(latents, t)``."""
        self._captured = None
        try:
            self.adapter.predict(latents, t.to(latents.device), embeds, 1.0)
        except _FeaturesReady:
            pass
        if self._captured is None:
            raise DRMError("DRM backbone: the feature block did not run")
        out, self._captured = self._captured, None
        return _as_feature_map(out, tuple(latents.shape[-2:]))

    def forward(self, latents: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        return self.head(self.features(latents, t, embeds))

    def score_latents(self, latents: torch.Tensor, t, prompts: Sequence[str], *, batch_size: int = 0) -> torch.Tensor:
        """Scores (B,) fp32 of latents ``(B, *latent)`` at model times ``t`` (number or (B,)).

        Differentiable when called with grad enabled (training); ``batch_size`` > 0 chunks the
        batch (inference)."""
        prompts = list(prompts)
        if len(prompts) != latents.shape[0]:
            raise DRMError(f"DRM: got {len(prompts)} prompts for {latents.shape[0]} latents")
        latents = latents.to(self.device, torch.float32)
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device)
        t = t.expand(latents.shape[0]) if t.ndim == 0 else t
        if batch_size <= 0 or batch_size >= len(prompts):
            return self.forward(latents, t, self.embed(prompts))
        return torch.cat([self.forward(latents[s : s + batch_size], t[s : s + batch_size], self.embed(prompts[s : s + batch_size]))
                          for s in range(0, len(prompts), batch_size)])

    @torch.no_grad()
    def score_images(self, images: torch.Tensor, prompts: Sequence[str], *, t: float = 0.0, batch_size: int = 32) -> torch.Tensor:
        """Scores of clean images (B, 3, H, W) in [0, 1]: encoded to latents, scored at time ``t``."""
        size = self.resolution
        if images.shape[-1] != size or images.shape[-2] != size:
            images = torch.nn.functional.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out = []
        for s in range(0, len(images), batch_size):
            latents = encode_images(self.adapter, images[s : s + batch_size].clamp(0, 1))
            tt = model_time(self.adapter, torch.full((len(latents),), float(t)))
            out.append(self.score_latents(latents, tt, prompts[s : s + batch_size]).float().cpu())
        return torch.cat(out)


def check_compatible(drm, adapter: ModelAdapter, key: str = "reward.name") -> None:
    """A DRM scores latents of its base family only (same latent space and time convention)."""
    family = getattr(drm, "family", None)
    if family != adapter.family:
        raise ConfigError(f"config key '{key}': the DRM was built from a {family} model and cannot score {adapter.family} latents")

