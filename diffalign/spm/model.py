"""Step-aware preference models (SPM): preference scorers conditioned on the noise level.

SPO (Liang et al. 2024) judges every denoising step on its own, so its preference model must
rate intermediate states, not only final images. An SPM scores the decoded x0 prediction of a
noisy state for a prompt, *given the state's noise level* ``tau`` in ``[0, 1]`` (0 = clean, 1 =
pure noise; see :mod:`diffalign.forward_process` for the map from each model's own time):
blurry x0 predictions at high noise are judged by a different standard than sharp ones.

Two architectures, one interface (``model(images, prompts, tau) -> scores (B,)``, differentiable):

- :class:`ClipSPM`: the reference SPM for real models. A CLIP (PickScore, ``CLIPModel``) whose
  vision tower is time-conditioned with adaLN as in DiT / the SPO code: a sinusoidal embedding of
  ``1000 * tau`` (the DDPM index the reference feeds) goes through an MLP to ``c``; every vision
  encoder layer gets ``(shift, scale, gate) x 2 = Linear(SiLU(c))`` applied as
  ``x + gate * f(LN(x) * (1 + scale) + shift)`` around attention and MLP, and the pooled output
  gets ``(1 + scale) * y + shift``. Modulations start at identity (gates 1, shifts / scales 0),
  so an untrained SPM equals its backbone's score ``exp(logit_scale) * cos(E_img, E_txt)`` at
  every t. The modulation runs in forward hooks on the stock transformers modules: the backbone
  keeps its own class and weights and saves with ``save_pretrained``.
- :class:`ShapesSPM`: a small time-conditioned convolutional scorer for the ShapesWorld
  (pixel space, 32x32, a word-level prompt encoder over the world's vocabulary; about 0.3M
  parameters, trains on a CPU in minutes). Time and prompt condition every residual block
  through adaptive GroupNorm; coordinate channels let the pooled features see positions
  ("left of").

Sources for :func:`load_spm` (also the ``spm`` reward's ``model``): a folder of ``save_pretrained``
(``spm_config.json`` + weights), ``tiny:shapes`` / ``tiny:clip`` (random models built in code, for
tests), or a CLIP / PickScore hub id or folder (untrained: its backbone's score at every t).
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffalign.errors import DiffalignError
from diffalign.shapes import vocabulary as shapes_vocabulary
from reward_models.clip_score import ClipImageTransform
from reward_models.loading import first_line, looks_like_path

SPM_CONFIG_FILE = "spm_config.json"  # {"kind": "shapes" | "clip", ...constructor arguments}
SPM_WEIGHTS_FILE = "spm.safetensors"  # ShapesSPM: all weights; ClipSPM: the time-conditioning weights
CLIP_BACKBONE_DIR = "backbone"  # ClipSPM: the CLIPModel (save_pretrained), tokenizer and preprocessor config
TIME_SCALE = 1000.0  # tau -> 1000 * tau before the sinusoidal embedding (the reference embeds DDPM indices)
TINY_MAX_TOKENS = 64  # tiny:clip tokenizes characters: prompts of the ShapesWorld stay under 64


class SPMError(DiffalignError):
    """A step-aware preference model cannot be found, loaded or built."""


def timestep_embedding(tau: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``(B, dim)`` of ``TIME_SCALE * tau`` (``tau`` ``(B,)``), as in DiT / GLIDE."""
    t = tau.float() * TIME_SCALE
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    """``tau (B,)`` -> ``(B, width)``: sinusoidal features through a 2-layer MLP."""

    def __init__(self, width: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, width), nn.SiLU(), nn.Linear(width, width))
        nn.init.normal_(self.mlp[0].weight, std=0.02)  # the reference's init
        nn.init.normal_(self.mlp[2].weight, std=0.02)

    def forward(self, tau: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(tau, self.frequency_dim).to(self.mlp[0].weight.dtype))


