"""FLUX.1 (``FluxPipeline``): a rectified-flow MMDiT on 2x2-packed latents.

At the adapter boundary a latent is the ordinary unpacked ``(C, h, w)`` tensor (``C = 16`` for
FLUX.1), so samplers and kernels never see FLUX's packing; ``predict`` packs it into
``(h/2 * w/2, 4C)`` tokens for the transformer and unpacks the velocity. Packing is a
permutation, so every per-element formula (Euler step, Gaussian log-prob) is unchanged.

Guidance: FLUX.1-dev is guidance-distilled. The guidance strength is an *input* of the
transformer (``guidance``, default 3.5, only when ``transformer.config.guidance_embeds``), not
classifier-free guidance. ``predict`` therefore ignores ``embeds.uncond`` unless
``guidance_scale > 1`` **and** uncond embeddings were encoded, in which case it runs "true CFG"
(the pipeline's ``true_cfg_scale``) in one batched forward, with the same distilled guidance
input in both halves. For FLUX.1-dev leave ``guidance_scale`` at 1 and set ``guidance``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_t5_config, tiny_t5_tokenizer, tiny_vae
from ._util import module_dtype, pipeline_sigmas, rotary_cache, scheduler_sigmas, shift_mu
from .base import ModelAdapter, PromptEmbeds
from .sd3 import FLOW_GRPO_LORA_TARGETS

FLUX_MAX_SEQUENCE_LENGTH = 512  # the pipeline's default (and maximum) T5 length
FLUX_DEV_GUIDANCE = 3.5  # the pipeline's default distilled guidance for FLUX.1-dev
FLUX_DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size (latent pixels)


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h/2 * w/2, 4C)`` tokens, as ``FluxPipeline._pack_latents``.

    ``pixel_unshuffle`` orders a token's channels ``(c, row, col)`` of its 2x2 patch, the same
    order as the pipeline's view-permute, in one copy kernel instead of a six-dim permute."""
    return F.pixel_unshuffle(x, 2).flatten(2).transpose(1, 2).contiguous()


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for latent height ``h`` and width ``w``."""
    b, _, d = tokens.shape
    return F.pixel_shuffle(tokens.transpose(1, 2).reshape(b, d, h // 2, w // 2), 2)


def latent_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """RoPE position ids ``(h/2 * w/2, 3)`` of the packed tokens: ``(0, row, col)``."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class PackedFlowAdapter(ModelAdapter):
    """Base of the flow-matching MMDiTs whose pipelines pack 2x2 latent pixels into one token
    (FLUX.1, Qwen-Image): ``predict`` packs with :func:`pack_latents` and unpacks the velocity,
    so samplers see ordinary ``(C, h, w)`` latents. LoRA goes on the joint-attention projections
    (image and text streams), as in Flow-GRPO."""

    prediction_type = "flow"
    default_lora_targets = FLOW_GRPO_LORA_TARGETS
    latent_packing = 2


