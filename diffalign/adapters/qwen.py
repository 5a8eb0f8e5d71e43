"""Qwen-Image (``QwenImagePipeline``): a 20B rectified-flow MMDiT on a 3D-causal (Wan-style) VAE.

- Latents: at the adapter boundary one image latent is ``(C, h, w)`` (``C = 16``, ``h = H / 8``).
  The pipeline's latents are 5D ``(B, 1, C, h, w)`` (one frame) packed into 2x2 tokens
  ``(B, h/2 * w/2, 4C)`` exactly as FLUX.1 packs them; ``predict`` packs and unpacks.
- Text: one Qwen2.5-VL decoder through the pipeline's own ``encode_prompt``: the prompt goes into
  a chat template with a fixed system prompt whose 34 tokens are dropped, and the last hidden
  state of the remaining tokens is the conditioning. The pipeline pads a batch to its longest
  prompt; the adapter pads every batch to ``max_sequence_length`` tokens with zeros and a zero
  ``encoder_hidden_states_mask`` (the transformer masks those keys, and its image RoPE does not
  depend on the text length), so that embeddings of any two batches can be concatenated.
- Guidance: Qwen-Image is not guidance-distilled; ``QwenImagePipeline`` runs "true CFG" with a
  negative prompt (adapter option ``negative_prompt``, default ``" "`` as in the model card) and
  **rescales** the guided velocity of every token to the norm of the conditional one:
  ``v = comb * |v_cond| / |comb|`` with ``comb = v_uncond + g (v_cond - v_uncond)`` and the norm
  over the ``4C`` channels of each packed token. ``predict`` does the same in one batched forward.
- Schedule: ``linspace(1, 1/N, N)`` sigmas shifted by ``mu = calculate_shift(image tokens)``
  (the checkpoint's dynamic exponential shift, ``shift_terminal``), then 0; the transformer
  takes sigma (the pipeline's ``timestep / 1000``).
- Decode: ``z = latents * latents_std + latents_mean`` per channel, then the VAE on one frame.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ModelLoadError
from ._tiny import QWEN_LATENTS_MEAN, QWEN_LATENTS_STD, tiny_decoder_config, tiny_qwen2_tokenizer
from ._util import denormalize_latents, module_dtype, pipeline_sigmas, scheduler_sigmas, shift_mu, to_unit_range
from .base import PromptEmbeds
from .flux import PackedFlowAdapter, pack_latents, unpack_latents

QWEN_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default text length
QWEN_NEGATIVE_PROMPT = " "  # the negative prompt of Qwen-Image's model card example


def rescaled_cfg(uncond: torch.Tensor, cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG on packed tokens ``(B, N, D)``: the guided velocity with each
    token's norm (over ``D``) reset to the conditional velocity's."""
    comb = uncond + guidance_scale * (cond - uncond)
    return comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))


def tiny_qwen_parts(tokenizer, **token_ids) -> dict:
    """The random components of the tiny Qwen-Image builds but the tokenizer (drawn from torch's
    global generator): a 1-layer Qwen2.5-VL of width 16 with a 1-block vision tower (its
    ``token_ids``: the image / video / vision-start ids of ``tokenizer`` for Qwen-Image-Edit), 1
    MMDiT block of width 16 (2 heads of 8), a 2x Qwen-Image VAE with 4 latent channels, and
    Qwen-Image's scheduler settings."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    width, latent_channels = 16, 4
    special = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id)
    text_config = tiny_decoder_config(
        dict, len(tokenizer), width=width, max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # sums to head_dim / 2 = 4
        **special,
    )
    vision_config = dict(depth=1, hidden_size=width, intermediate_size=2 * width, num_heads=2, out_hidden_size=width,
                         fullatt_block_indexes=[0])  # 14 px patches, 2 frames, 2x2 merge: Qwen2.5-VL's
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **special, **token_ids)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=width,
        axes_dims_rope=(2, 2, 4),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=QWEN_LATENTS_MEAN[:latent_channels], latents_std=QWEN_LATENTS_STD[:latent_channels],
    )
    # Qwen-Image's scheduler settings: dynamic exponential shift, mu in [0.5, 0.9], last sigma stretched to 0.02.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, time_shift_type="exponential", base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer)


def padded_text(embeds: torch.Tensor, mask: Optional[torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A pipeline's text states ``(B, n, D)`` and mask (None: all ones, as the pipelines return it)
    cut or zero-padded to ``length`` tokens (mask 0 on padding), under the transformer's names."""
    b, n, d = embeds.shape
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    embeds, mask = embeds[:, :length], mask[:, :length]
    pad = length - embeds.shape[1]
    return {
        "encoder_hidden_states": torch.cat([embeds, embeds.new_zeros(b, pad, d)], dim=1),
        "encoder_hidden_states_mask": torch.cat([mask, mask.new_zeros(b, pad)], dim=1),
    }


