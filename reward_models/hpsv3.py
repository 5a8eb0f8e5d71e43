"""HPSv3: a Qwen2-VL-7B preference model with an uncertainty-aware reward head.

Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score" (code MizzenAI/HPSv3).
The image and an instruction holding the prompt go through Qwen2-VL-7B-Instruct as one chat turn
that ends with a special ``<|Reward|>`` token; the last hidden state at that token feeds an MLP
(3584 -> 1024 -> 16 -> 2, ReLU; the authors' "ranknet" head) that predicts ``(mu, log sigma)`` of
a Gaussian preference score. It was trained with the uncertainty-aware ranking loss
(``P(a > b) = E[sigmoid(z)]``, ``z ~ N(mu_a - mu_b, sigma_a^2 + sigma_b^2)``), and the authors'
inference takes ``mu`` as the score:

    r(x, c) = mu(x, c)          (about 0-15 for typical generations; higher is preferred)

Weights: ``HPSv3.safetensors`` from the hub repo ``MizzenAI/HPSv3`` (or a local copy): the full
state dict of the authors' ``Qwen2VLRewardModelBT``, whose vocabulary was grown by one row for
``<|Reward|>``. The architecture, tokenizer, chat template and image processor settings come from
the base model ``Qwen/Qwen2-VL-7B-Instruct`` (hub id or local folder). :func:`hpsv3_key` maps the
checkpoint keys (transformers' Qwen2-VL layout before 4.52, ``visual.*`` / ``model.*``, or after,
``model.visual.*`` / ``model.language_model.*``) onto transformers' ``Qwen2VLModel`` and the head;
``lm_head`` is not needed (the reward reads hidden states, not next-token logits). The ``hpsv3``
package is not used: it pulls deepspeed, trl, torchvision and opencv.

Rotary positions are the authors': sequential for every token, not Qwen2-VL's 3D image positions
(see :func:`sequential_positions`).

Preprocessing on tensors, differentiable: every image is resized (bicubic, antialiased) to the
size Qwen2-VL's ``smart_resize`` gives with ``min_pixels = max_pixels = 256 * 28 * 28`` (448 x 448
for a square image: 256 visual tokens after the 2 x 2 merge), normalised with the processor's mean
/ std, repeated over the 2 temporal slots and cut into the processor's patch rows. The authors
resize PIL images with PIL's bicubic, so pixels are close to, not identical with, theirs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from diffalign.errors import RewardError
from reward_models.base import check_images, register
from reward_models.clip_score import CLIP_MEAN, CLIP_STD
from reward_models.loading import (check_batch_size, first_line, frozen, hub_id_or_folder, parse_dtype,
                                   processor_config_or_none, resolve_weights_file)

HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"  # architecture, tokenizer, chat template, image processor
REWARD_TOKEN = "<|Reward|>"
HPSV3_PIXELS = 256 * 28 * 28  # the authors' min_pixels = max_pixels: ~448 x 448, 256 visual tokens
MAX_ASPECT_RATIO = 200  # Qwen2-VL's smart_resize refuses longer images
HEAD_WIDTHS = (1024, 16)  # hidden widths of the "ranknet" head (rm_head_kwargs=None)
HEAD_OUTPUTS = 2  # (mu, log sigma)

# The authors' instruction (hpsv3/dataset/data_collator_qwen.py, trailing spaces included: the
# model was trained on exactly these tokens) and the suffix that ends with the reward token.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a "
    "overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst "
    "and 10 being the best. \n\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense "
    "of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or "
    "adult material. If such content is present, the image quality and satisfaction score should be the lowest "
    "possible. \n\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) "
    "align with the textual description. The subject should match the description in terms of number, "
    "appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well "
    "the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image "
    "logically fit the scenario described in the prompt. The environment should support and enhance the subject "
    "without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, "
    "accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be "
    "acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the "
    "image. The generated content should not introduce elements that conflict with or distort the original "
    "description.\n"
    "Textual prompt - {text_prompt}\n\n\n"
)
REWARD_SUFFIX = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
# Qwen2-VL-Instruct's chat template for one user turn (image, then text) with the generation prompt,
# used when the tokenizer carries no template.
QWEN2VL_TURN = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n")
IMAGE_TOKEN = "<|image_pad|>"


def hpsv3_text(prompt: str) -> str:
    """The user text HPSv3 scores a prompt with: instruction + ``<|Reward|>`` suffix."""
    return INSTRUCTION.format(text_prompt=prompt) + REWARD_SUFFIX


def hpsv3_key(key: str) -> str | None:
    """The :class:`HPSv3Model` state-dict key for an HPSv3 checkpoint key (``backbone.*`` for
    ``Qwen2VLModel``, ``rm_head.*`` for the head), None for ``lm_head``; KeyError otherwise."""
    if key.startswith("rm_head."):
        return key
    if key.startswith("lm_head."):
        return None  # next-token logits: not part of the score
    if key.startswith(("model.visual.", "model.language_model.")):  # transformers >= 4.52 layout
        return "backbone." + key.removeprefix("model.")
    if key.startswith("visual."):  # transformers < 4.52: vision tower at the top level
        return "backbone." + key
    if key.startswith("model."):  # ... and the language model under model.*
        return "backbone.language_model." + key.removeprefix("model.")
    raise KeyError(key)


def ranknet_head(hidden_size: int) -> nn.Sequential:
    """The authors' default "ranknet" ``rm_head`` (keys ``0``, ``3``, ``5``; dropout off at eval)."""
    wide, narrow = HEAD_WIDTHS
    return nn.Sequential(nn.Linear(hidden_size, wide), nn.ReLU(), nn.Dropout(0.05),
                         nn.Linear(wide, narrow), nn.ReLU(), nn.Linear(narrow, HEAD_OUTPUTS))