class StepAwarePreferenceModel(nn.Module):
    """Base class: ``forward(images (B,3,H,W) in [0,1], prompts (B), tau (B,)) -> scores (B,)`` fp32."""

    kind: ClassVar[str]
    takes_timestep: ClassVar[bool] = True  # what SPO checks before using a reward as its SPM

    def forward(self, images: torch.Tensor, prompts: Sequence[str], tau: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def spm_config(self) -> dict:
        """Constructor arguments written to ``spm_config.json``."""
        raise NotImplementedError

    def save_pretrained(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _check(self, images: torch.Tensor, prompts: Sequence[str], tau: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        tau = torch.as_tensor(tau, dtype=torch.float32, device=images.device)
        if tau.ndim == 0:
            tau = tau.expand(images.shape[0])
        if tau.shape != (images.shape[0],):
            raise ValueError(f"tau must be a number or shape ({images.shape[0]},), got {tuple(tau.shape)}")
        return tau


# --------------------------------------------------------------------------------------------
# ShapesSPM: a small scorer for the ShapesWorld
# --------------------------------------------------------------------------------------------


class _AdaGNBlock(nn.Module):
    """Residual block whose GroupNorms are modulated by the condition: ``GN(x) * (1 + s) + b``."""

    def __init__(self, channels: int, cond_dim: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels, affine=False)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels, affine=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.mod = nn.Linear(cond_dim, 4 * channels)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        s1, b1, s2, b2 = self.mod(cond)[:, :, None, None].chunk(4, dim=1)
        h = self.conv1(F.silu(self.norm1(x) * (1 + s1) + b1))
        h = self.conv2(F.silu(self.norm2(h) * (1 + s2) + b2))
        return x + h


class ShapesSPM(StepAwarePreferenceModel):
    """Time- and prompt-conditioned CNN scorer for 32x32 ShapesWorld images (see the module docstring).

    Args:
        vocabulary: words of the prompt encoder (default: the ShapesWorld vocabulary); other
            words map to an unknown token.
        width: channels at full resolution (x2 at 16x16, x4 at 8x8).
        text_width: width of the word embeddings, the prompt encoder and the condition vector.
        image_size: images are resized to this side (bilinear, antialiased) before scoring.
        max_words: prompt length limit (words beyond it are dropped).
    """

    kind = "shapes"

    def __init__(self, vocabulary: Optional[Sequence[str]] = None, width: int = 32, text_width: int = 64,
                 image_size: int = 32, max_words: int = 16):
        super().__init__()
        if vocabulary is None:
            vocabulary = shapes_vocabulary()
        self.vocabulary = list(vocabulary)
        self.word_ids = {w: i + 2 for i, w in enumerate(self.vocabulary)}  # 0 = padding, 1 = unknown
        self.width, self.text_width, self.image_size, self.max_words = width, text_width, image_size, max_words
        self.word_embedding = nn.Embedding(len(self.vocabulary) + 2, text_width, padding_idx=0)
        self.position_embedding = nn.Parameter(torch.randn(max_words, text_width) * 0.02)
        self.text_encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(text_width, nhead=4, dim_feedforward=2 * text_width, dropout=0.0, batch_first=True),
            num_layers=2, enable_nested_tensor=False,
        )
        self.time_embedder = TimestepEmbedder(text_width)
        groups = 8
        self.stem = nn.Conv2d(3 + 2, width, 3, padding=1)  # RGB + (x, y) coordinate channels
        widths = [width, 2 * width, 4 * width]
        self.blocks = nn.ModuleList([_AdaGNBlock(c, text_width, groups) for c in widths])
        self.downs = nn.ModuleList([nn.Conv2d(widths[i], widths[i + 1], 3, stride=2, padding=1) for i in range(2)])
        self.head = nn.Sequential(nn.Linear(2 * widths[-1] + text_width, 128), nn.SiLU(), nn.Linear(128, 1))

    def spm_config(self) -> dict:
        return {"kind": self.kind, "vocabulary": self.vocabulary, "width": self.width, "text_width": self.text_width,
                "image_size": self.image_size, "max_words": self.max_words}

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """``(B, max_words)`` word ids (0-padded); words are lower-cased, punctuation dropped."""
        ids = torch.zeros(len(prompts), self.max_words, dtype=torch.long)
        for i, p in enumerate(prompts):
            words = re.findall(r"[a-z]+", p.lower())[: self.max_words]
            ids[i, : len(words)] = torch.tensor([self.word_ids.get(w, 1) for w in words], dtype=torch.long)
        return ids

    def encode_text(self, prompts: Sequence[str]) -> torch.Tensor:
        ids = self.tokenize(prompts).to(self.device)
        pad = ids == 0
        pad[:, 0] = False  # an empty prompt still attends to one (padding) token
        h = self.word_embedding(ids) + self.position_embedding[None]
        h = self.text_encoder(h, src_key_padding_mask=pad)
        keep = (~pad).float()[..., None]
        return (h * keep).sum(1) / keep.sum(1)

    def forward(self, images: torch.Tensor, prompts: Sequence[str], tau: torch.Tensor) -> torch.Tensor:
        tau = self._check(images, prompts, tau)
        x = images.to(self.device, torch.float32)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True, align_corners=False)
        x = x * 2 - 1
        b, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h, device=x.device).view(1, 1, h, 1).expand(b, 1, h, w)
        xs = torch.linspace(-1, 1, w, device=x.device).view(1, 1, 1, w).expand(b, 1, h, w)
        text = self.encode_text(prompts)
        cond = F.silu(self.time_embedder(tau.to(self.device)) + text)
        feat = self.stem(torch.cat([x, xs, ys], dim=1))
        for i, block in enumerate(self.blocks):
            feat = block(feat, cond)
            if i < len(self.downs):
                feat = self.downs[i](F.silu(feat))
        pooled = torch.cat([feat.mean(dim=(2, 3)), feat.amax(dim=(2, 3)), text], dim=1)
        return self.head(pooled).squeeze(1).float()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / SPM_CONFIG_FILE).write_text(json.dumps(self.spm_config(), indent=2))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path / SPM_WEIGHTS_FILE))

    @classmethod
    def from_folder(cls, path: Path, config: dict) -> "ShapesSPM":
        kwargs = {k: v for k, v in config.items() if k != "kind"}
        model = cls(**kwargs)
        model.load_state_dict(_read_weights(path / SPM_WEIGHTS_FILE), strict=True)
        return model


