"""Offline building blocks for the tiny pipelines used by ``build_tiny`` and the tests.

Real tokenizers are downloaded from the hub; these are built in memory (transformers 5 API),
survive ``save_pretrained`` / ``from_pretrained``, and give different token ids for different
prompts, which is all a randomly initialised text encoder needs to give different embeddings.
"""

from __future__ import annotations

from typing import Sequence

# Whole words get their own token so that typical test prompts stay short; any other text
# falls back to characters (CLIP: byte-level characters, T5: letters / digits / unk).
TINY_WORDS = (
    "a an the of and on in with photo picture painting red green blue yellow black white orange "
    "purple circle square triangle star cat dog car tree house one two three four small big"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level alphabet: every byte maps to one printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_clip_tokenizer(max_length: int = 16):
    """A byte-level BPE CLIPTokenizer: 256 characters, 256 end-of-word characters, whole-word
    merges for :data:`TINY_WORDS`, then ``<|startoftext|>`` and ``<|endoftext|>`` (as in CLIP)."""
    from transformers import CLIPTokenizer

    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in TINY_WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        left = pieces[0]
        for right in pieces[1:]:
            merged = left + right
            if (left, right) not in merges:
                merges.append((left, right))
            if merged not in tokens:
                tokens.append(merged)
            left = merged
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int = 16):
    """A unigram T5Tokenizer with ``<pad>``, ``</s>``, ``<unk>`` (ids 0, 1, 2 as in T5), whole
    words (with the ``▁`` word prefix) and single characters as fallback."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in TINY_WORDS]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"
    pieces += [(c, -5.0) for c in chars] + [("▁" + c, -5.5) for c in chars if c not in TINY_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def tiny_clip_text_config(vocab_size: int, *, hidden_size: int = 16, projection_dim: int = 16, eos_token_id: int, bos_token_id: int, max_positions: int = 32):
    """A 2-layer CLIP text encoder config (diffusers' tests use the same shape of config)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size, max_position_embeddings=max_positions,
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, projection_dim=projection_dim,
        num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
    )


def tiny_t5_config(vocab_size: int, *, d_model: int = 32, config_class=None):
    """A 1-layer T5 encoder config (``config_class``: another T5 flavour's, e.g. ``UMT5Config``)."""
    from transformers import T5Config

    return (config_class or T5Config)(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )


def tiny_unet(*, cross_attention_dim: int, attention_head_dim, **options):
    """A 2-level ``UNet2DConditionModel`` (channels 8 / 16, cross-attention at the second level)
    on 4-channel 16 x 16 latents (32 px images); ``options`` add SDXL's conditioning."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,  # latent size of a 32 px image
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=attention_head_dim,
        norm_num_groups=4,
        **options,
    )


def tiny_decoder_config(config_class, vocab_size: int, *, width: int = 16, num_layers: int = 1, **options):
    """A decoder-only text model config (Gemma-2, Qwen3, Qwen2.5-VL's text part) of width
    ``width``: 2 query heads sharing 1 key-value head, an MLP of twice the width."""
    return config_class(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, **options,
    )


def tiny_vae(latent_channels: int, *, scaling_factor: float = 1.5305, shift_factor: float | None = 0.0609):
    """An AutoencoderKL with two blocks (downsampling factor 2): 32 px images <-> 16 x 16 latents."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 8), layers_per_block=1, norm_num_groups=2,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def tiny_tiny_autoencoder(latent_channels: int, *, scaling_factor: float = 1.5305, shift_factor: float = 0.0609):
    """A TAESD-style ``AutoencoderTiny`` (as ``madebyollin/taesd3`` for SD3) with 2x upsampling.

    Why not a tiny ``AutoencoderKL``: with random weights its GroupNorms make the decoded image
    invariant to the scale of the latents, so pixel statistics (JPEG size, brightness) barely
    depend on what the denoiser does and RL smoke tests have nothing to learn. This decoder has no
    normalisation, so images depend smoothly on the latents.
    """
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(
        in_channels=3,
        out_channels=3,
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        num_encoder_blocks=(1, 1),
        num_decoder_blocks=(1, 1),
        latent_channels=latent_channels,
        upsampling_scaling_factor=2,
        upsample_fn="nearest",
        scaling_factor=scaling_factor,
    )
    vae.register_to_config(shift_factor=shift_factor)  # the SD3 pipeline reads it in decode
    return vae


# Qwen-Image's system prompt (``QwenImagePipeline.prompt_template_encode``) in whole words: with these
# in the vocabulary the template's prefix is 34 tokens, as with the real Qwen2 tokenizer, so the
# pipeline's ``prompt_template_encode_start_idx = 34`` drops exactly the prefix.
QWEN_TEMPLATE_WORDS = (
    "system user assistant Describe image by detailing color shape size texture quantity text spatial "
    "relationships objects background"
).split()
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's chat template for one user message, reduced to what Flux2KleinPipeline asks of it
# (add_generation_prompt=True, enable_thinking=False: an empty think block).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen2_tokenizer(max_length: int = 131072, extra_words: Sequence[str] = (), extra_special: Sequence[str] = ()):  # Qwen2.5 / Qwen3 model_max_length
    """A byte-level BPE ``Qwen2Tokenizer`` (the class of Qwen2.5-VL's and Qwen3's tokenizers) built
    in memory: the 256 byte characters, whole words of :data:`TINY_WORDS` and
    :data:`QWEN_TEMPLATE_WORDS` with and without the leading-space marker ``Ġ``, Qwen's special
    tokens (``<|endoftext|>`` pads), and Qwen3's chat template. ``extra_words`` (merged after all
    of the others' chains in each block, so that they leave the other words' tokens as they were) and ``extra_special`` tokens add to it
    (Qwen-Image-Edit's template words and vision tokens)."""
    from transformers import Qwen2Tokenizer

    alphabet = _bytes_to_unicode()
    space = alphabet[ord(" ")]  # "Ġ"
    tokens = list(alphabet.values())
    merges: list[tuple[str, str]] = []
    words = list(dict.fromkeys(TINY_WORDS + QWEN_TEMPLATE_WORDS))
    extra = [w for w in dict.fromkeys(extra_words) if w not in words]
    # Merge ranks in three blocks, each word a chain (prefix, next character). "Ġword" chains first:
    # their left parts all start with Ġ, so they never compete with one another and always beat the
    # bare-character pairs inside the word. Then bare words, the template's before TINY_WORDS, so that
    # "system", "Describe", "user" and "assistant" stay whole (the 34-token prefix).
    chains = [[space, *w] for w in words + extra] + [list(w) for w in QWEN_TEMPLATE_WORDS] + [list(w) for w in TINY_WORDS]
    chains += [list(w) for w in extra]
    for pieces in chains:
        left = pieces[0]
        for right in pieces[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            if left not in tokens:
                tokens.append(left)
    special = list(QWEN_SPECIAL_TOKENS) + list(extra_special)
    vocab = {tok: i for i, tok in enumerate(tokens + special)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


# The per-channel latent statistics of the Qwen-Image / Wan2.1 VAE (AutoencoderKLWan's defaults);
# tiny VAEs take the first ``z_dim`` values so that decode exercises the same normalisation.
QWEN_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
QWEN_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


# Qwen-Image-Edit's system prompt (``QwenImageEditPipeline.prompt_template_encode``) in whole words
# plus its punctuation pieces: with these the template's prefix is 64 tokens, as with the real
# tokenizer, so that ``prompt_template_encode_start_idx = 64`` drops exactly the prefix and keeps
# the vision tokens of the user turn.
QWEN_EDIT_TEMPLATE_WORDS = (
    "key features input objects then explain how user text instruction should alter or modify Generate new that meets "
    "requirements while maintaining consistency with original where appropriate"
).split() + ["(", "),", "'s"]
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_qwen_vl_processor(tokenizer, max_side: int = 56):
    """A ``Qwen2VLProcessor`` (Qwen-Image-Edit's ``processor``) around ``tokenizer`` (which must
    hold :data:`QWEN_VISION_TOKENS`) with the PIL image processor of Qwen2-VL, limited to images
    of at most ``max_side`` pixels a side after its 28-pixel rounding (56: 4 patches of 14, one
    merged vision token per 2x2 patches: every image gives 4 vision tokens).

    Without torchvision transformers has no video processor; Qwen-Image-Edit never passes videos,
    so the processor is built with none (``ProcessorMixin`` checks each part's class, and would
    reject it). Such a processor cannot be saved with ``save_pretrained``; the pipeline's other
    components can.
    """
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    image_processor = Qwen2VLImageProcessorPil(min_pixels=max_side * max_side, max_pixels=max_side * max_side)
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)

    def lenient(name, value):  # this instance only: accept the missing video processor
        return None if name == "video_processor" and value is None else ProcessorMixin.check_argument_for_proper_class(processor, name, value)

    processor.check_argument_for_proper_class = lenient
    Qwen2VLProcessor.__init__(processor, image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    del processor.check_argument_for_proper_class
    return processor


# Llama 3's special tokens as HunyuanVideo's prompt template uses them (``<|begin_of_text|>`` is
# the BOS token, ``<|end_of_text|>`` ends and pads).
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def tiny_llama_tokenizer(template_words: Sequence[str] = (), max_length: int = 512):
    """A byte-fallback BPE ``LlamaTokenizer`` (``LlamaTokenizerFast`` in transformers 5) built in
    memory with Llama 3's special tokens, padding on the right (as HunyuanVideo's tokenizer: the
    pipeline crops the template from the front and the transformer counts the valid text tokens
    from the left). Words of :data:`TINY_WORDS` and ``template_words`` get one token each, with
    and without the ``▁`` space marker (after a special token a word has none), ``"\\n\\n"`` is one
    token (as in Llama 3), other characters are single tokens or ``<0xNN>`` bytes. With
    HunyuanVideo's system-prompt words the template's prefix is 95 tokens, the pipeline's
    ``crop_start``, as with the real tokenizer."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, **{tok: i + 1 for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "\n", "\n\n", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:!?'-"]:
        vocab.setdefault(piece, len(vocab))
    merges: list[tuple[str, str]] = [("\n", "\n")]
    words = list(dict.fromkeys(list(template_words) + list(TINY_WORDS)))
    # "▁word" chains first (their left parts all start with ▁, so they beat the bare pairs inside a word)
    for pieces in [["▁", *w] for w in words] + [list(w) for w in words]:
        left = pieces[0]
        for right in pieces[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    tokenizer = LlamaTokenizer(
        vocab=vocab, merges=merges, bos_token=LLAMA3_SPECIAL_TOKENS[0], eos_token=LLAMA3_SPECIAL_TOKENS[1],
        pad_token=LLAMA3_SPECIAL_TOKENS[1], add_bos_token=True, padding_side="right", model_max_length=max_length,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAMA3_SPECIAL_TOKENS[2:])})
    return tokenizer
