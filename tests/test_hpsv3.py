"""HPSv3 on a tiny Qwen2-VL built in code, against a reference that follows the authors' inference.

The base folder holds what ``Qwen/Qwen2-VL-7B-Instruct`` provides (config.json, a byte-level
Qwen2 tokenizer with Qwen2-VL's special tokens and chat template, the image processor's
preprocessor_config.json); the checkpoint is a random ``HPSv3.safetensors`` with the authors'
key names (``visual.*``, ``model.*``, ``lm_head``, ``rm_head``) and a vocabulary grown by
``<|Reward|>``. The reference takes the route of the authors' ``HPSv3RewardInferencer``: pixels
from transformers' Qwen2-VL image processor, the chat template with the image placeholder
expanded from its grid, the vision tower loaded by transformers' own
``Qwen2VLForConditionalGeneration`` loader, then ``Qwen2VLRewardModelBT.forward`` written out: image
features scattered into the token embeddings, the decoder (plain torch, from its formulas) at the
sequential positions transformers 4.45.2 gives ``position_ids=None``, the head applied at every
position and read at the reward token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import reward_models
from diffalign.errors import RewardError
from reward_models.hpsv3 import HPSV3_PIXELS, HPSv3, Qwen2VLPatches, hpsv3_key, hpsv3_text

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template, reduced to text and image parts.
TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
            "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
            "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
            "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)  # not CLIP's, so an ignored preprocessor_config shows
SIDE = 448  # sqrt(256 * 28 * 28): square images at HPSv3's pixel budget need no resize
PROMPTS = ["a red cat", "two dogs on a mat"]


def tiny_tokenizer():
    """Byte-level Qwen2 tokenizer (every byte one token, no merges) with Qwen2-VL's special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_tokens(SPECIALS, special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_config(tokenizer, vocab_size):
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def authors_state(config, seed=0) -> dict[str, torch.Tensor]:
    """A random Qwen2VLRewardModelBT state dict in the transformers < 4.52 layout HPSv3 was saved in."""
    from transformers import Qwen2VLModel

    torch.manual_seed(seed)
    backbone = Qwen2VLModel(config)
    state = {}
    for key, value in backbone.state_dict().items():
        if key.startswith("visual."):
            state[key] = value
        else:
            state["model." + key.removeprefix("language_model.")] = value
    hidden, g = config.text_config.hidden_size, torch.Generator().manual_seed(seed + 1)
    for key in [k for k in state if k.startswith("model.layers.") and k.endswith(("q_proj.weight", "k_proj.weight"))]:
        state[key] = torch.randn(state[key].shape, generator=g) * 0.5  # sharp attention: positions move the scores
    state["lm_head.weight"] = torch.randn(config.text_config.vocab_size, hidden, generator=g) * 0.02
    for index, (inp, out) in zip((0, 3, 5), ((hidden, 1024), (1024, 16), (16, 2))):
        state[f"rm_head.{index}.weight"] = torch.randn(out, inp, generator=g) / math.sqrt(inp)
        state[f"rm_head.{index}.bias"] = torch.randn(out, generator=g) * 0.1
    return {k: v.contiguous() for k, v in state.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(base folder, checkpoint file, state dict)."""
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    base, ckpt_dir = tmp_path_factory.mktemp("Qwen2-VL-7B-Instruct"), tmp_path_factory.mktemp("HPSv3")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(base)
    tiny_config(tokenizer, len(tokenizer) + 40).save_pretrained(base)  # the base's embedding matrix is padded
    Qwen2VLImageProcessorPil(image_mean=list(MEAN), image_std=list(STD)).save_pretrained(base)
    state = authors_state(tiny_config(tokenizer, len(tokenizer) + 1))  # + <|Reward|>
    save_file(state, str(ckpt_dir / "HPSv3.safetensors"))
    return base, ckpt_dir / "HPSv3.safetensors", state


def _uint8_images(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, SIDE, SIDE), generator=g).float() / 255


def authors_inputs(base, images, prompts):
    """Tokens and patch rows as the authors' inferencer builds them: transformers' Qwen2-VL image
    processor and the chat template with the image placeholder expanded from its grid."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.add_tokens(["<|Reward|>"], special_tokens=True)
    processor = Qwen2VLImageProcessorPil.from_pretrained(base)
    arrays = [(im * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for im in images]
    vision = processor(arrays, return_tensors="pt", size={"shortest_edge": HPSV3_PIXELS, "longest_edge": HPSV3_PIXELS})
    texts = []
    for prompt, grid in zip(prompts, vision["image_grid_thw"]):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(prompt)}]}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        texts.append(chat.replace("<|image_pad|>", "<|image_pad|>" * int(grid.prod() // 4)))
    return tokenizer, tokenizer(texts, padding=True, return_tensors="pt"), vision


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def authors_decoder(config, state, embeds, attention_mask):
    """The Qwen2 decoder the authors' forward runs, written out from its formulas, at the positions
    transformers 4.45.2 gives ``Qwen2VLModel(inputs_embeds=..., position_ids=None)``: ``0 .. L-1``
    for every token in all three M-RoPE sections, where M-RoPE is plain rotary embedding."""
    text = config.text_config
    heads, kv_heads, eps = text.num_attention_heads, text.num_key_value_heads, text.rms_norm_eps
    theta = text.rope_parameters["rope_theta"]
    b, length, hidden = embeds.shape
    d = hidden // heads

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def w(name):
        return state[f"model.{name}"]

    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]  # 4.45.2: cache_position
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # (L, d)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, L, L)
    x = embeds
    for i in range(text.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = F.linear(h, w(p + "self_attn.q_proj.weight"), w(p + "self_attn.q_proj.bias")).view(b, length, heads, d)
        k = F.linear(h, w(p + "self_attn.k_proj.weight"), w(p + "self_attn.k_proj.bias")).view(b, length, kv_heads, d)
        v = F.linear(h, w(p + "self_attn.v_proj.weight"), w(p + "self_attn.v_proj.bias")).view(b, length, kv_heads, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, L, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + F.linear(attn.transpose(1, 2).reshape(b, length, hidden), w(p + "self_attn.o_proj.weight"))
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        gate = F.linear(h, w(p + "mlp.gate_proj.weight"))
        x = x + F.linear(F.silu(gate) * F.linear(h, w(p + "mlp.up_proj.weight")), w(p + "mlp.down_proj.weight"))
    return rms(x, w("norm.weight"))


def reference_mu(base, state, images, prompts, stock_positions=False):
    """``Qwen2VLRewardModelBT.forward`` on the same files: embed the tokens, scatter the vision
    tower's features into the image placeholders, run the decoder on ``inputs_embeds`` with
    ``position_ids=None`` (4.45.2's sequential positions), apply ``rm_head`` at every position and
    read it at ``<|Reward|>``. ``stock_positions=True`` runs today's ``Qwen2VLModel`` instead, which
    computes 3D image positions (M-RoPE) from the grid."""
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer, batch, vision = authors_inputs(base, images, prompts)
    config = tiny_config(tokenizer, len(tokenizer))
    model, info = Qwen2VLForConditionalGeneration.from_pretrained(None, config=config, state_dict=state,
                                                                  dtype=torch.float32, output_loading_info=True)
    # transformers converted the old layout itself; only the reward head is not its
    assert not info["missing_keys"] and {k.split(".")[0] for k in info["unexpected_keys"]} == {"rm_head"}, info
    model.eval()
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        if stock_positions:
            hidden = model.model(input_ids=input_ids, attention_mask=mask, pixel_values=vision["pixel_values"],
                                 image_grid_thw=vision["image_grid_thw"],
                                 mm_token_type_ids=(input_ids == config.image_token_id).int()).last_hidden_state
        else:
            embeds = F.embedding(input_ids, state["model.embed_tokens.weight"])
            image_embeds = model.model.visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
            image_mask = (input_ids == config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(image_mask, image_embeds)
            hidden = authors_decoder(config, state, embeds, mask)
    h = F.relu(F.linear(hidden, state["rm_head.0.weight"], state["rm_head.0.bias"]))
    h = F.relu(F.linear(h, state["rm_head.3.weight"], state["rm_head.3.bias"]))
    logits = F.linear(h, state["rm_head.5.weight"], state["rm_head.5.bias"])  # (B, L, 2)
    reward_mask = input_ids == tokenizer.convert_tokens_to_ids("<|Reward|>")
    return logits[reward_mask].view(len(prompts), -1)[:, 0]


def test_keys_map_in_both_transformers_layouts():
    assert hpsv3_key("visual.blocks.0.attn.qkv.weight") == "backbone.visual.blocks.0.attn.qkv.weight"
    assert hpsv3_key("model.layers.1.mlp.up_proj.weight") == "backbone.language_model.layers.1.mlp.up_proj.weight"
    assert hpsv3_key("model.visual.merger.ln_q.weight") == "backbone.visual.merger.ln_q.weight"
    assert hpsv3_key("model.language_model.norm.weight") == "backbone.language_model.norm.weight"
    assert hpsv3_key("rm_head.5.weight") == "rm_head.5.weight" and hpsv3_key("lm_head.weight") is None
    with pytest.raises(KeyError):
        hpsv3_key("value_head.weight")
    text = hpsv3_text("a cat")
    assert "Textual prompt - a cat\n\n\n\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n" in text
    assert "being the best. \n\n**Visual Quality:**  \n" in text and text.startswith("\nYou are tasked")


def test_patches_match_the_qwen2vl_image_processor(files):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    base, _, _ = files
    images = _uint8_images(2)
    rows, grid = Qwen2VLPatches(mean=MEAN, std=STD)(images)
    processor = Qwen2VLImageProcessorPil.from_pretrained(base)
    arrays = [(im * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for im in images]
    expected = processor(arrays, return_tensors="pt", size={"shortest_edge": HPSV3_PIXELS, "longest_edge": HPSV3_PIXELS})
    assert grid.tolist() == expected["image_grid_thw"].tolist() == [[1, 32, 32]] * 2
    torch.testing.assert_close(rows, torch.as_tensor(np.asarray(expected["pixel_values"])).float(), atol=1e-5, rtol=1e-5)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patches = Qwen2VLPatches()
    for size in ((1024, 1024), (512, 768), (40, 60), (1000, 333)):
        assert patches.target_size(*size) == smart_resize(*size, 28, HPSV3_PIXELS, HPSV3_PIXELS)
    assert patches.target_size(512, 768) == (364, 532)  # 13 x 19 merged tokens: area within the budget
    assert patches(torch.rand(1, 3, 40, 60))[1].tolist() == [[1, 28, 40]]  # upsized to 392 x 560


def test_scores_match_the_authors_route_and_are_differentiable(files):
    base, ckpt, state = files
    assert "hpsv3" in reward_models.available()
    reward = reward_models.build("hpsv3", checkpoint=str(ckpt), base=str(base), batch_size=1)
    images = _uint8_images(2)
    expected = reference_mu(base, state, images, PROMPTS)
    got = reward(images, PROMPTS, [{}, {}])
    assert got.shape == (2,) and got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the 3D image positions of today's stock forward give other scores: the reference can tell them apart
    assert (reference_mu(base, state, images, PROMPTS, stock_positions=True) - expected).abs().max() > 1e-3
    assert abs(float(got[0] - got[1])) > 1e-4 and reward.last_info["hpsv3_sigma"] > 0

    templated = reward.chat_text("a red cat", 3)
    template, reward.tokenizer.chat_template = reward.tokenizer.chat_template, None
    try:  # without a template in the tokenizer, Qwen2-VL's layout is written out: the same text
        assert reward.chat_text("a red cat", 3) == templated and templated.count("<|image_pad|>") == 3
    finally:
        reward.tokenizer.chat_template = template

    pixels = images[:1].clone().requires_grad_(True)
    reward.score(pixels, PROMPTS[:1]).sum().backward()
    assert torch.isfinite(pixels.grad).all() and pixels.grad.abs().sum() > 0


def test_non_square_images_match_the_authors_route(files):
    base, ckpt, state = files
    reward = reward_models.build("hpsv3", checkpoint=str(ckpt), base=str(base), batch_size=2)
    g = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (2, 3, 224, 896), generator=g).float() / 255  # 8 x 32 merged tokens: the budget
    prompts = ["a long red train", "a wide river"]
    expected = reference_mu(base, state, images, prompts)
    torch.testing.assert_close(reward(images, prompts, [{}, {}]), expected, atol=1e-5, rtol=1e-5)
    assert (reference_mu(base, state, images, prompts, stock_positions=True) - expected).abs().max() > 1e-3


def test_new_layout_folder_and_bad_inputs(files, tmp_path):
    from safetensors.torch import save_file

    base, ckpt, state = files
    renamed = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.")
               else ("model." + k) if k.startswith("visual.") else k: v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "HPSv3.safetensors"))
    images = _uint8_images(1, seed=3)
    old = HPSv3(checkpoint=str(ckpt), base=str(base))(images, PROMPTS[:1], [{}])
    new = HPSv3(checkpoint=str(tmp_path), base=str(base))(images, PROMPTS[:1], [{}])  # a folder holding the file
    torch.testing.assert_close(new, old)

    with pytest.raises(RewardError, match="hpsv3: weights file .*nothing.safetensors' does not exist"):
        HPSv3(checkpoint=str(tmp_path / "nothing.safetensors"), base=str(base))
    save_file({**state, "value_head.weight": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(RewardError, match=r"no HPSv3 part: \['value_head.weight'\]"):
        HPSv3(checkpoint=str(tmp_path / "extra.safetensors"), base=str(base))
    grown = dict(state, **{"model.embed_tokens.weight": torch.zeros(state["model.embed_tokens.weight"].shape[0] + 1, 32)})
    save_file(grown, str(tmp_path / "grown.safetensors"))
    with pytest.raises(RewardError, match="embeds .* tokens but the tokenizer"):
        HPSv3(checkpoint=str(tmp_path / "grown.safetensors"), base=str(base))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(RewardError, match=r"does not fit .*language_model.norm.weight"):
        HPSv3(checkpoint=str(tmp_path / "missing.safetensors"), base=str(base))
    reward = HPSv3(checkpoint=str(ckpt), base=str(base))
    with pytest.raises(RewardError, match="prompt contains the reward token"):
        reward(images, ["cheat <|Reward|>"], [{}])
    with pytest.raises(RewardError, match="got 1 images but 2 prompts"):
        reward(images, PROMPTS, [{}, {}])
