"""Builders for the shapes text-to-image model (random init, all offline).

The model is a plain diffusers / transformers stack so that everything downstream (LoRA via
peft, ``save_pretrained`` / ``from_pretrained``, adapters) uses the real library code:

- ``tokenizer``: a transformers ``CLIPTokenizer`` built in memory from the world's vocabulary;
  every vocabulary word is exactly one token (``"red"`` -> ``"red</w>"``);
- ``text_encoder``: a 2-layer ``CLIPTextModel`` (~0.27M parameters at width 128), or a 2-layer
  bidirectional encoder: ``text_encoder="bert"`` (``BertModel``, learned absolute positions; the
  shipped model's) or ``"t5"`` (``T5EncoderModel``, relative position buckets only). CLIP's causal attention leaves
  the first shape of "a circle left of a square" the same vector whatever the relation word after
  it; in a bidirectional encoder every token sees the whole prompt. With relative positions only,
  a prompt and its swapped twin ("a square left of a circle") encode to nearly the same set of
  vectors, which the UNet's cross-attention cannot tell apart (docs/shapes_world.md);
- ``unet``: a conv ``UNet2DConditionModel`` in pixel space (3 -> 3 channels, no VAE) with
  channels 32/64/128, cross-attention at the 16x16 and 8x8 levels and in the mid block, and an
  attention-pooled text vector added to the time embedding (``addition_embed_type="text"``)
  (~4.3M parameters). A patch DiT of similar size did not learn in 15 CPU-minutes (each patch
  switched on or off on its own). ``cross_attention_levels=1`` (8x8 only, the earlier shipped
  model) pretrains faster (1.8-2.1 against 1.06 steps/s on one thread, in the committed logs) but
  does not bind colours to objects;
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` (rectified flow, ``x_t = (1-t) x0 + t eps``).

Pixel convention: the "latent" is the image itself mapped to ``[-1, 1]`` (``x = 2 * image - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from diffalign.shapes.coordinates import (COORDINATE_CHANNELS, attach_coordinates, coordinate_planes, uses_coordinates,
                                          widen_for_coordinates)
from diffalign.shapes.pipeline import ShapesPipeline
from diffalign.shapes.world import vocabulary

# Special tokens, as in OpenAI CLIP (pad = eos, like the Stable Diffusion tokenizers).
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
EOW = "</w>"  # end-of-word suffix of CLIP's BPE
# Characters that may appear outside vocabulary words (digits are split one per token by CLIP's
# pre-tokenizer). Each gets a token so that nothing maps to <unk>.
_BASE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789,.;:!?'-()"


@dataclass(frozen=True)
class ShapesModelConfig:
    """Architecture of the shapes model. Defaults are the shipped model."""

    block_out_channels: tuple[int, ...] = (32, 64, 128)  # UNet widths at 32x32, 16x16, 8x8
    layers_per_block: int = 1  # resnets per down block (up blocks get one more); 2 costs +30 % per step
    norm_num_groups: int = 8  # GroupNorm groups; must divide every width
    text_time_embedding: bool = True  # also add an attention-pooled text vector to the time
    # embedding, so every resnet (not only the 8x8 attention) sees the prompt: colour and count
    # are global properties; without it colour was still mostly wrong after 1,500 steps
    cross_attention_levels: int = 2  # the lowest N resolution levels get cross-attention (2: 16x16 and
    # 8x8; with 8x8 alone the model painted both objects of "a red circle and a blue square" alike)
    attention_heads: int = 4  # heads per attention layer (8x8 level: 128 / 4 = 32 channels each)
    text_width: int = 128  # CLIP hidden size == UNet cross_attention_dim
    text_layers: int = 2
    text_heads: int = 4
    text_mlp: int = 256  # CLIP intermediate size
    max_length: int = 16  # tokens incl. <bos>/<eos>; prompts of the world are under 12 words
    sample_size: int = 32  # pixels
    shift: float = 2.0  # scheduler shift: more of the few sampling steps at high noise, where
    # layout and colour are decided at 32 px (1.0 = uniform sigmas)
    text_encoder: str = "clip"  # "clip": causal CLIPTextModel (the model shipped before); "bert":
    # bidirectional BertModel with absolute positions (the shipped model); "t5": bidirectional
    # T5EncoderModel, relative positions only
    coordinate_channels: bool = False  # two extra UNet input channels holding each pixel's x and y
    # in [-1, 1] (CoordConv), appended by the pipeline's hook: a conv UNet otherwise knows where a
    # pixel is only from the zero padding at the borders (what it changed for relations such as
    # "left of": docs/shapes_world.md)


TINY_CONFIG = ShapesModelConfig(
    block_out_channels=(8, 16, 16), norm_num_groups=4, attention_heads=2, layers_per_block=1,
    text_width=32, text_heads=2, text_mlp=64, cross_attention_levels=1,
)


# ---- tokenizer ------------------------------------------------------------------------------
def _bpe_word(word: str, merges: list[tuple[str, str]]) -> list[str]:
    """CLIP-style BPE of one pre-token (lowest-rank merge first); used only to build merges."""
    parts = list(word[:-1]) + [word[-1] + EOW]
    ranks = {pair: i for i, pair in enumerate(merges)}
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    return parts


def build_tokenizer(words: Sequence[str], max_length: int = 16):
    """A ``CLIPTokenizer`` in which every word of ``words`` is one token.

    Token ids: 0 ``<|startoftext|>``, 1 ``<|endoftext|>`` (also pad and unk), then the words in
    the given order, then single characters and BPE intermediates. Merges are added until every
    word encodes to a single token (a merge added for one word can split another; new merges go
    last, so earlier words keep their segmentation, and the loop reaches a fixed point).
    """
    from transformers import CLIPTokenizer

    words = list(dict.fromkeys(w.lower() for w in words if w))
    for w in words:
        if not w.isalpha():
            raise ValueError(f"vocabulary word {w!r} must be letters only (CLIP splits digits and punctuation)")
    vocab: dict[str, int] = {BOS: 0, EOS: 1}
    for tok in [w + EOW for w in words] + list(_BASE_CHARS) + [c + EOW for c in _BASE_CHARS]:
        vocab.setdefault(tok, len(vocab))
    merges: list[tuple[str, str]] = []
    for _ in range(100):  # fixed point is reached after a few passes for any realistic vocabulary
        changed = False
        for w in words:
            parts = _bpe_word(w, merges)
            while len(parts) > 1:  # merge left to right, lowest priority
                merges.append((parts[0], parts[1]))
                vocab.setdefault(parts[0] + parts[1], len(vocab))
                parts = [parts[0] + parts[1]] + parts[2:]
                changed = True
        if not changed:
            break
    else:  # pragma: no cover - would need a pathological vocabulary
        raise RuntimeError("could not build single-token merges for the vocabulary")
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    return tok


# ---- networks -------------------------------------------------------------------------------
TEXT_ENCODERS = ("clip", "bert", "t5")


def build_text_encoder(vocab_size: int, config: ShapesModelConfig = ShapesModelConfig()):
    """The prompt encoder of ``config.text_encoder`` at ``config``'s widths (pad = eos = id 1)."""
    if config.text_encoder == "t5":
        from transformers import T5Config, T5EncoderModel

        t5 = T5Config(
            vocab_size=vocab_size, d_model=config.text_width, d_kv=config.text_width // config.text_heads,
            d_ff=config.text_mlp, num_layers=config.text_layers, num_heads=config.text_heads,
            relative_attention_num_buckets=8, relative_attention_max_distance=config.max_length,
            dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=1, eos_token_id=1,
            decoder_start_token_id=0, tie_word_embeddings=False,
        )
        return T5EncoderModel(t5)
    if config.text_encoder == "bert":
        from transformers import BertConfig, BertModel

        bert = BertConfig(
            vocab_size=vocab_size, hidden_size=config.text_width, num_hidden_layers=config.text_layers,
            num_attention_heads=config.text_heads, intermediate_size=config.text_mlp,
            max_position_embeddings=config.max_length, type_vocab_size=1, pad_token_id=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        return BertModel(bert)
    if config.text_encoder != "clip":
        raise ValueError(f"text_encoder must be one of {TEXT_ENCODERS}, got {config.text_encoder!r}")
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(
        vocab_size=vocab_size, max_position_embeddings=config.max_length,
        hidden_size=config.text_width, intermediate_size=config.text_mlp, projection_dim=config.text_width,
        num_hidden_layers=config.text_layers, num_attention_heads=config.text_heads,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return CLIPTextModel(cfg)


def build_unet(config: ShapesModelConfig = ShapesModelConfig()):
    from diffusers import UNet2DConditionModel

    n = len(config.block_out_channels)
    k = config.cross_attention_levels
    if not 1 <= k <= n:
        raise ValueError(f"cross_attention_levels must be 1..{n} (the UNet's levels), got {k}")
    # Cross-attention at the lowest k resolutions (and the mid block, always on).
    down = ("DownBlock2D",) * (n - k) + ("CrossAttnDownBlock2D",) * k
    up = ("CrossAttnUpBlock2D",) * k + ("UpBlock2D",) * (n - k)
    return UNet2DConditionModel(
        sample_size=config.sample_size, in_channels=3 + (COORDINATE_CHANNELS if config.coordinate_channels else 0),
        out_channels=3,
        down_block_types=down, up_block_types=up, block_out_channels=config.block_out_channels,
        layers_per_block=config.layers_per_block, norm_num_groups=config.norm_num_groups,
        cross_attention_dim=config.text_width,
        # diffusers' historical naming: for this class `attention_head_dim` is the number of heads.
        attention_head_dim=config.attention_heads,
        addition_embed_type="text" if config.text_time_embedding else None,
        addition_embed_type_num_heads=config.attention_heads,
    )


def build_scheduler(shift: float = ShapesModelConfig.shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def build_pipeline(words: Sequence[str] | None = None, config: ShapesModelConfig = ShapesModelConfig(), seed: int = 0):
    """A randomly initialised :class:`~diffalign.shapes.pipeline.ShapesPipeline`.

    ``words`` defaults to the vocabulary of :mod:`diffalign.shapes.world`.
    """
    if words is None:
        words = vocabulary()
    tokenizer = build_tokenizer(words, config.max_length)
    torch.manual_seed(seed)
    text_encoder = build_text_encoder(len(tokenizer), config)
    unet = build_unet(config)
    return ShapesPipeline(text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=build_scheduler(config.shift))
