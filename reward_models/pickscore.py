"""PickScore: a CLIP ViT-H/14 fine-tuned on Pick-a-Pic human preferences.

Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image
Generation". The model is a transformers ``CLIPModel`` (hub id ``yuvalkirstain/PickScore_v1``)
that ships without tokenizer or image processor; the authors pair it with the processor of the
CLIP it was fine-tuned from (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). The score is

    s(x, c) = exp(t) * cos(E_img(x), E_txt(c))

with ``t`` the model's learned ``logit_scale`` (exp(t) is about 100), exactly as in the authors'
inference snippet. It is CLIP score with a learned scale, so it reuses :class:`ClipScore`'s tensor
preprocessing, batching and prompt deduplication.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import register
from reward_models.clip_score import ClipScore
from reward_models.loading import first_line, hub_id_or_folder, parse_dtype

DEFAULT_PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # tokenizer + preprocessor_config.json


def learned_scale(model: torch.nn.Module) -> float:
    """``exp(t)`` of a CLIP model's ``logit_scale`` ``t``, read in fp32: bf16 would round
    exp(t) = 100 to 100 +- 0.4, so it is read before any cast of the model."""
    return float(model.logit_scale.detach().float().exp())


@register("pickscore")
class PickScore(ClipScore):
    """PickScore reward: ``exp(logit_scale) * cos`` from a CLIP model fine-tuned on preferences.

    Args:
        model: hub id or local folder of the PickScore ``CLIPModel`` weights.
        processor: hub id or local folder with the tokenizer and ``preprocessor_config.json``.
        device, dtype, batch_size: as in :class:`ClipScore`.
    """

    def __init__(
        self,
        model: str = DEFAULT_PICKSCORE_MODEL,
        processor: str = DEFAULT_PICKSCORE_PROCESSOR,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        torch_dtype = parse_dtype(dtype)
        clip_model, tokenizer, processor_config = self._load_pickscore(str(model), str(processor), torch_dtype)
        self._setup(clip_model, tokenizer, processor_config, device, torch_dtype, batch_size, learned_scale(clip_model), False)
        self.model_id = str(model)

    @classmethod
    def from_components(cls, model: torch.nn.Module, tokenizer: Any, *args, **kwargs) -> "PickScore":  # type: ignore[override]
        """Wrap an already-built ``CLIPModel`` as :meth:`ClipScore.from_components` does (its
        ``image_processor_config``, ``device``, ``dtype``, ``batch_size``); the scale is the model's
        ``exp(logit_scale)`` and there is no ``clip_negative``."""
        if len(args) > 4 or {"scale", "clip_negative"} & kwargs.keys():
            raise TypeError("PickScore.from_components: the scale is the model's own; no clip_negative")
        return super().from_components(model, tokenizer, *args, scale=learned_scale(model), **kwargs)

    @staticmethod
    def _load_pickscore(model: str, processor: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, dict | None]:
        model_path = hub_id_or_folder("pickscore", "model", model)
        processor_path = hub_id_or_folder("pickscore", "processor", processor)
        from transformers import AutoTokenizer, CLIPModel  # lazy: transformers takes seconds to import
        from transformers.image_processing_utils import ImageProcessingMixin

        try:
            clip_model = CLIPModel.from_pretrained(model_path, dtype=dtype)
        except Exception as exc:  # OSError (offline, missing files), ValueError (bad config), ...
            raise RewardError(f"pickscore: cannot load model {model!r}: {first_line(exc)}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(processor_path)
            processor_config, _ = ImageProcessingMixin.get_image_processor_dict(processor_path)
        except Exception as exc:
            raise RewardError(f"pickscore: cannot load processor {processor!r}: {first_line(exc)}") from None
        return clip_model, tokenizer, processor_config

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B,)`` scores; differentiable with respect to ``images``."""
        if len(prompts) != images.shape[0]:
            raise RewardError(f"pickscore: got {images.shape[0]} images but {len(prompts)} prompts")
        return super().score(images, prompts)
