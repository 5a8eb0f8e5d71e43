"""LAION aesthetic predictor v2: a linear-ish MLP on CLIP ViT-L/14 image embeddings.

From christophschuhmann/improved-aesthetic-predictor (the "sac+logos+ava1-l14-linearMSE" head,
trained with MSE on SAC + LAION-Logos + AVA ratings, on a 1-10 scale). The reward is

    a(x) = MLP(E_img(x) / ||E_img(x)||)

with ``E_img`` the projected image embedding of OpenAI's CLIP ViT-L/14 (768-d; transformers'
``openai/clip-vit-large-patch14`` holds the same weights as the ``clip`` package the head was
trained on) and the MLP 768 -> 1024 -> 128 -> 64 -> 16 -> 1 *without activations* (the original's
ReLUs are commented out; its dropouts are inactive at eval), so the head is an affine map in
effect; it is kept layer by layer so the checkpoint's keys load unchanged.

Head weights: a local ``.pth`` / ``.safetensors`` file, or ``sac+logos+ava1-l14-linearMSE.pth``
from the hub repo ``camenduru/improved-aesthetic-predictor`` (a mirror of the GitHub repository's
file, the one DDPO and many others download; the GitHub file itself is not on the hub).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from diffalign.errors import RewardError
from reward_models.base import check_images, register
from reward_models.clip_score import ClipImageTransform
from reward_models.loading import (check_batch_size, components_dtype, first_line, frozen, hub_id_or_folder, load_state_dict,
                                   parse_dtype, pooled_output, processor_config_or_none, resolve_weights_file)

DEFAULT_AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
DEFAULT_AESTHETIC_HEAD_REPO = "camenduru/improved-aesthetic-predictor"
DEFAULT_AESTHETIC_HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
HEAD_WIDTHS = (1024, 128, 64, 16)  # hidden widths of improved-aesthetic-predictor's MLP


class AestheticMLP(nn.Module):
    """improved-aesthetic-predictor's ``MLP``; state-dict keys ``layers.{0,2,4,6,7}.{weight,bias}``."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        w1, w2, w3, w4 = HEAD_WIDTHS
        self.layers = nn.Sequential(
            nn.Linear(input_size, w1),
            nn.Dropout(0.2),
            nn.Linear(w1, w2),
            nn.Dropout(0.2),
            nn.Linear(w2, w3),
            nn.Dropout(0.1),
            nn.Linear(w3, w4),
            nn.Linear(w4, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` unit-norm embeddings -> ``(B, 1)`` ratings."""
        return self.layers(embeddings)


def load_aesthetic_head(source: str, filename: str = DEFAULT_AESTHETIC_HEAD_FILE) -> AestheticMLP:
    """Build the head from a local file or ``filename`` in hub repo ``source``; the input size is
    read from the checkpoint. Keys with or without the ``layers.`` prefix are accepted."""
    path = resolve_weights_file("aesthetic", source, filename)
    state = load_state_dict("aesthetic", path)
    state = {k if k.startswith("layers.") else f"layers.{k}": v for k, v in state.items()}
    first = state.get("layers.0.weight")
    if first is None or first.ndim != 2:
        raise RewardError(f"aesthetic: {path!r} is not an aesthetic-predictor head (no layers.0.weight)")
    head = AestheticMLP(int(first.shape[1]))
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:  # missing / unexpected keys or shapes of another architecture
        raise RewardError(f"aesthetic: {path!r} does not fit the 1024-128-64-16-1 head: {first_line(exc)}") from None
    return head


@register("aesthetic")
class AestheticScore:
    """LAION aesthetic predictor v2 reward (about 1-10; see the module docstring).

    Args:
        clip_model: hub id or local folder of a CLIP model (only its vision tower and projection
            are loaded) with, optionally, its ``preprocessor_config.json``.
        head: a local head weights file, or a hub repo id holding ``head_filename``.
        head_filename: file name inside the ``head`` repo.
        device: where both models run.
        dtype: CLIP weights' dtype; the head stays float32 (it is tiny) and scores are float32.
        batch_size: images per CLIP forward pass.
    """

    differentiable = True  # score() keeps the graph to the images (DRaFT / ReFL); see reward_models.base

    def __init__(
        self,
        clip_model: str = DEFAULT_AESTHETIC_CLIP,
        head: str = DEFAULT_AESTHETIC_HEAD_REPO,
        head_filename: str = DEFAULT_AESTHETIC_HEAD_FILE,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        torch_dtype = parse_dtype(dtype)
        mlp = load_aesthetic_head(str(head), head_filename)
        vision, processor_config = self._load_vision(str(clip_model), torch_dtype)
        self._setup(vision, mlp, processor_config, device, torch_dtype, batch_size)
        self.model_id = str(clip_model)

    @classmethod
    def from_components(
        cls,
        clip_model: torch.nn.Module,
        head: nn.Module,
        image_processor_config: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> "AestheticScore":
        """Wrap a built ``CLIPModel`` or ``CLIPVisionModelWithProjection`` and head (moved and frozen
        in place). ``dtype=None`` keeps the CLIP model's dtype."""
        self = cls.__new__(cls)
        self._setup(clip_model, head, image_processor_config, device, components_dtype(clip_model, dtype), batch_size)
        self.model_id = type(clip_model).__name__
        return self

    @staticmethod
    def _load_vision(model: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any] | None]:
        path = hub_id_or_folder("aesthetic", "CLIP model", model)
        from transformers import AutoConfig, CLIPVisionModelWithProjection  # lazy: transformers is slow to import
        from transformers.utils import logging as hf_logging

        try:
            config = AutoConfig.from_pretrained(path)
            # Only the vision tower and projection are read out of the full CLIPModel checkpoint (the
            # text tower is a third of ViT-L/14). The projection width lives in the top-level config;
            # the vision config's own default (512) would silently re-initialise a wrong-sized projection.
            if hasattr(config, "vision_config"):
                vision_config = config.vision_config
                vision_config.projection_dim = config.projection_dim
            else:
                vision_config = config
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the unused text-tower keys are expected: no 60-line table
            try:
                vision, info = CLIPVisionModelWithProjection.from_pretrained(
                    path, config=vision_config, dtype=dtype, output_loading_info=True
                )
            finally:
                hf_logging.set_verbosity(verbosity)
        except Exception as exc:  # OSError (offline, missing files), ValueError (bad config), ...
            raise RewardError(f"aesthetic: cannot load CLIP model {model!r}: {first_line(exc)}") from None
        broken = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
        if broken:
            raise RewardError(f"aesthetic: CLIP model {model!r} lacks or mis-sizes weights {broken[:3]}")
        return vision, processor_config_or_none(path)

    def _setup(
        self,
        clip_model: torch.nn.Module,
        head: nn.Module,
        processor_config: dict[str, Any] | None,
        device: str | torch.device | None,
        dtype: torch.dtype,
        batch_size: int,
    ) -> None:
        check_batch_size("aesthetic", batch_size)
        config = clip_model.config  # CLIPConfig (full model) or CLIPVisionConfig (vision tower only)
        embed_dim = getattr(config, "projection_dim", None)
        head_in = next((m.in_features for m in head.modules() if isinstance(m, nn.Linear)), None)
        if embed_dim is not None and head_in is not None and int(embed_dim) != head_in:
            raise RewardError(
                f"aesthetic: the head takes {head_in}-d embeddings but the CLIP model gives {embed_dim}-d"
            )
        image_size = int(getattr(config, "vision_config", config).image_size)
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.model = frozen(clip_model, self.device, dtype)
        self.head = frozen(head, self.device, torch.float32)
        self.transform = ClipImageTransform.from_processor_config(processor_config, image_size)
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] -> pixel values ``(B, 3, h, w)`` on the model's device and dtype."""
        check_images(images)
        return self.transform(images.to(self.device)).to(self.dtype)

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if hasattr(self.model, "get_image_features"):  # a full CLIPModel
            return pooled_output(self.model.get_image_features(pixel_values=pixel_values))
        return self.model(pixel_values=pixel_values).image_embeds  # CLIPVisionModelWithProjection

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels ``(B, 3, h, w)`` -> unit-norm float32 embeddings ``(B, D)``."""
        chunks = [self._embed(chunk) for chunk in pixel_values.split(self.batch_size)]
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    def score(self, images: torch.Tensor, prompts: Sequence[str] | None = None) -> torch.Tensor:
        """float32 ``(B,)`` ratings on the images' device; differentiable with respect to ``images``.
        Prompts are ignored (the predictor looks at the image only)."""
        if images.shape[0] == 0:
            return torch.zeros(0, device=images.device)
        embeddings = self.image_embeddings(self.preprocess(images))
        return self.head(embeddings).squeeze(-1).to(images.device)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        with torch.set_grad_enabled(images.requires_grad and torch.is_grad_enabled()):  # a graph only when trained through
            return self.score(images, prompts)