def sequential_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Rotary positions ``(3, B, L)`` = ``0 .. L-1`` in each of M-RoPE's three sections.

    The authors' ``Qwen2VLRewardModelBT.forward`` merges the image features into the token
    embeddings itself and calls the language model with ``inputs_embeds`` and ``position_ids=None``;
    under their pinned transformers (4.45.2) that gives every token, image placeholders included, its
    plain index in the sequence, expanded over the temporal / height / width sections. It never runs
    Qwen2-VL's 3D image positions, which transformers 5's ``Qwen2VLModel`` computes from the image
    grid when given no positions: on a small random model those move scores by about 0.1. Padding is on the right,
    so a real token's index is its position.
    """
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device)
    return positions.view(1, 1, length).expand(3, batch, length)


class HPSv3Model(nn.Module):
    """Qwen2-VL backbone (``Qwen2VLModel``, no LM head) + float32 reward head."""

    def __init__(self, backbone: nn.Module, reward_token_id: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.rm_head = ranknet_head(int(backbone.config.text_config.hidden_size))
        self.reward_token_id = int(reward_token_id)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor,
                image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, L)`` (one ``<|Reward|>`` each), patch rows and grids -> ``(B, 2)`` float32
        ``(mu, log sigma)``."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                               image_grid_thw=image_grid_thw, position_ids=sequential_positions(input_ids),
                               use_cache=False).last_hidden_state  # (B, L, H)
        rows, cols = (input_ids == self.reward_token_id).nonzero(as_tuple=True)
        if rows.numel() != input_ids.shape[0] or not torch.equal(rows, torch.arange(len(rows), device=rows.device)):
            raise RewardError(f"hpsv3: every sequence needs exactly one {REWARD_TOKEN} token")
        return self.rm_head(hidden[rows, cols].float())


@dataclass(frozen=True)
class Qwen2VLPatches:
    """Tensor version of Qwen2-VL's image processor at a fixed pixel budget: ``(B, 3, H, W)`` in
    [0, 1] -> patch rows ``(B * t * h * w, 3 * T * P * P)`` and grids ``(B, 3)`` = ``(t, h, w)``."""

    patch_size: int = 14  # P
    merge_size: int = 2  # 2 x 2 patches become one language-model token
    temporal_patch_size: int = 2  # T: an image fills both temporal slots
    min_pixels: int = HPSV3_PIXELS
    max_pixels: int = HPSV3_PIXELS
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """Qwen2-VL's ``smart_resize``: sides multiples of ``P * merge``, area within the pixel budget."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise RewardError(f"hpsv3: image aspect ratio above {MAX_ASPECT_RATIO} ({height} x {width})")
        h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = images.float()
        b, c = x.shape[:2]
        h, w = self.target_size(x.shape[-2], x.shape[-1])
        if (h, w) != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.unsqueeze(1).expand(b, t, c, h, w)  # (B, T, C, H, W): one grid step in time
        x = x.reshape(b, 1, t, c, gh // m, m, p, gw // m, m, p)
        # -> (B, t, h/m, w/m, m, m, C, T, P, P): merge groups of 2 x 2 patches stay adjacent, as the processor orders them
        x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        rows = x.reshape(b * gh * gw, c * t * p * p)
        grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long, device=images.device)
        return rows, grid