class FluxAdapter(PackedFlowAdapter):
    """Adapter for ``FluxPipeline``.

    Args:
        pipeline: a loaded ``FluxPipeline``.
        guidance: the distilled guidance value fed to the transformer when it has
            ``guidance_embeds`` (FLUX.1-dev); ignored otherwise (FLUX.1-schnell).
        max_sequence_length: T5 tokens per prompt; defaults to 512, or the T5 tokenizer's
            ``model_max_length`` when that is smaller.
    """

    family = "flux"
    display_name = "FLUX"
    pipeline_class = "FluxPipeline"
    default_resolution = 1024
    options = ("guidance", "max_sequence_length")

    def __init__(
        self,
        pipeline,
        *,
        guidance: float = FLUX_DEV_GUIDANCE,
        max_sequence_length: Optional[int] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        self.guidance = guidance
        self._constants: dict[tuple, tuple] = {}  # see _constant_inputs
        tok = pipeline.tokenizer_2
        limit = tok.model_max_length if tok is not None else FLUX_MAX_SEQUENCE_LENGTH
        self.max_sequence_length = max_sequence_length or min(FLUX_MAX_SEQUENCE_LENGTH, limit)
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.default_resolution = FLUX_DEFAULT_SAMPLE_SIZE * self.vae_scale_factor

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "FluxAdapter":
        """1 double + 1 single block of width 32 with guidance embedding (like FLUX.1-dev), a
        2-layer CLIP of width 16, a 1-layer T5 of width 32, a 2x VAE with 4 latent channels;
        32 px images = 16 x 16 latents = 64 packed tokens."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        torch.manual_seed(seed)
        text_len, clip_width, t5_width, latent_channels = 16, 16, 32, 4
        tokenizer, tokenizer_2 = tiny_clip_tokenizer(text_len), tiny_t5_tokenizer(text_len)
        clip_config = tiny_clip_text_config(
            len(tokenizer), hidden_size=clip_width, projection_dim=clip_width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * latent_channels,  # 2x2 packing
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=t5_width,
            pooled_projection_dim=clip_width,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        )
        # FLUX.1's scheduler: resolution-dependent shift mu in [0.5, 1.15].
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
        pipe = getattr(diffusers, cls.pipeline_class)(  # FluxPipeline, or a subclass's (FluxKontextPipeline)
            scheduler=scheduler,
            vae=tiny_vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159),  # FLUX.1's VAE constants
            text_encoder=CLIPTextModel(clip_config),
            tokenizer=tokenizer,
            text_encoder_2=T5EncoderModel(tiny_t5_config(len(tokenizer_2), d_model=t5_width)),
            tokenizer_2=tokenizer_2,
            transformer=transformer,
        )
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        def encode(texts):
            pe, pooled, _text_ids = self.pipeline.encode_prompt(
                prompt=list(texts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
            return {"encoder_hidden_states": pe, "pooled_projections": pooled}

        return PromptEmbeds.from_encoder(encode, prompts, with_uncond)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``; ``x`` is unpacked ``(B, C, h, w)``. See the module docstring
        for ``guidance`` (distilled, always applied) vs ``guidance_scale`` (true CFG)."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        _, _, h, w = x.shape
        # the rotary tables depend only on the token ids, the same at every step: computed once
        rope = rotary_cache(getattr(transformer, "pos_embed", None))

        def forward(xb, tb, kw):
            text = kw["encoder_hidden_states"].to(dtype)
            img_ids, txt_ids, guidance = self._constant_inputs(xb.shape[0], h, w, text.shape[1], xb.device, dtype)
            tokens = pack_latents(xb.to(dtype))
            n = tokens.shape[1]
            source = self._source_tokens(kw, dtype)
            if source is not None:  # an edit's source image: more image tokens, output only for the first n
                tokens, img_ids = torch.cat([tokens, source[0]], dim=1), torch.cat([img_ids, source[1]])
            with rope.active() if rope is not None else nullcontext():
                out = transformer(
                    hidden_states=tokens,
                    timestep=tb.to(dtype),  # sigma: the pipeline passes timesteps / 1000
                    guidance=guidance,
                    pooled_projections=kw["pooled_projections"].to(dtype),
                    encoder_hidden_states=text,
                    txt_ids=txt_ids,
                    img_ids=img_ids,
                    return_dict=False,
                )[0]
            return unpack_latents(out[:, :n], h, w)

        return self._guided(forward, x, t, embeds, guidance_scale)

    def _source_tokens(self, kw: dict, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Tokens ``(B, N', D)`` and RoPE ids ``(N', 3)`` of a conditioning image to append to the
        noisy latent's tokens, or None (text-to-image FLUX.1; FLUX.1 Kontext overrides it)."""
        return None

    def _constant_inputs(self, n: int, h: int, w: int, text_len: int, device, dtype):
        """The transformer inputs that depend only on shapes (RoPE ids of image and text tokens,
        the distilled guidance), built once per shape as the pipeline builds them once per call,
        apart for inference mode (a rollout's cannot be saved for a backward). Read-only: the
        transformer never writes them."""
        key = (n, h, w, text_len, str(device), dtype, float(self.guidance), torch.is_inference_mode_enabled())
        if key not in self._constants:
            guidance = None
            if self.pipeline.transformer.config.guidance_embeds:
                guidance = torch.full((n,), float(self.guidance), device=device, dtype=torch.float32)
            self._constants[key] = (latent_image_ids(h, w, device, dtype),
                                    torch.zeros(text_len, 3, device=device, dtype=dtype), guidance)
        return self._constants[key]

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``FluxPipeline`` sets them: ``linspace(1, 1/N, N)`` shifted with
        ``mu = calculate_shift(image tokens)`` (dynamic shifting), then 0 appended."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = self.pipeline.scheduler
        _, h, w = self.latent_shape(height, width)
        mu = shift_mu(scheduler.config, (h // 2) * (w // 2))
        sigmas = pipeline_sigmas(num_steps, scheduler.config)
        return scheduler_sigmas(scheduler, num_steps, scheduler_class=FlowMatchEulerDiscreteScheduler, sigmas=sigmas, mu=mu)