# --------------------------------------------------------------------------------------------
# ClipSPM: a CLIP / PickScore backbone with adaLN time conditioning
# --------------------------------------------------------------------------------------------


class ClipSPM(StepAwarePreferenceModel):
    """Time-conditioned CLIP preference model (the SPO reference architecture).

    Args:
        clip_model: a transformers ``CLIPModel`` (e.g. PickScore).
        tokenizer: its tokenizer.
        processor_config: a ``preprocessor_config.json`` dict (None: CLIP's defaults).
        frequency_dim: size of the sinusoidal time features.
    """

    kind = "clip"

    def __init__(self, clip_model: nn.Module, tokenizer: Any, processor_config: Optional[dict] = None, frequency_dim: int = 256):
        super().__init__()

        self.clip = clip_model
        self.tokenizer = tokenizer
        self.processor_config = processor_config
        self.frequency_dim = frequency_dim
        vision = clip_model.vision_model
        width = clip_model.config.vision_config.hidden_size
        self.t_embedder = TimestepEmbedder(width, frequency_dim)
        layers = list(vision.encoder.layers)
        self.adaln = nn.ModuleList([nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width)) for _ in layers])
        for mod in self.adaln:  # identity at init: shifts and scales 0, gates (chunks 2 and 5) 1
            nn.init.zeros_(mod[1].weight)
            with torch.no_grad():
                bias = torch.zeros(6 * width)
                bias[2 * width : 3 * width] = 1
                bias[5 * width :] = 1
                mod[1].bias.copy_(bias)
        self.post_adaln = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        nn.init.zeros_(self.post_adaln[1].weight)
        nn.init.zeros_(self.post_adaln[1].bias)
        self.transform = ClipImageTransform.from_processor_config(processor_config, int(clip_model.config.vision_config.image_size))
        self.max_length = min(int(getattr(tokenizer, "model_max_length", 77)), int(clip_model.config.text_config.max_position_embeddings))
        self._mods: Optional[list[tuple[torch.Tensor, ...]]] = None  # per layer (shift1, scale1, gate1, shift2, scale2, gate2)
        self._post: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._install_hooks(layers, vision.post_layernorm)

    # ---- adaLN through forward hooks on the stock modules ----------------------------------
    def _install_hooks(self, layers: list[nn.Module], post_layernorm: nn.Module) -> None:
        def modulate(which: int, part: int):
            def hook(_module, _inputs, output):
                if self._mods is None:
                    return output
                shift, scale = self._mods[which][3 * part], self._mods[which][3 * part + 1]
                return output * (1 + scale[:, None]) + shift[:, None]

            return hook

        def gate(which: int, part: int, tuple_output: bool):
            def hook(_module, _inputs, output):
                if self._mods is None:
                    return output
                g = self._mods[which][3 * part + 2][:, None]
                if tuple_output:
                    return (output[0] * g, *output[1:])
                return output * g

            return hook

        def post(_module, _inputs, output):
            if self._post is None:
                return output
            shift, scale = self._post
            return output * (1 + scale) + shift

        for i, layer in enumerate(layers):
            layer.layer_norm1.register_forward_hook(modulate(i, 0))
            layer.self_attn.register_forward_hook(gate(i, 0, tuple_output=True))
            layer.layer_norm2.register_forward_hook(modulate(i, 1))
            layer.mlp.register_forward_hook(gate(i, 1, tuple_output=False))
        post_layernorm.register_forward_hook(post)

    @contextmanager
    def _time_condition(self, tau: torch.Tensor) -> Iterator[None]:
        c = self.t_embedder(tau)
        dtype = next(self.clip.parameters()).dtype
        self._mods = [tuple(m.to(dtype) for m in mod(c).chunk(6, dim=1)) for mod in self.adaln]
        self._post = tuple(m.to(dtype) for m in self.post_adaln(c).chunk(2, dim=1))
        try:
            yield
        finally:
            self._mods = None
            self._post = None

    # ---- scoring -----------------------------------------------------------------------------
    def image_embeddings(self, images: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """Unit-norm fp32 ``(B, D)`` time-conditioned image embeddings."""
        dtype = next(self.clip.parameters()).dtype
        pixels = self.transform(images.to(self.device).float()).to(dtype)
        with self._time_condition(tau.to(self.device)):
            feats = self.clip.get_image_features(pixel_values=pixels)
        feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        return F.normalize(feats.float(), dim=-1)

    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        feats = self.clip.get_text_features(**tokens)
        feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        return F.normalize(feats.float(), dim=-1)

    def forward(self, images: torch.Tensor, prompts: Sequence[str], tau: torch.Tensor) -> torch.Tensor:
        tau = self._check(images, prompts, tau)
        unique = list(dict.fromkeys(prompts))  # encode each distinct prompt once
        text = self.text_embeddings(unique)
        index = torch.tensor([unique.index(p) for p in prompts], device=text.device)
        image = self.image_embeddings(images, tau)
        return self.clip.logit_scale.exp().float() * (image * text[index]).sum(-1)

    # ---- persistence -----------------------------------------------------------------------
    def spm_config(self) -> dict:
        return {"kind": self.kind, "frequency_dim": self.frequency_dim}

    def time_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("clip.")}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        backbone = path / CLIP_BACKBONE_DIR
        backbone.mkdir(parents=True, exist_ok=True)
        self.clip.save_pretrained(backbone)
        self.tokenizer.save_pretrained(backbone)
        if self.processor_config:
            (backbone / "preprocessor_config.json").write_text(json.dumps(self.processor_config, indent=2))
        (path / SPM_CONFIG_FILE).write_text(json.dumps(self.spm_config(), indent=2))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.time_state_dict().items()}, str(path / SPM_WEIGHTS_FILE))

    @classmethod
    def from_folder(cls, path: Path, config: dict, dtype: torch.dtype = torch.float32) -> "ClipSPM":
        clip_model, tokenizer, processor_config = _load_clip(str(path / CLIP_BACKBONE_DIR), str(path / CLIP_BACKBONE_DIR), dtype)
        model = cls(clip_model, tokenizer, processor_config, frequency_dim=int(config.get("frequency_dim", 256)))
        missing = model.load_state_dict(_read_weights(path / SPM_WEIGHTS_FILE), strict=False)
        bad = [k for k in missing.missing_keys if not k.startswith("clip.")] + list(missing.unexpected_keys)
        if bad:
            raise SPMError(f"SPM weights in {str(path)!r} do not match the model: {bad[:3]}")
        return model

    @classmethod
    def from_backbone(cls, model: str, processor: Optional[str] = None, dtype: torch.dtype = torch.float32) -> "ClipSPM":
        """A fresh time-conditioned CLIP around a hub id or folder (PickScore: ``yuvalkirstain/PickScore_v1``
        with ``processor=laion/CLIP-ViT-H-14-laion2B-s32B-b79K``); without ``processor`` the tokenizer and
        preprocessing are read from ``model`` itself."""
        clip_model, tokenizer, processor_config = _load_clip(model, processor or model, dtype)
        return cls(clip_model, tokenizer, processor_config)

    @classmethod
    def tiny(cls, seed: int = 0, image_size: int = 32) -> "ClipSPM":
        """A tiny random CLIP built in code (2 layers of width 32) with a character-level CLIP tokenizer."""
        from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

        vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
        for char in "abcdefghijklmnopqrstuvwxyz0123456789,.;:!?'-()":
            vocab[char] = len(vocab)
            vocab[char + "</w>"] = len(vocab)
        tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TINY_MAX_TOKENS)  # no merges: one token per character
        small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        config = CLIPConfig(
            text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=TINY_MAX_TOKENS, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **small),
            vision_config=dict(image_size=image_size, patch_size=8, **small),
            projection_dim=16,
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            clip_model = CLIPModel(config).eval()
            model = cls(clip_model, tokenizer, {"size": {"shortest_edge": image_size},
                                                "crop_size": {"height": image_size, "width": image_size}})
        return model