class QwenImageAdapter(PackedFlowAdapter):
    """Adapter for ``QwenImagePipeline``.

    Args:
        pipeline: a loaded ``QwenImagePipeline`` (not guidance-distilled).
        max_sequence_length: text tokens per prompt after the template (default 512, as the
            pipeline; at most 1024).
        negative_prompt: the prompt of the unconditional branch (default ``" "``).
    """

    family = "qwen"
    display_name = "Qwen-Image"
    pipeline_class = "QwenImagePipeline"
    default_resolution = 1024
    options = ("max_sequence_length", "negative_prompt")

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: int = QWEN_MAX_SEQUENCE_LENGTH,
        negative_prompt: str = QWEN_NEGATIVE_PROMPT,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        if pipeline.transformer.config.guidance_embeds:
            raise ModelLoadError("qwen: guidance-distilled transformers (guidance_embeds=True) are not supported")
        if not 1 <= max_sequence_length <= self._text_limit():
            raise ModelLoadError(f"{self.family}: max_sequence_length must be in [1, {self._text_limit()}], got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.default_resolution = pipeline.default_sample_size * self.vae_scale_factor

    def _text_limit(self) -> int:
        """The largest ``max_sequence_length`` (the pipeline's ``tokenizer_max_length``, 1024)."""
        return self.pipeline.tokenizer_max_length

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "QwenImageAdapter":
        """1 MMDiT block of width 16 (2 heads of 8), a 1-layer Qwen2.5-VL text model of width 16
        (with a 1-block vision tower the class requires), a 2x Qwen-Image VAE with 4 latent
        channels; 16 text tokens; 32 px images = 16 x 16 latents = 64 packed tokens."""
        from diffusers import QwenImagePipeline

        kwargs.setdefault("max_sequence_length", 16)
        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer()
        pipe = QwenImagePipeline(tokenizer=tokenizer, **tiny_qwen_parts(tokenizer))
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        def encode(texts):
            pe, mask = self.pipeline.encode_prompt(list(texts), device=self.device, max_sequence_length=self.max_sequence_length)
            return padded_text(pe, mask, self.max_sequence_length)

        return PromptEmbeds.from_encoder(encode, prompts, with_uncond, self.negative_prompt)

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``; ``x`` is unpacked ``(B, C, h, w)``. CFG as the pipeline's
        norm-rescaled true CFG (see the module docstring)."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        _, _, h, w = x.shape

        def forward(xb, tb, kw):
            tokens = pack_latents(xb.to(dtype))
            n, shapes = tokens.shape[1], [(1, h // 2, w // 2)]
            source = self._source_tokens(kw, dtype)
            if source is not None:  # an edit's source image: more image tokens, output only for the first n
                tokens, shapes = torch.cat([tokens, source[0]], dim=1), shapes + [source[1]]
            return transformer(
                hidden_states=tokens,
                timestep=tb.to(dtype),  # sigma: the pipeline passes timesteps / 1000
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                encoder_hidden_states_mask=kw["encoder_hidden_states_mask"],
                img_shapes=[shapes] * xb.shape[0],
                return_dict=False,
            )[0][:, :n]

        return unpack_latents(self._guided(forward, x, t, embeds, guidance_scale, combine=rescaled_cfg), h, w)

    def _source_tokens(self, kw: dict, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Packed tokens ``(B, N', D)`` and the ``img_shapes`` entry ``(1, h'/2, w'/2)`` of a
        conditioning image to append to the noisy latent's tokens, or None (text-to-image
        Qwen-Image; Qwen-Image-Edit overrides it)."""
        return None

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = denormalize_latents(vae, latents[:, :, None])  # (B, C, 1 frame, h, w)
        return to_unit_range(vae.decode(z, return_dict=False)[0][:, :, 0])

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigmas exactly as ``QwenImagePipeline`` sets them: ``linspace(1, 1/N, N)`` shifted
        with ``mu = calculate_shift(image tokens)``, then 0 appended."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = self.pipeline.scheduler
        _, h, w = self.latent_shape(height, width)
        mu = shift_mu(scheduler.config, (h // 2) * (w // 2))
        sigmas = scheduler_sigmas(
            scheduler, num_steps, scheduler_class=FlowMatchEulerDiscreteScheduler, sigmas=pipeline_sigmas(num_steps), mu=mu
        )
        if not torch.isfinite(sigmas).all():  # shift_terminal stretches sigmas 1 .. 1/N: 0 / 0 for N = 1
            raise ValueError(f"Qwen-Image's scheduler gives non-finite sigmas for {num_steps} step(s) (shift_terminal needs >= 2)")
        return sigmas
