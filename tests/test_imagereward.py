"""ImageReward on a tiny random checkpoint in the authors' format, against a plain reference.

The checkpoint is built here key by key with the names of the authors' ``ImageReward`` module
(BLIP's timm-style ViT ``blip.visual_encoder.*``, BLIP's med BERT ``blip.text_encoder.*``, the
contrastive projections, ``mlp.layers.*``), saved with ``torch.save`` beside a ``med_config.json``
and a BERT tokenizer folder, and loaded through the reward's real loading path. The reference
forward below is written from BLIP's ``models/vit.py`` / ``models/med.py`` and ImageReward's
``score`` with plain torch functions on the checkpoint's own tensors, so a wrong key mapping (say
norm1 and norm2 swapped) changes the scores.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import reward_models
from diffalign.errors import RewardError
from reward_models.imagereward import ImageReward, ImageRewardModel, imagereward_key, load_imagereward_model

IMAGE, PATCH, VIT_WIDTH, VIT_HEADS, VIT_MLP, VIT_LAYERS = 32, 8, 32, 2, 48, 2
TEXT_WIDTH, TEXT_HEADS, TEXT_MLP, TEXT_LAYERS, TEXT_POSITIONS = 32, 2, 40, 2, 40
PROJ = 16  # BLIP's contrastive projection width (256 in the real model): in the file, not in the score
TINY_VIT = dict(image_size=IMAGE, patch_size=PATCH, hidden_size=VIT_WIDTH, intermediate_size=VIT_MLP,
                num_hidden_layers=VIT_LAYERS, num_attention_heads=VIT_HEADS)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "cat", "dog", "on", "the", "mat", "##s"]
MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's normalisation, written out again here
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
PROMPTS = ["a red cat on the mat", "blue dogs"]


def imagereward_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with the key names and shapes of the authors' ImageReward module."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def put(name, *shape, kind="weight"):
        if kind == "norm":  # LayerNorm weight near 1
            state[name] = 1 + 0.1 * torch.randn(*shape, generator=g)
        elif kind == "bias":
            state[name] = 0.1 * torch.randn(*shape, generator=g)
        else:  # weights scaled by 1/sqrt(fan-in) so activations stay O(1)
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            state[name] = torch.randn(*shape, generator=g) / math.sqrt(fan_in)

    def linear(name, out, inp):
        put(f"{name}.weight", out, inp)
        put(f"{name}.bias", out, kind="bias")

    def norm(name, width):
        put(f"{name}.weight", width, kind="norm")
        put(f"{name}.bias", width, kind="bias")

    v = "blip.visual_encoder."
    put(v + "cls_token", 1, 1, VIT_WIDTH, kind="bias")
    put(v + "pos_embed", 1, (IMAGE // PATCH) ** 2 + 1, VIT_WIDTH, kind="bias")
    put(v + "patch_embed.proj.weight", VIT_WIDTH, 3, PATCH, PATCH)
    put(v + "patch_embed.proj.bias", VIT_WIDTH, kind="bias")
    for i in range(VIT_LAYERS):
        b = f"{v}blocks.{i}."
        norm(b + "norm1", VIT_WIDTH)
        linear(b + "attn.qkv", 3 * VIT_WIDTH, VIT_WIDTH)
        linear(b + "attn.proj", VIT_WIDTH, VIT_WIDTH)
        norm(b + "norm2", VIT_WIDTH)
        linear(b + "mlp.fc1", VIT_MLP, VIT_WIDTH)
        linear(b + "mlp.fc2", VIT_WIDTH, VIT_MLP)
    norm(v + "norm", VIT_WIDTH)
    t = "blip.text_encoder."
    put(t + "embeddings.word_embeddings.weight", len(WORDS) + 2, TEXT_WIDTH, kind="bias")
    put(t + "embeddings.position_embeddings.weight", TEXT_POSITIONS, TEXT_WIDTH, kind="bias")
    state[t + "embeddings.position_ids"] = torch.arange(TEXT_POSITIONS).unsqueeze(0)  # older transformers saved it
    norm(t + "embeddings.LayerNorm", TEXT_WIDTH)
    for i in range(TEXT_LAYERS):
        b = f"{t}encoder.layer.{i}."
        for part, kv_width in (("attention", TEXT_WIDTH), ("crossattention", VIT_WIDTH)):
            linear(f"{b}{part}.self.query", TEXT_WIDTH, TEXT_WIDTH)
            linear(f"{b}{part}.self.key", TEXT_WIDTH, kv_width)
            linear(f"{b}{part}.self.value", TEXT_WIDTH, kv_width)
            linear(f"{b}{part}.output.dense", TEXT_WIDTH, TEXT_WIDTH)
            norm(f"{b}{part}.output.LayerNorm", TEXT_WIDTH)
        linear(b + "intermediate.dense", TEXT_MLP, TEXT_WIDTH)
        linear(b + "output.dense", TEXT_WIDTH, TEXT_MLP)
        norm(b + "output.LayerNorm", TEXT_WIDTH)
    linear("blip.vision_proj", PROJ, VIT_WIDTH)
    linear("blip.text_proj", PROJ, TEXT_WIDTH)
    widths = (TEXT_WIDTH, 1024, 128, 64, 16, 1)
    for index, (inp, out) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:])):
        linear(f"mlp.layers.{index}", out, inp)
    return state


def med_config() -> dict:
    """A BLIP med_config.json (BERT fields + add_cross_attention) at the tiny sizes."""
    return {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "hidden_size": TEXT_WIDTH, "initializer_range": 0.02,
            "intermediate_size": TEXT_MLP, "layer_norm_eps": 1e-12, "max_position_embeddings": TEXT_POSITIONS,
            "model_type": "bert", "num_attention_heads": TEXT_HEADS, "num_hidden_layers": TEXT_LAYERS,
            "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(WORDS) + 2, "encoder_width": VIT_WIDTH,
            "add_cross_attention": True}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(folder with ImageReward.pt + med_config.json, tokenizer folder, the state dict)."""
    from transformers import BertTokenizer

    folder, tokenizer_dir = tmp_path_factory.mktemp("ImageReward"), tmp_path_factory.mktemp("bert")
    state = imagereward_state()
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(med_config()))
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(tokenizer_dir)
    return folder, tokenizer_dir, state