def _load_clip(model: str, processor: str, dtype: torch.dtype):
    """(CLIPModel, tokenizer, preprocessor config dict or None) from hub ids or folders."""
    for what, name in (("model", model), ("processor", processor)):
        if looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
            raise SPMError(f"SPM: {what} folder {name!r} does not exist")
    from transformers import AutoTokenizer, CLIPModel
    from transformers.image_processing_utils import ImageProcessingMixin

    model_path, processor_path = os.path.expanduser(model), os.path.expanduser(processor)
    try:
        clip_model = CLIPModel.from_pretrained(model_path, dtype=dtype)
    except Exception as exc:  # offline, missing files, not a CLIP checkpoint
        raise SPMError(f"SPM: cannot load CLIP backbone {model!r}: {first_line(exc)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(processor_path)
    except Exception as exc:
        raise SPMError(f"SPM: cannot load the tokenizer from {processor!r}: {first_line(exc)}") from None
    try:
        processor_config, _ = ImageProcessingMixin.get_image_processor_dict(processor_path)
    except (OSError, ValueError):  # no preprocessor_config.json: CLIP's defaults
        processor_config = None
    return clip_model, tokenizer, processor_config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.is_file():
        raise SPMError(f"SPM weights file {str(file)!r} does not exist")
    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:
        raise SPMError(f"cannot read SPM weights {str(file)!r}: {first_line(exc)}") from None


# --------------------------------------------------------------------------------------------
# Building and loading
# --------------------------------------------------------------------------------------------

KINDS = {"shapes": ShapesSPM, "clip": ClipSPM}


def build_spm(backbone: str, *, processor: Optional[str] = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> StepAwarePreferenceModel:
    """A fresh SPM to train: ``shapes`` (a new :class:`ShapesSPM`), ``tiny:clip``, a trained SPM
    folder (continue training it), or a CLIP / PickScore hub id or folder."""
    if backbone == "shapes":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return ShapesSPM()
    return load_spm(backbone, processor=processor, dtype=dtype, seed=seed)


def load_spm(source: str, *, processor: Optional[str] = None, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> StepAwarePreferenceModel:
    """Load an SPM from a saved folder, ``tiny:shapes`` / ``tiny:clip``, or a CLIP backbone (see
    the module docstring). Errors are one-line :class:`SPMError` naming the source."""
    source = str(source)
    if source == "tiny:shapes":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model: StepAwarePreferenceModel = ShapesSPM(width=8, text_width=32)
    elif source == "tiny:clip":
        model = ClipSPM.tiny(seed=seed)
    else:
        path = Path(source).expanduser()
        if (path / SPM_CONFIG_FILE).is_file():
            try:
                config = json.loads((path / SPM_CONFIG_FILE).read_text())
            except ValueError as exc:
                raise SPMError(f"SPM folder {source!r}: {SPM_CONFIG_FILE} is not valid JSON ({exc})") from None
            kind = config.get("kind")
            if kind not in KINDS:
                raise SPMError(f"SPM folder {source!r}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
            model = ShapesSPM.from_folder(path, config) if kind == "shapes" else ClipSPM.from_folder(path, config, dtype)
        elif path.is_dir() and not (path / "config.json").is_file():
            raise SPMError(f"{source!r} is neither an SPM folder (no {SPM_CONFIG_FILE}) nor a CLIP model folder")
        elif source.startswith("tiny:"):
            raise SPMError(f"unknown tiny SPM {source!r}; use tiny:shapes or tiny:clip")
        else:
            model = ClipSPM.from_backbone(source, processor, dtype)
    if device is not None:
        model = model.to(device)
    return model
