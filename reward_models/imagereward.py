"""ImageReward: a BLIP image-text encoder with an MLP head, trained on ranked human choices.

Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation" (code THUDM/ImageReward). The model is BLIP's ViT-L/16 image encoder at 224 px and
BLIP's BERT-base text encoder ("med" config: BERT with cross-attention to the image tokens in
every layer). The prompt, tokenised to 35 tokens, attends to the image; the text encoder's
output at [CLS] feeds the 768 -> 1024 -> 128 -> 64 -> 16 -> 1 MLP (no activations, dropout
inactive at eval: the same head as the LAION aesthetic predictor), and the score is normalised
with the mean and standard deviation the authors measured on their data:

    r(x, c) = (MLP(T(c | V(x))[CLS]) - mu) / sigma,   mu = 0.1672, sigma = 1.0333

so ImageReward is about N(0, 1) over typical generations (above 0: preferred).

Weights: ``ImageReward.pt`` (a plain ``torch.save`` state dict) and ``med_config.json`` from the
hub repo ``THUDM/ImageReward``, a local folder holding both files, or a local checkpoint file
(``med_config.json`` beside it, or ``med_config=...``). The checkpoint keys are those of the
authors' ``ImageReward`` module (``blip.visual_encoder.*`` in timm's ViT layout,
``blip.text_encoder.*``, ``mlp.layers.*``); :func:`imagereward_key` maps each of them onto
transformers' ``BlipVisionModel`` / ``BlipTextModel``, which port the same BLIP modules. The
``image-reward`` package itself is not used: it pins old timm / fairscale releases.

Tokenizer: ``bert-base-uncased`` plus BLIP's two added tokens ([DEC], [ENC]), as BLIP's
``init_tokenizer`` builds it. Preprocessing on tensors: resize the shortest side to 224
(bicubic), centre crop with torchvision's ``CenterCrop`` offsets (``int(round(d / 2))``),
normalise with CLIP's mean / std (ImageReward's ``_transform``). The authors resize PIL images with
PIL's bicubic, so resized pixels are close to, not identical with, theirs; an image whose shortest
side is already 224 is preprocessed exactly as theirs.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
from torch import nn

from diffalign.errors import RewardError
from reward_models.aesthetic import AestheticMLP
from reward_models.base import check_images, register
from reward_models.clip_score import CLIP_MEAN, CLIP_STD, ClipImageTransform
from reward_models.loading import (check_batch_size, components_dtype, first_line, frozen, hub_id_or_folder,
                                   load_state_dict, parse_dtype, resolve_weights_file)

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
DEFAULT_TOKENIZER = "google-bert/bert-base-uncased"  # BLIP's init_tokenizer: 'bert-base-uncased'
BLIP_ADDED_TOKENS = ("[DEC]", "[ENC]")  # BLIP's bos and encoder tokens (med_config vocab_size 30524 = 30522 + 2)
REWARD_MEAN = 0.16717362830052426  # mu: the authors' mean of raw head outputs
REWARD_STD = 1.0333394966054072  # sigma: their standard deviation
MAX_PROMPT_TOKENS = 35  # ImageReward pads / truncates prompts to 35 tokens
# BLIP's create_vit('large', 224): ViT-L/16, 64-d heads, timm's LayerNorm eps 1e-6, exact GELU.
VIT_LARGE_16 = dict(image_size=224, patch_size=16, hidden_size=1024, intermediate_size=4096,
                    num_hidden_layers=24, num_attention_heads=16, layer_norm_eps=1e-6, hidden_act="gelu")

# timm ViT names (BLIP's models/vit.py) -> transformers' BlipVisionModel names.
_VIT_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VIT_BLOCK = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",  # fused q, k, v in the same (3, heads, head_dim) order
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
# In the checkpoint but not in the score: BLIP's contrastive projections (ImageReward reads the
# cross-attended [CLS] state, not the projected embeddings) and BERT's position-id buffer.
UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
UNUSED_KEYS = ("blip.text_encoder.embeddings.position_ids",)


def imagereward_key(key: str) -> str | None:
    """The :class:`ImageRewardModel` state-dict key for an ImageReward checkpoint key, or None for
    a weight the score does not use. Raises KeyError for a key of no known part."""
    if key in UNUSED_KEYS or key.startswith(UNUSED_PREFIXES):
        return None
    if key.startswith("blip.text_encoder."):
        return "text_encoder." + key.removeprefix("blip.text_encoder.")  # same names: both are BLIP's med.py
    if key.startswith("mlp.layers."):
        return key
    if key.startswith("blip.visual_encoder."):
        name = key.removeprefix("blip.visual_encoder.")
        if name in _VIT_TOP:
            return "vision_model." + _VIT_TOP[name]
        parts = name.split(".")  # blocks.{i}.{part}.{weight|bias}
        if len(parts) >= 4 and parts[0] == "blocks" and parts[1].isdigit():
            part, leaf = ".".join(parts[2:-1]), parts[-1]
            if part in _VIT_BLOCK:
                return f"vision_model.encoder.layers.{parts[1]}.{_VIT_BLOCK[part]}.{leaf}"
    raise KeyError(key)


def map_checkpoint(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """An ImageReward checkpoint's state dict renamed for :class:`ImageRewardModel`; unused
    weights dropped; keys of no known part are a RewardError naming the file."""
    mapped, unknown = {}, []
    for key, value in state.items():
        try:
            target = imagereward_key(key)
        except KeyError:
            unknown.append(key)
            continue
        if target is not None:
            mapped[target] = value
    if unknown:
        raise RewardError(f"imagereward: {path!r} has keys of no ImageReward part: {sorted(unknown)[:3]}")
    return mapped


class ImageRewardModel(nn.Module):
    """BLIP image encoder + cross-attending text encoder + MLP head -> normalised scores ``(B,)``.

    ``vision_model`` is a ``BlipVisionModel`` (BLIP's ViT), ``text_encoder`` a ``BlipTextModel``
    without pooler (BLIP's med BERT, cross-attention in every layer), ``mlp`` the reward head
    (kept in float32 whatever the encoders' dtype, as the authors apply it to ``.float()`` features).
    """

    def __init__(self, vision_config: Any, text_config: Any) -> None:
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel  # lazy: transformers takes seconds to import

        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = AestheticMLP(int(text_config.hidden_size))

    @property
    def image_size(self) -> int:
        return int(self.vision_model.config.image_size)

    def text_features(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> torch.Tensor:
        """Pixels ``(B, 3, s, s)`` and tokens ``(B, L)`` -> the text encoder's [CLS] state ``(B, H)``, float32."""
        image_embeds = self.vision_model(pixel_values=pixel_values).last_hidden_state  # (B, 1 + patches, D)
        image_mask = torch.ones(image_embeds.shape[:2], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                 encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
        return text.last_hidden_state[:, 0].float()

    def rewards_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """[CLS] features ``(B, H)`` -> normalised rewards ``(B,)``: ``(MLP(f) - mu) / sigma``."""
        return (self.mlp(features.float()).squeeze(-1) - REWARD_MEAN) / REWARD_STD

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.rewards_from_features(self.text_features(pixel_values, input_ids, attention_mask))


def blip_vision_config(vision_config: dict[str, Any] | None) -> Any:
    """``BlipVisionConfig`` of ViT-L/16 at 224 px, with the given fields replaced (smaller test models)."""
    from transformers import BlipVisionConfig

    fields = dict(VIT_LARGE_16)
    unknown = sorted(set(vision_config or {}) - set(fields))
    if unknown:
        raise RewardError(f"imagereward: unknown vision_config fields {unknown}; known: {sorted(fields)}")
    fields.update(vision_config or {})
    return BlipVisionConfig(**fields)


def blip_text_config(med_config_path: str, encoder_width: int) -> Any:
    """``BlipTextConfig`` from a BLIP ``med_config.json`` (a BERT config plus ``add_cross_attention``);
    the cross-attention width is the image encoder's (BLIP sets ``encoder_width = vision_width``)."""
    from transformers import BlipTextConfig

    try:
        with open(med_config_path) as f:
            med = json.load(f)
    except (OSError, ValueError) as exc:
        raise RewardError(f"imagereward: cannot read med_config {med_config_path!r}: {first_line(exc)}") from None
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings")
    missing = [k for k in required if not isinstance(med.get(k) if isinstance(med, dict) else None, int)]
    if missing:
        raise RewardError(f"imagereward: med_config {med_config_path!r} lacks integer fields {missing}")
    if not med.get("add_cross_attention", False):
        raise RewardError(f"imagereward: med_config {med_config_path!r} has no cross-attention (add_cross_attention)")
    if med.get("position_embedding_type", "absolute") != "absolute":
        raise RewardError(f"imagereward: med_config {med_config_path!r}: only absolute position embeddings are supported")
    return BlipTextConfig(
        **{k: med[k] for k in required},
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        hidden_dropout_prob=med.get("hidden_dropout_prob", 0.1),
        attention_probs_dropout_prob=med.get("attention_probs_dropout_prob", 0.1),
        pad_token_id=med.get("pad_token_id", 0),
        encoder_hidden_size=encoder_width,
        is_decoder=True,  # BlipTextLayer builds its cross-attention only for decoder configs; masks stay bidirectional
        bos_token_id=None, eos_token_id=None, sep_token_id=None,
    )


def imagereward_files(checkpoint: str, med_config: str | None) -> tuple[str, str]:
    """Local paths of (``ImageReward.pt``, ``med_config.json``) for a hub repo id, a folder holding
    both, or a checkpoint file (``med_config.json`` beside it unless ``med_config`` names one)."""
    expanded = os.path.expanduser(checkpoint)
    hub = False
    if os.path.isdir(expanded):
        weights = os.path.join(expanded, IMAGEREWARD_FILE)
        if not os.path.isfile(weights):
            raise RewardError(f"imagereward: folder {checkpoint!r} has no {IMAGEREWARD_FILE}")
    else:
        weights = resolve_weights_file("imagereward", checkpoint, IMAGEREWARD_FILE)
        hub = not os.path.isfile(expanded)
    if med_config is not None:
        return weights, resolve_weights_file("imagereward", str(med_config), MED_CONFIG_FILE, what="med_config file")
    if hub:
        return weights, resolve_weights_file("imagereward", checkpoint, MED_CONFIG_FILE, what="med_config file")
    beside = os.path.join(os.path.dirname(weights), MED_CONFIG_FILE)
    if not os.path.isfile(beside):
        raise RewardError(f"imagereward: no {MED_CONFIG_FILE} beside {weights!r}; pass med_config=PATH")
    return weights, beside


def load_imagereward_model(checkpoint: str = IMAGEREWARD_REPO, med_config: str | None = None,
                           vision_config: dict[str, Any] | None = None) -> ImageRewardModel:
    """Build :class:`ImageRewardModel` (float32, CPU, eval mode) and load an ImageReward checkpoint into it;
    every used weight must be present and every checkpoint key accounted for."""
    weights, med_path = imagereward_files(str(checkpoint), med_config)
    vision = blip_vision_config(vision_config)
    model = ImageRewardModel(vision, blip_text_config(med_path, int(vision.hidden_size)))
    state = map_checkpoint(load_state_dict("imagereward", weights), weights)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes of another architecture (e.g. vision_config not matching)
        message = " ".join(str(exc).split())
        raise RewardError(f"imagereward: {weights!r} does not fit the model: {message[:300]}") from None
    if result.missing_keys or result.unexpected_keys:
        raise RewardError(f"imagereward: {weights!r} lacks weights {sorted(result.missing_keys)[:3]}"
                          f" / has unplaced weights {sorted(result.unexpected_keys)[:3]}")
    return model.eval()


def load_blip_tokenizer(tokenizer: str) -> Any:
    """BERT tokenizer with BLIP's [DEC] (bos) and [ENC] tokens added, as BLIP's ``init_tokenizer``."""
    path = hub_id_or_folder("imagereward", "tokenizer", tokenizer)
    from transformers import BertTokenizer  # lazy

    try:
        bert = BertTokenizer.from_pretrained(path)
    except Exception as exc:  # offline, missing vocab, ...
        raise RewardError(f"imagereward: cannot load tokenizer {tokenizer!r}: {first_line(exc)}") from None
    dec, enc = BLIP_ADDED_TOKENS
    bert.add_special_tokens({"bos_token": dec})
    bert.add_tokens([enc], special_tokens=True)
    return bert


@register("imagereward")
class ImageReward:
    """ImageReward reward (about N(0, 1); see the module docstring).

    Args:
        checkpoint: hub repo id holding ``ImageReward.pt`` and ``med_config.json``, a local folder
            with both, or a local checkpoint file.
        med_config: a local ``med_config.json`` (default: the repo's, or the one beside the file).
        tokenizer: hub id or local folder of the BERT tokenizer.
        vision_config: fields replacing ViT-L/16's (``image_size``, ``hidden_size``, ...), for
            checkpoints of another BLIP size; None for ImageReward-v1.0.
        device: where the model runs.
        dtype: the encoders' dtype; the head runs in float32 and scores are float32.
        batch_size: (image, prompt) pairs per forward pass.
    """

    def __init__(
        self,
        checkpoint: str = IMAGEREWARD_REPO,
        med_config: str | None = None,
        tokenizer: str = DEFAULT_TOKENIZER,
        vision_config: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        torch_dtype = parse_dtype(dtype)
        check_batch_size("imagereward", batch_size)
        model = load_imagereward_model(str(checkpoint), med_config, vision_config)
        self._setup(model, load_blip_tokenizer(str(tokenizer)), device, torch_dtype, batch_size)
        self.model_id = str(checkpoint)

    @classmethod
    def from_components(cls, model: ImageRewardModel, tokenizer: Any, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, batch_size: int = 32) -> "ImageReward":
        """Wrap a built :class:`ImageRewardModel` and tokenizer (moved and frozen in place);
        ``dtype=None`` keeps the model's dtype."""
        self = cls.__new__(cls)
        check_batch_size("imagereward", batch_size)
        self._setup(model, tokenizer, device, components_dtype(model.vision_model, dtype), batch_size)
        self.model_id = type(model).__name__
        return self

    def _setup(self, model: ImageRewardModel, tokenizer: Any, device: Any, dtype: torch.dtype, batch_size: int) -> None:
        vocab = int(model.text_encoder.config.vocab_size)
        if len(tokenizer) > vocab:
            raise RewardError(f"imagereward: the tokenizer has {len(tokenizer)} tokens but the text encoder {vocab}")
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.model = frozen(model, self.device, dtype)
        self.model.mlp.float()  # the head stays float32
        self.tokenizer = tokenizer
        size = model.image_size
        # BLIP's transform: Resize(size, bicubic) then torchvision's CenterCrop(size)
        self.transform = ClipImageTransform(resize=size, crop=(size, size), mean=CLIP_MEAN, std=CLIP_STD,
                                            crop_offsets="torchvision")
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] -> pixel values ``(B, 3, s, s)`` on the model's device and dtype."""
        check_images(images)
        return self.transform(images.to(self.device)).to(self.dtype)

    def tokenize(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Prompts -> ``input_ids`` / ``attention_mask`` ``(B, 35)`` as ImageReward pads them."""
        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                                max_length=MAX_PROMPT_TOKENS, return_tensors="pt")
        return {"input_ids": tokens["input_ids"].to(self.device), "attention_mask": tokens["attention_mask"].to(self.device)}

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B,)`` scores on the images' device; differentiable with respect to ``images``."""
        if len(prompts) != images.shape[0]:
            raise RewardError(f"imagereward: got {images.shape[0]} images but {len(prompts)} prompts")
        if images.shape[0] == 0:
            return torch.zeros(0, device=images.device)
        pixels = self.preprocess(images)
        tokens = self.tokenize(prompts)
        chunks = []
        for start in range(0, images.shape[0], self.batch_size):
            part = slice(start, start + self.batch_size)
            chunks.append(self.model(pixels[part], tokens["input_ids"][part], tokens["attention_mask"][part]))
        return torch.cat(chunks).to(images.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        return self.score(images, prompts)
