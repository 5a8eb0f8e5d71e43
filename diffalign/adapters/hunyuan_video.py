"""HunyuanVideo text-to-video (``HunyuanVideoPipeline``): a guidance-distilled rectified-flow video DiT.

- Frames are one more latent axis, as for Wan and LTX-Video: one latent is ``(C, T, h, w)`` with
  ``C = 16``, ``T = (num_frames - 1) / 4 + 1`` and ``h = H / 8`` for the released VAE.
  ``num_frames`` is an adapter option (the pipeline's 129 by default; ``4k + 1``). The
  transformer patchifies (2x2) inside, so sizes are multiples of 16, as the pipeline asks.
- Text, through the pipeline's ``encode_prompt``: a Llama-3 (LLaVA) decoder reads each prompt
  inside the pipeline's system-prompt template; its third-to-last hidden states are kept after
  cropping the template's ``crop_start`` = 95 tokens, so ``max_sequence_length`` (256) prompt
  tokens remain, right-padded, with the attention mask the transformer uses to count them. CLIP
  ViT-L/14's pooled output (77 tokens) is the ``pooled_projections``.
- **Guidance.** HunyuanVideo is guidance-distilled: the pipeline's ``guidance_scale`` (6 by
  default) is a transformer *input* (``guidance = 1000 g``), not CFG. Here it is the adapter option
  ``guidance`` (as FLUX.1-dev's), fed at every step, in both halves of a CFG batch. The pipeline's
  optional true CFG (``true_cfg_scale`` with a ``negative_prompt``) is diffalign's
  ``sampling.guidance_scale``, ``uncond + g (cond - uncond)`` with the adapter option
  ``negative_prompt`` (``""``) in one batched forward; at 1 (the pipeline's default) it is off.
- The transformer gets the scheduler's ``1000 sigma``. Sigmas as ``HunyuanVideoPipeline`` sets
  them: ``linspace(1, 0, N + 1)[:-1]`` through the scheduler's static shift (7 for the released
  checkpoint), then 0.
- ``decode``: ``z / scaling_factor`` through the VAE (no shift), as the pipeline; videos
  ``(B, F, 3, H, W)`` in ``[0, 1]`` (frames second).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from ..errors import ModelLoadError
from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_decoder_config, tiny_llama_tokenizer
from ._util import module_dtype, scheduler_sigmas, vae_decode
from .base import ModelAdapter, PromptEmbeds

HUNYUAN_MAX_SEQUENCE_LENGTH = 256  # HunyuanVideoPipeline.__call__'s default Llama length (after the template crop)
HUNYUAN_NUM_FRAMES = 129  # HunyuanVideoPipeline.__call__'s default
HUNYUAN_GUIDANCE = 6.0  # HunyuanVideoPipeline.__call__'s default embedded guidance_scale
HUNYUAN_GUIDANCE_UNIT = 1000.0  # the pipeline feeds the transformer guidance_scale * 1000
HUNYUAN_CLIP_LENGTH = 77  # encode_prompt's CLIP length
HUNYUAN_SIZE_MULTIPLE = 16  # check_inputs: height and width divisible by 16
# Attention projections of the dual-stream blocks (video and text streams), the single-stream blocks
# and the text refiner, as diffusers' HunyuanVideo LoRA examples train them.
HUNYUAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


class HunyuanVideoAdapter(ModelAdapter):
    """Adapter for ``HunyuanVideoPipeline`` (HunyuanVideo T2V).

    Args:
        pipeline: a loaded ``HunyuanVideoPipeline``.
        num_frames: video frames per sample (``4k + 1`` for the released VAE; 129 by default).
        max_sequence_length: Llama tokens per prompt after the template crop (256).
        guidance: the embedded (distilled) guidance, the pipeline's ``guidance_scale`` (6).
        negative_prompt: the prompt of the true-CFG branch (``""``), used when
            ``sampling.guidance_scale > 1`` (the pipeline's ``true_cfg_scale``).
    """

    family = "hunyuan_video"
    prediction_type = "flow"
    default_resolution = 720  # the pipeline's default height (its default width is 1280; ours are square)
    default_lora_targets = HUNYUAN_LORA_TARGETS
    pipeline_class = "HunyuanVideoPipeline"
    options = ("num_frames", "max_sequence_length", "guidance", "negative_prompt")
    display_name = "HunyuanVideo"

    def __init__(
        self,
        pipeline,
        *,
        num_frames: int = HUNYUAN_NUM_FRAMES,
        max_sequence_length: int = HUNYUAN_MAX_SEQUENCE_LENGTH,
        guidance: float = HUNYUAN_GUIDANCE,
        negative_prompt: str = "",
        **base,  # device, dtype: see ModelAdapter
    ):
        temporal = pipeline.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ModelLoadError(f"hunyuan_video: num_frames must be {temporal}k + 1, got {num_frames}")
        if max_sequence_length < 1:
            raise ModelLoadError(f"hunyuan_video: max_sequence_length must be >= 1, got {max_sequence_length}")
        super().__init__(pipeline, **base)
        self.temporal_factor = temporal
        self.spatial_factor = pipeline.vae_scale_factor_spatial
        self.num_frames = num_frames
        self.max_sequence_length = max_sequence_length
        self.guidance = float(guidance)
        self.negative_prompt = negative_prompt
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "HunyuanVideoAdapter":
        """1 dual- and 1 single-stream block of width 16 (2 heads of 8) with guidance embedding and
        a 1-block text refiner, a 3-layer Llama of width 16 with the pipeline's real prompt template
        (the tokenizer gives its 95-token prefix), a 2-layer CLIP of width 16, a HunyuanVideo VAE
        with 4 latent channels that compresses time 4x (as the released one) and space 2x; 16 text
        tokens; 5 frames of 32 px = 2 latent frames of 16 x 16 = 128 video tokens (2x2 patches)."""
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
        from transformers import CLIPTextModel, LlamaConfig, LlamaModel

        kwargs.setdefault("max_sequence_length", 16)
        kwargs.setdefault("num_frames", 5)
        torch.manual_seed(seed)
        width, latent_channels = 16, 4
        template_words = re.findall(r"[A-Za-z]+", re.sub(r"<\|\w+\|>", " ", DEFAULT_PROMPT_TEMPLATE["template"]))
        tokenizer = tiny_llama_tokenizer(template_words)
        # the pipeline keeps hidden_states[-3]: 3 layers leave one layer under it
        text_encoder = LlamaModel(tiny_decoder_config(
            LlamaConfig, len(tokenizer), width=width, num_layers=3, head_dim=8, max_position_embeddings=256,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        ))
        tokenizer_2 = tiny_clip_tokenizer(HUNYUAN_CLIP_LENGTH)
        text_encoder_2 = CLIPTextModel(tiny_clip_text_config(
            len(tokenizer_2), hidden_size=width, projection_dim=width, max_positions=HUNYUAN_CLIP_LENGTH,
            bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id,
        ))
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=2, attention_head_dim=8,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
            text_embed_dim=width, pooled_projection_dim=width, rope_axes_dim=(2, 2, 4),  # sums to the head width 8
            guidance_embeds=True,
        )
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=latent_channels, block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            spatial_compression_ratio=2, temporal_compression_ratio=4,  # the VAE supports only 4x (or 8x) in time
        )
        scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # the released checkpoint's static shift
        pipe = HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                    scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        config = self.pipeline.transformer.config
        return self._latent_shape(
            height, width, multiple=max(HUNYUAN_SIZE_MULTIPLE, self.spatial_factor * config.patch_size),
            channels=config.in_channels, downsample=self.spatial_factor, frames=self.latent_frames, what="frame",
        )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        def encode(texts):
            pe, pooled, mask = self.pipeline.encode_prompt(
                prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length
            )
            return {"encoder_hidden_states": pe, "encoder_attention_mask": mask, "pooled_projections": pooled}

        return PromptEmbeds.from_encoder(encode, prompts, with_uncond, self.negative_prompt)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``, ``x`` of shape ``(B, C, T, h, w)``; the embedded ``guidance`` in
        every row, true CFG with ``guidance_scale > 1`` (see the module docstring)."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)

        def forward(xb, tb, kw):
            # as the pipeline: the guidance tensor in the transformer's dtype, then times 1000
            guidance = torch.full((xb.shape[0],), self.guidance, device=xb.device, dtype=dtype) * HUNYUAN_GUIDANCE_UNIT
            return transformer(
                hidden_states=xb.to(dtype),
                timestep=tb * self.num_train_timesteps,  # the scheduler's timesteps, 1000 sigma
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                encoder_attention_mask=kw["encoder_attention_mask"].to(dtype),
                pooled_projections=kw["pooled_projections"].to(dtype),
                guidance=guidance,
                return_dict=False,
            )[0]

        return self._guided(forward, x, t, embeds, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, T, h, w)`` -> videos ``(B, F, 3, H, W)`` fp32 in ``[0, 1]``."""
        vae = self.pipeline.vae
        video = vae_decode(vae, latents, vae.dtype)  # z / scaling_factor (no shift_factor), (B, 3, F, H, W)
        return video.permute(0, 2, 1, 3, 4)

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``HunyuanVideoPipeline`` sets them: ``linspace(1, 0, N + 1)[:-1]``
        through the scheduler's shift, then 0."""
        return scheduler_sigmas(self.pipeline.scheduler, num_steps, sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