def resolve_checkpoint(checkpoint: str) -> str:
    """Local path of ``HPSv3.safetensors``: a file, a folder holding it, or a hub repo id."""
    expanded = os.path.expanduser(checkpoint)
    if os.path.isdir(expanded):
        path = os.path.join(expanded, HPSV3_FILE)
        if not os.path.isfile(path):
            raise RewardError(f"hpsv3: folder {checkpoint!r} has no {HPSV3_FILE}")
        return path
    return resolve_weights_file("hpsv3", checkpoint, HPSV3_FILE)


def load_tokenizer(base: str) -> Any:
    """The base model's tokenizer (right padding) with ``<|Reward|>`` added as one special token."""
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    try:
        tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    except Exception as exc:
        raise RewardError(f"hpsv3: cannot load the tokenizer of {base!r}: {first_line(exc)}") from None
    if REWARD_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)  # appended: id = old vocabulary size
    return tokenizer


def load_hpsv3_model(checkpoint: str, base: str, dtype: torch.dtype, reward_token_id: int,
                     tokenizer_size: int) -> HPSv3Model:
    """Build the base architecture with the checkpoint's vocabulary and load every weight into it."""
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen2VLModel  # lazy
    from transformers.utils import logging as hf_logging

    path = resolve_checkpoint(checkpoint)
    try:
        config = AutoConfig.from_pretrained(base)
    except Exception as exc:
        raise RewardError(f"hpsv3: cannot load the config of {base!r}: {first_line(exc)}") from None
    backbone_state, head_state, unknown = {}, {}, []
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                try:
                    target = hpsv3_key(key)
                except KeyError:
                    unknown.append(key)
                    continue
                if target is not None:
                    part, _, name = target.partition(".")
                    (backbone_state if part == "backbone" else head_state)[name] = f.get_tensor(key)
    except Exception as exc:  # not a safetensors file, truncated, ...
        raise RewardError(f"hpsv3: cannot read weights file {path!r}: {first_line(exc)}") from None
    if unknown:
        raise RewardError(f"hpsv3: {path!r} has keys of no HPSv3 part: {sorted(unknown)[:3]}")
    embed = backbone_state.get("language_model.embed_tokens.weight")
    if embed is None:
        raise RewardError(f"hpsv3: {path!r} has no token embeddings (model.embed_tokens.weight)")
    if embed.shape[0] != tokenizer_size:  # the authors resize the embeddings to the tokenizer with <|Reward|>
        raise RewardError(f"hpsv3: {path!r} embeds {embed.shape[0]} tokens but the tokenizer of {base!r} with "
                          f"{REWARD_TOKEN} has {tokenizer_size}")
    text_config = getattr(config, "text_config", config)
    text_config.vocab_size = int(embed.shape[0])
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a mismatch is reported below in one line, not as a table
    try:
        backbone, info = Qwen2VLModel.from_pretrained(None, config=config, state_dict=backbone_state, dtype=dtype,
                                                      attn_implementation="sdpa", output_loading_info=True)
    except Exception as exc:  # shapes of another architecture
        raise RewardError(f"hpsv3: {path!r} does not fit {base!r}: {first_line(exc)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    broken = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"]) + sorted(info["unexpected_keys"])
    if broken:
        raise RewardError(f"hpsv3: {path!r} does not fit {base!r}: {broken[:3]}")
    model = HPSv3Model(backbone, reward_token_id)
    try:
        model.rm_head.load_state_dict({k.removeprefix("rm_head."): v for k, v in head_state.items()})
    except RuntimeError as exc:
        raise RewardError(f"hpsv3: {path!r} has no ranknet head: {' '.join(str(exc).split())[:200]}") from None
    return model.eval()