# ---------------------------------------------------------------- plain reference (BLIP + ImageReward.score)

def _ln(x, sd, name, eps):
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)


def _lin(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])


def _attention(q, k, v, heads, bias=None):
    b, lq, d = q.shape
    split = lambda t: t.view(b, -1, heads, d // heads).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads)
    if bias is not None:
        scores = scores + bias
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, lq, d)


def vit_reference(sd, pixels):
    """BLIP's VisionTransformer.forward: patches + [CLS] + positions, pre-norm blocks, final norm."""
    p = "blip.visual_encoder."
    x = F.conv2d(pixels, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"], stride=PATCH)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd[p + "cls_token"].expand(len(x), -1, -1), x], dim=1) + sd[p + "pos_embed"]
    for i in range(VIT_LAYERS):
        b = f"{p}blocks.{i}."
        q, k, v = _lin(_ln(x, sd, b + "norm1", 1e-6), sd, b + "attn.qkv").chunk(3, dim=-1)
        x = x + _lin(_attention(q, k, v, VIT_HEADS), sd, b + "attn.proj")
        x = x + _lin(F.gelu(_lin(_ln(x, sd, b + "norm2", 1e-6), sd, b + "mlp.fc1")), sd, b + "mlp.fc2")
    return _ln(x, sd, p + "norm", 1e-6)


def bert_reference(sd, ids, mask, image_embeds):
    """BLIP's med BertModel in multimodal mode: post-norm layers, self-attention over the unpadded
    tokens, cross-attention to every image token, GELU feed-forward."""
    p = "blip.text_encoder."
    x = sd[p + "embeddings.word_embeddings.weight"][ids] + sd[p + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    x = _ln(x, sd, p + "embeddings.LayerNorm", 1e-12)
    pad_bias = (1.0 - mask[:, None, None, :].float()) * -1e9
    for i in range(TEXT_LAYERS):
        b = f"{p}encoder.layer.{i}."
        s = _attention(_lin(x, sd, b + "attention.self.query"), _lin(x, sd, b + "attention.self.key"),
                       _lin(x, sd, b + "attention.self.value"), TEXT_HEADS, pad_bias)
        x = _ln(_lin(s, sd, b + "attention.output.dense") + x, sd, b + "attention.output.LayerNorm", 1e-12)
        c = _attention(_lin(x, sd, b + "crossattention.self.query"), _lin(image_embeds, sd, b + "crossattention.self.key"),
                       _lin(image_embeds, sd, b + "crossattention.self.value"), TEXT_HEADS)
        x = _ln(_lin(c, sd, b + "crossattention.output.dense") + x, sd, b + "crossattention.output.LayerNorm", 1e-12)
        h = F.gelu(_lin(x, sd, b + "intermediate.dense"))
        x = _ln(_lin(h, sd, b + "output.dense") + x, sd, b + "output.LayerNorm", 1e-12)
    return x


def head_reference(sd, features):
    """ImageReward's MLP (linear layers 0, 2, 4, 6, 7; dropout off) and its normalisation."""
    for index in (0, 2, 4, 6, 7):
        features = _lin(features, sd, f"mlp.layers.{index}")
    return (features.squeeze(-1) - MEAN) / STD


def reference_scores(sd, tokenizer, images, prompts):
    pixels = (images - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    text = bert_reference(sd, tokens["input_ids"], tokens["attention_mask"], vit_reference(sd, pixels))
    return head_reference(sd, text[:, 0])


def _images(batch=2, size=IMAGE, seed=0):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- tests

def test_every_checkpoint_key_has_a_place_and_every_weight_is_loaded(files):
    folder, _, state = files
    mapped = {key: imagereward_key(key) for key in state}
    dropped = sorted(k for k, target in mapped.items() if target is None)
    assert dropped == ["blip.text_encoder.embeddings.position_ids", "blip.text_proj.bias", "blip.text_proj.weight",
                       "blip.vision_proj.bias", "blip.vision_proj.weight"]
    model = load_imagereward_model(str(folder), vision_config=TINY_VIT)
    targets = {t for t in mapped.values() if t is not None}
    assert targets == set(model.state_dict())  # no weight left at its random init, none unplaced
    assert len(targets) == len(state) - len(dropped)  # one checkpoint key per model key
    loaded = model.state_dict()
    assert torch.equal(loaded["vision_model.encoder.layers.1.self_attn.projection.weight"],
                       state["blip.visual_encoder.blocks.1.attn.proj.weight"])
    assert torch.equal(loaded["vision_model.embeddings.class_embedding"], state["blip.visual_encoder.cls_token"])


def test_unknown_checkpoint_keys_are_named(files, tmp_path):
    folder, _, state = files
    torch.save({**state, "blip.itm_head.weight": torch.zeros(2, TEXT_WIDTH)}, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps(med_config()))
    with pytest.raises(RewardError, match=r"imagereward: .*ImageReward.pt.* no ImageReward part: \['blip.itm_head.weight'\]"):
        load_imagereward_model(str(tmp_path / "ImageReward.pt"), vision_config=TINY_VIT)
    with pytest.raises(KeyError):
        imagereward_key("blip.visual_encoder.blocks.0.attn.q_bias")


def test_scores_match_the_reference_and_are_differentiable(files):
    folder, tokenizer_dir, state = files
    assert "imagereward" in reward_models.available()
    reward = reward_models.build("imagereward", checkpoint=str(folder / "ImageReward.pt"), tokenizer=str(tokenizer_dir),
                                 vision_config=TINY_VIT, batch_size=1)
    images = _images()
    expected = reference_scores(state, reward.tokenizer, images, PROMPTS)
    with torch.no_grad():
        got = reward(images, PROMPTS, [{}, {}])
    assert got.dtype == torch.float32 and got.shape == (2,) and not got.requires_grad
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert abs(float(got[0] - got[1])) > 1e-3  # the two pairs differ: a constant score would not pass

    pixels = images.clone().requires_grad_(True)
    reward.score(pixels, PROMPTS).sum().backward()
    assert torch.isfinite(pixels.grad).all() and pixels.grad.abs().sum() > 0

    other = reward(_images(size=48)[:, :, :, :40], PROMPTS, [{}, {}])  # resized (bicubic) and centre-cropped
    assert other.shape == (2,) and torch.isfinite(other).all()


def torchvision_center_crop(images, size):
    """torchvision's ``CenterCrop(size)`` offsets, as BLIP's transform in ImageReward runs them:
    ``int(round((side - size) / 2.0))`` with Python's round (half to even)."""
    height, width = images.shape[-2:]
    top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    return images[..., top:top + size, left:left + size]


@pytest.mark.parametrize("height, width", [(IMAGE, IMAGE + 7), (IMAGE + 11, IMAGE), (IMAGE + 5, IMAGE)])
def test_non_square_images_are_cropped_as_the_authors_crop(files, height, width):
    """Shortest side already at the model's size, so no resampling: the authors' preprocessing is
    the centre crop alone. A long side 7 or 11 pixels over puts torchvision's offset (4, 6) one
    pixel past transformers' (3, 5); 5 over rounds to the same offset (2)."""
    folder, tokenizer_dir, state = files
    reward = reward_models.build("imagereward", checkpoint=str(folder / "ImageReward.pt"), tokenizer=str(tokenizer_dir),
                                 vision_config=TINY_VIT, batch_size=2)
    g = torch.Generator().manual_seed(height * 100 + width)
    images = torch.randint(0, 256, (2, 3, height, width), generator=g).float() / 255
    expected = reference_scores(state, reward.tokenizer, torchvision_center_crop(images, IMAGE), PROMPTS)
    with torch.no_grad():
        got = reward(images, PROMPTS, [{}, {}])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if (max(height, width) - IMAGE) % 4 == 3:  # the floor offset would have scored other pixels
        floor = images[..., (height - IMAGE) // 2:(height - IMAGE) // 2 + IMAGE, (width - IMAGE) // 2:(width - IMAGE) // 2 + IMAGE]
        assert (reference_scores(state, reward.tokenizer, floor, PROMPTS) - expected).abs().max() > 1e-4


def test_sdxl_sized_images_use_torchvision_offsets(files):
    """SDXL's 832 x 1216 resizes to 224 x 327 at the real model's size: 103 pixels over, offset 52."""
    from reward_models.clip_score import CLIP_MEAN as MEAN_, CLIP_STD as STD_, ClipImageTransform

    transform = ClipImageTransform(resize=224, crop=(224, 224), mean=MEAN_, std=STD_, crop_offsets="torchvision")
    images = torch.rand(1, 3, 224, 327, generator=torch.Generator().manual_seed(1))
    expected = (images[..., :, 52:276] - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(transform(images), expected)
    torch.testing.assert_close(transform(images.transpose(-1, -2)), expected.transpose(-1, -2))
    folder, tokenizer_dir, _ = files
    reward = ImageReward(checkpoint=str(folder / "ImageReward.pt"), tokenizer=str(tokenizer_dir), vision_config=TINY_VIT)
    assert reward.transform.crop_offsets == "torchvision"
    with pytest.raises(RewardError, match="crop_offsets must be one of"):
        ClipImageTransform(resize=224, crop=(224, 224), crop_offsets="ceil")


def test_head_and_normalisation_on_a_known_embedding(files):
    folder, _, state = files
    model = load_imagereward_model(str(folder), vision_config=TINY_VIT)
    features = torch.linspace(-1.0, 1.0, 2 * TEXT_WIDTH).view(2, TEXT_WIDTH)
    expected = head_reference({k: v.double() for k, v in state.items() if k.startswith("mlp.")}, features.double())
    torch.testing.assert_close(model.rewards_from_features(features).double(), expected, atol=1e-5, rtol=1e-5)
    zero_head = {f"mlp.layers.{i}.{p}": torch.zeros_like(state[f"mlp.layers.{i}.{p}"]) for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}
    model.load_state_dict(zero_head, strict=False)
    assert torch.allclose(model.rewards_from_features(features), torch.full((2,), -MEAN / STD))  # (0 - mu) / sigma


def test_hub_repo_id_downloads_both_files(files, monkeypatch):
    import huggingface_hub

    folder, tokenizer_dir, _ = files
    asked = []

    def fake_download(repo_id, filename, **kwargs):  # the hub, served from the local folder
        asked.append((repo_id, filename))
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    hub = ImageReward(tokenizer=str(tokenizer_dir), vision_config=TINY_VIT)  # checkpoint defaults to THUDM/ImageReward
    assert asked == [("THUDM/ImageReward", "ImageReward.pt"), ("THUDM/ImageReward", "med_config.json")]
    local = ImageReward(checkpoint=str(folder), tokenizer=str(tokenizer_dir), vision_config=TINY_VIT)
    images = _images(seed=1)
    torch.testing.assert_close(hub(images, PROMPTS, [{}, {}]), local(images, PROMPTS, [{}, {}]))


def test_bfloat16_is_close_to_float32(files):
    folder, tokenizer_dir, _ = files
    images = _images(seed=2)
    fp32 = ImageReward(checkpoint=str(folder), tokenizer=str(tokenizer_dir), vision_config=TINY_VIT)
    bf16 = ImageReward(checkpoint=str(folder), tokenizer=str(tokenizer_dir), vision_config=TINY_VIT, dtype="bf16")
    assert bf16.model.vision_model.dtype == torch.bfloat16 and bf16.model.mlp.layers[0].weight.dtype == torch.float32
    a, b = fp32(images, PROMPTS, [{}, {}]), bf16(images, PROMPTS, [{}, {}])
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * (1 + a.abs().max())


def test_bad_files_and_settings_are_named(files, tmp_path):
    folder, tokenizer_dir, state = files
    with pytest.raises(RewardError, match="imagereward: weights file .*no_such.pt' does not exist"):
        load_imagereward_model(str(tmp_path / "no_such.pt"))
    with pytest.raises(RewardError, match=f"imagereward: folder .* has no ImageReward.pt"):
        load_imagereward_model(str(tmp_path))
    torch.save(state, tmp_path / "alone.pt")
    with pytest.raises(RewardError, match="no med_config.json beside .*alone.pt.*pass med_config=PATH"):
        load_imagereward_model(str(tmp_path / "alone.pt"))
    (tmp_path / "plain_bert.json").write_text(json.dumps({**med_config(), "add_cross_attention": False}))
    with pytest.raises(RewardError, match="has no cross-attention"):
        load_imagereward_model(str(tmp_path / "alone.pt"), med_config=str(tmp_path / "plain_bert.json"))
    with pytest.raises(RewardError, match="does not fit the model"):
        load_imagereward_model(str(folder), vision_config={**TINY_VIT, "hidden_size": 48, "num_attention_heads": 3})
    with pytest.raises(RewardError, match=r"unknown vision_config fields \['depth'\]"):
        load_imagereward_model(str(folder), vision_config={"depth": 2})
    with pytest.raises(RewardError, match="imagereward: got 2 images but 1 prompts"):
        ImageReward.from_components(load_imagereward_model(str(folder), vision_config=TINY_VIT),
                                    ImageReward(checkpoint=str(folder), tokenizer=str(tokenizer_dir),
                                                vision_config=TINY_VIT).tokenizer)(_images(), ["a"], [{}])
    assert isinstance(load_imagereward_model(str(folder), vision_config=TINY_VIT), ImageRewardModel)
