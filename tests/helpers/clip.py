"""A tiny transformers CLIP (model and in-memory tokenizer) built from config in code, for the reward
tests (tests/test_rewards.py, tests/test_reward_models.py): no hub access."""

from __future__ import annotations

import math
import string

import pytest
import torch

IMAGE_SIZE = 32  # tiny CLIP's vision_config.image_size
CAT_MERGES = (("c", "a"), ("ca", "t</w>"))  # "cat" is one token


def pooled(out):
    """The pooled embedding of ``get_image_features`` / ``get_text_features`` (a tensor, or an
    output object with ``pooler_output`` in newer transformers)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def tiny_tokenizer(merges=CAT_MERGES):
    """A CLIPTokenizer over a-z (plus end-of-word forms) and the tokens of ``merges``."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    merges = list(merges)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges)


def tiny_clip_fixture(merges=CAT_MERGES, logit_scale: float | None = None):
    """A module-scoped fixture giving ``(model, tokenizer)``: a random 2-layer CLIPModel (seed 0) and
    ``tiny_tokenizer(merges)``; ``logit_scale`` set, the model's logit scale is ``log(logit_scale)``."""

    @pytest.fixture(scope="module")
    def tiny_clip():
        from transformers import CLIPConfig, CLIPModel

        tokenizer = tiny_tokenizer(merges)
        small = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
        config = CLIPConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                max_position_embeddings=16,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **small,
            ),
            vision_config=dict(image_size=IMAGE_SIZE, patch_size=8, **small),
            projection_dim=16,
        )
        torch.manual_seed(0)
        model = CLIPModel(config).eval()
        if logit_scale is not None:
            with torch.no_grad():
                model.logit_scale.fill_(math.log(logit_scale))
        return model, tokenizer

    return tiny_clip