@register("hpsv3")
class HPSv3:
    """HPSv3 reward: ``mu`` of the preference head (see the module docstring).

    Args:
        checkpoint: hub repo id holding ``HPSv3.safetensors``, a local folder with it, or the file.
        base: hub id or local folder of Qwen2-VL-7B-Instruct (config, tokenizer, chat template,
            ``preprocessor_config.json``); no weights are read from it.
        device: where the model runs.
        dtype: the backbone's dtype (the authors run bfloat16); the head runs in float32.
        batch_size: (image, prompt) pairs per forward pass.
    """

    def __init__(
        self,
        checkpoint: str = HPSV3_REPO,
        base: str = HPSV3_BASE,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 4,
    ) -> None:
        torch_dtype = parse_dtype(dtype)
        check_batch_size("hpsv3", batch_size)
        base_path = hub_id_or_folder("hpsv3", "base model", str(base))
        tokenizer = load_tokenizer(base_path)
        reward_id = int(tokenizer.convert_tokens_to_ids(REWARD_TOKEN))
        model = load_hpsv3_model(str(checkpoint), base_path, torch_dtype, reward_id, len(tokenizer))
        self._setup(model, tokenizer, processor_config_or_none(base_path), device, torch_dtype, batch_size)
        self.model_id = str(checkpoint)

    @classmethod
    def from_components(cls, model: HPSv3Model, tokenizer: Any, image_processor_config: dict[str, Any] | None = None,
                        device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                        batch_size: int = 4) -> "HPSv3":
        """Wrap a built :class:`HPSv3Model` and its tokenizer (moved and frozen in place);
        ``dtype=None`` keeps the backbone's dtype."""
        self = cls.__new__(cls)
        check_batch_size("hpsv3", batch_size)
        dtype_ = parse_dtype(dtype) if dtype is not None else next(model.backbone.parameters()).dtype
        self._setup(model, tokenizer, image_processor_config, device, dtype_, batch_size)
        self.model_id = type(model).__name__
        return self

    def _setup(self, model: HPSv3Model, tokenizer: Any, processor_config: dict[str, Any] | None, device: Any,
               dtype: torch.dtype, batch_size: int) -> None:
        vision = model.backbone.config.vision_config
        config = processor_config or {}
        self.patches = Qwen2VLPatches(
            patch_size=int(vision.patch_size), merge_size=int(vision.spatial_merge_size),
            temporal_patch_size=int(vision.temporal_patch_size),
            mean=tuple(float(v) for v in config.get("image_mean", CLIP_MEAN)),  # type: ignore[arg-type]
            std=tuple(float(v) for v in config.get("image_std", CLIP_STD)),  # type: ignore[arg-type]
        )
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.model = frozen(model, self.device, dtype)
        self.model.rm_head.float()  # the authors keep the head in float32
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    def chat_text(self, prompt: str, image_tokens: int) -> str:
        """The full model input text for one prompt, with ``image_tokens`` image placeholders."""
        text = hpsv3_text(prompt)
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            chat = QWEN2VL_TURN.format(text=text)
        if chat.count(IMAGE_TOKEN) != 1:
            raise RewardError(f"hpsv3: the chat template must place one {IMAGE_TOKEN} (found {chat.count(IMAGE_TOKEN)})")
        return chat.replace(IMAGE_TOKEN, IMAGE_TOKEN * image_tokens)  # as the processor expands it

    def predict(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B, 2)``: ``(mu, log sigma)`` per pair; differentiable with respect to ``images``."""
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise RewardError(f"hpsv3: got {images.shape[0]} images but {len(prompts)} prompts")
        for prompt in prompts:
            if REWARD_TOKEN in prompt:
                raise RewardError(f"hpsv3: a prompt contains the reward token {REWARD_TOKEN}: {prompt[:60]!r}")
        rows, grid = self.patches(images.to(self.device))
        rows = rows.to(self.dtype)
        per_image = int(grid[0].prod())  # patch rows per image (all images share one size)
        image_tokens = per_image // self.patches.merge_size ** 2
        texts = [self.chat_text(p, image_tokens) for p in prompts]
        outputs = []
        for start in range(0, len(texts), self.batch_size):
            stop = min(start + self.batch_size, len(texts))
            tokens = self.tokenizer(texts[start:stop], padding=True, return_tensors="pt")
            outputs.append(self.model(tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device),
                                      rows[start * per_image: stop * per_image], grid[start:stop]))
        return torch.cat(outputs).to(images.device)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """float32 ``(B,)`` scores ``mu``; differentiable with respect to ``images``."""
        if images.shape[0] == 0:
            return torch.zeros(0, device=images.device)
        prediction = self.predict(images, prompts)
        self.last_info = {"hpsv3_sigma": float(prediction[:, 1].detach().exp().mean())}  # the model's own uncertainty
        return prediction[:, 0]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        return self.score(images, prompts)
