"""Size and speed of the ImageReward and HPSv3 rewards at their real sizes, on random weights.

    python benchmarks/reward_model_cost.py [--device cpu] [--dtype float32] [--batch 1,4] [--repeats 3]
                                           [--hpsv3-forward]

No weights are downloaded: the real architectures are built from their published sizes with random
weights, which cost the same time and memory as the trained ones.

- **ImageReward**: :class:`reward_models.imagereward.ImageRewardModel` with BLIP's ViT-L/16 and the
  ``med_config.json`` sizes (BERT-base, vocabulary 30524); prints the parameter count, the weights'
  memory in the chosen dtype and the median time of ``score`` per batch (images 512 x 512, resized
  to 224 as in training).
- **HPSv3**: ``Qwen2VLModel`` with Qwen2-VL-7B-Instruct's sizes (``config.json`` of the hub repo,
  written out below; vocabulary 151658 with ``<|Reward|>``) built on the meta device: parameter count
  and weights' memory. ``--hpsv3-forward`` also builds it for real and times one forward of the
  reward's input length (needs about 16 GB in bfloat16: a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reward_models.hpsv3 import HPSv3, HPSv3Model, hpsv3_text
from reward_models.imagereward import ImageReward, ImageRewardModel, blip_vision_config
from reward_models.loading import parse_dtype

# BLIP's med_config.json (THUDM/ImageReward): BERT-base with cross-attention.
MED = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
           max_position_embeddings=512)
# Qwen2-VL-7B-Instruct's config.json (text model and vision tower), vocabulary grown by <|Reward|>.
QWEN2VL_7B_TEXT = dict(vocab_size=151658, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6})
QWEN2VL_7B_VISION = dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2)
QWEN2VL_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)


class _CharTokenizer:
    """Stand-in tokenizer for timing: one token per 4 characters (about the Qwen2 BPE rate on English)."""

    chat_template = None

    def __init__(self, reward_id: int, image_id: int) -> None:
        self.reward_id, self.image_id = reward_id, image_id

    def __call__(self, texts, padding=True, return_tensors="pt"):
        rows = []
        for text in texts:
            images = text.count("<|image_pad|>")
            rest = text.replace("<|image_pad|>", "").replace("<|Reward|>", "")
            rows.append([7] * (len(rest) // 4) + [self.image_id] * images + [self.reward_id])
        ids = torch.tensor(rows)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _median_seconds(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median wall and CPU (this process, all threads) seconds of ``fn()``; on a shared CPU the CPU
    time is the steadier of the two."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def _size(model: torch.nn.Module, dtype: torch.dtype) -> tuple[int, float]:
    count = sum(p.numel() for p in model.parameters())
    return count, count * torch.finfo(dtype).bits / 8 / 2**30


def imagereward(device: torch.device, dtype: torch.dtype, batches: list[int], repeats: int) -> None:
    from transformers import BertTokenizer, BlipTextConfig

    text = BlipTextConfig(**MED, encoder_hidden_size=1024, is_decoder=True, bos_token_id=None, sep_token_id=None)
    model = ImageRewardModel(blip_vision_config(None), text)
    count, gib = _size(model, dtype)
    print(f"imagereward: {count / 1e6:.0f}M parameters, weights {gib:.2f} GiB in {dtype}")
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "cat"])})
    reward = ImageReward.from_components(model, tokenizer, device=device, dtype=dtype)
    for batch in batches:
        images = torch.rand(batch, 3, 512, 512, device=device)
        prompts = ["a cat " * 12] * batch  # truncated to 35 tokens, as every real prompt of that length
        with torch.no_grad():
            wall, cpu = _median_seconds(lambda: reward(images, prompts, [{}] * batch), repeats, device)
        print(f"imagereward: batch {batch}: {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU "
              f"({wall / batch * 1000:.0f} ms wall per image) on {device}, {torch.get_num_threads()} threads")


def hpsv3(device: torch.device, dtype: torch.dtype, forward: bool, repeats: int) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLModel

    config = Qwen2VLConfig(text_config=QWEN2VL_7B_TEXT, vision_config=QWEN2VL_7B_VISION, **QWEN2VL_IDS)
    with torch.device("meta"):
        meta = HPSv3Model(Qwen2VLModel(config), reward_token_id=151657)
    count, gib = _size(meta, dtype)
    vision = sum(p.numel() for p in meta.backbone.visual.parameters())
    print(f"hpsv3: {count / 1e9:.2f}B parameters ({vision / 1e9:.2f}B vision), weights {gib:.1f} GiB in {dtype}")
    text_tokens = len(hpsv3_text("a photo of a cat")) // 4
    print(f"hpsv3: input per image about {text_tokens} text tokens (4 characters per token) + 256 image tokens")
    if not forward:
        return
    model = HPSv3Model(Qwen2VLModel._from_config(config, dtype=dtype, attn_implementation="sdpa"), 151657)
    reward = HPSv3.from_components(model, _CharTokenizer(151657, 151655), device=device, dtype=dtype, batch_size=4)
    for batch in (1, 4):
        images = torch.rand(batch, 3, 512, 512, device=device)
        with torch.no_grad():
            wall, _ = _median_seconds(lambda: reward(images, ["a photo of a cat"] * batch, [{}] * batch), repeats, device)
        print(f"hpsv3: batch {batch}: {wall * 1000:.0f} ms wall on {device}")
    if device.type == "cuda":
        print(f"hpsv3: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,4", help="comma-separated ImageReward batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hpsv3-forward", action="store_true", help="build HPSv3 for real and time it (~16 GB)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    torch.manual_seed(0)
    imagereward(device, dtype, [int(b) for b in args.batch.split(",")], args.repeats)
    hpsv3(device, dtype, args.hpsv3_forward, args.repeats)


if __name__ == "__main__":
    main()
