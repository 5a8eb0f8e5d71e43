"""Token counts of a published model at a recipe's size: what the denoiser's blocks see per row.

Image tokens follow each family's latent layout (VAE downsampling in space and time, then the
denoiser's patches); text tokens the adapter's prompt length, because every transformer family here
runs its text stream at the blocks' width (joint attention, a unified sequence, or cross-attention
keys and values). A UNet's "tokens" are its latent pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffalign.adapters.flux import FLUX_MAX_SEQUENCE_LENGTH
from diffalign.adapters.hunyuan_video import HUNYUAN_MAX_SEQUENCE_LENGTH, HUNYUAN_NUM_FRAMES
from diffalign.adapters.ltx import LTX_MAX_SEQUENCE_LENGTH, LTX_NUM_FRAMES
from diffalign.adapters.qwen import QWEN_MAX_SEQUENCE_LENGTH
from diffalign.adapters.sana import SANA_MAX_SEQUENCE_LENGTH
from diffalign.adapters.sd3 import SD3_MAX_SEQUENCE_LENGTH
from diffalign.adapters.wan import WAN_MAX_SEQUENCE_LENGTH, WAN_NUM_FRAMES
from diffalign.adapters.zimage import ZIMAGE_MAX_SEQUENCE_LENGTH

CLIP_TOKENS = 77  # every CLIP text encoder's length


@dataclass(frozen=True)
class Layout:
    """A family's latent layout: pixels per latent pixel (space, time), patch side, frames by default,
    the text tokens by default and whether the source image's tokens join the sequence."""

    vae: int  # VAE downsampling per side
    patch: int  # the denoiser's patch side (FLUX's 2x2 packing counts as a patch of 2)
    channels: int  # latent channels
    text_tokens: int
    temporal: int = 0  # video: frames per latent frame (the first frame is kept); 0 = an image model
    frames: int = 1  # default num_frames
    source_image: bool = False  # an editing model: the source image's tokens are appended
    decode_frames: int = 0  # frames the VAE decodes at once (a causal video VAE: one latent frame); 0 = all

    @property
    def spatial(self) -> int:
        return self.vae * self.patch


LAYOUTS: dict[str, Layout] = {
    "sd3": Layout(8, 2, 16, CLIP_TOKENS + SD3_MAX_SEQUENCE_LENGTH),  # CLIP tokens then T5 tokens
    "flux": Layout(8, 2, 16, FLUX_MAX_SEQUENCE_LENGTH),
    "flux_kontext": Layout(8, 2, 16, FLUX_MAX_SEQUENCE_LENGTH),  # + the context image when prompts carry one
    "flux2": Layout(8, 2, 32, 512),
    "qwen": Layout(8, 2, 16, QWEN_MAX_SEQUENCE_LENGTH, decode_frames=1),
    "qwen_edit": Layout(8, 2, 16, QWEN_MAX_SEQUENCE_LENGTH, source_image=True, decode_frames=1),
    "zimage": Layout(8, 2, 16, ZIMAGE_MAX_SEQUENCE_LENGTH),
    "sana": Layout(32, 1, 32, SANA_MAX_SEQUENCE_LENGTH),  # DC-AE 32x, patch 1
    "wan": Layout(8, 2, 16, WAN_MAX_SEQUENCE_LENGTH, temporal=4, frames=WAN_NUM_FRAMES, decode_frames=4),
    "hunyuan_video": Layout(8, 2, 16, HUNYUAN_MAX_SEQUENCE_LENGTH, temporal=4, frames=HUNYUAN_NUM_FRAMES),
    "ltx": Layout(32, 1, 128, LTX_MAX_SEQUENCE_LENGTH, temporal=8, frames=LTX_NUM_FRAMES),
    "sd15": Layout(8, 1, 4, CLIP_TOKENS),  # UNet: latent pixels
    "sdxl": Layout(8, 1, 4, CLIP_TOKENS),
}


def latent_frames(layout: Layout, frames: int) -> int:
    return (frames - 1) // layout.temporal + 1 if layout.temporal else 1


def tokens(family: str, resolution: int, options: dict, *, source_image: bool = False) -> tuple[int, int]:
    """``(image tokens, text tokens)`` per row for a square ``resolution`` and the adapter ``options``."""
    layout = LAYOUTS[family]
    frames = int(options.get("num_frames", layout.frames))
    image = latent_frames(layout, frames) * (resolution // layout.spatial) ** 2
    if layout.source_image or source_image:
        image *= 2
    text = int(options.get("max_sequence_length", layout.text_tokens - (CLIP_TOKENS if family == "sd3" else 0)))
    return image, text + (CLIP_TOKENS if family == "sd3" else 0)


def latent_elements(family: str, resolution: int, options: dict) -> int:
    """Latent elements of one sample: channels x latent frames x latent pixels."""
    layout = LAYOUTS[family]
    frames = latent_frames(layout, int(options.get("num_frames", layout.frames)))
    return layout.channels * frames * (resolution // layout.vae) ** 2


def decoded_frames(family: str, options: dict) -> int:
    """Frames the VAE decodes at once."""
    layout = LAYOUTS[family]
    return layout.decode_frames or int(options.get("num_frames", layout.frames))
