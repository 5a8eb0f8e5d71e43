"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): an MMDiT rectified-flow model.

Text conditioning comes from three encoders (CLIP-L, CLIP-G, T5-XXL) through the pipeline's
own ``encode_prompt``: ``encoder_hidden_states`` is the CLIP tokens (padded to the T5 width)
followed by the T5 tokens, ``pooled_projections`` the two pooled CLIP vectors side by side.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._tiny import tiny_clip_text_config, tiny_clip_tokenizer, tiny_t5_config, tiny_t5_tokenizer, tiny_tiny_autoencoder
from ._util import module_dtype, scheduler_sigmas, shift_mu
from .base import ModelAdapter, PromptEmbeds

# Flow-GRPO's LoRA targets for SD3: the image-stream (to_*) and text-stream (add_*) projections
# of every joint attention block.
FLOW_GRPO_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]
SD3_MAX_SEQUENCE_LENGTH = 256  # the pipeline's default T5 length (Flow-GRPO trains with 128)


class SD3Adapter(ModelAdapter):
    """Adapter for ``StableDiffusion3Pipeline``.

    Args:
        pipeline: a loaded ``StableDiffusion3Pipeline`` (``text_encoder_3`` may be ``None``:
            the pipeline then uses zeros for the T5 tokens).
        max_sequence_length: T5 tokens per prompt; defaults to the pipeline's 256, or the T5
            tokenizer's ``model_max_length`` when that is smaller.
    """

    family = "sd3"
    prediction_type = "flow"
    default_resolution = 1024
    default_lora_targets = FLOW_GRPO_LORA_TARGETS
    pipeline_class = "StableDiffusion3Pipeline"
    options = ("max_sequence_length",)
    display_name = "SD3"

    def __init__(self, pipeline, *, device="cpu", dtype=torch.float32, max_sequence_length: Optional[int] = None):
        super().__init__(pipeline, device=device, dtype=dtype)
        tok3 = pipeline.tokenizer_3
        limit = tok3.model_max_length if tok3 is not None else SD3_MAX_SEQUENCE_LENGTH
        self.max_sequence_length = max_sequence_length or min(SD3_MAX_SEQUENCE_LENGTH, limit)
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.patch_size = pipeline.transformer.config.patch_size
        # The pipeline's default size (sample_size latents); an instance value shadows the class one.
        self.default_resolution = pipeline.transformer.config.sample_size * self.vae_scale_factor

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "SD3Adapter":
        """2 joint blocks of width 16, two 2-layer CLIPs of width 16, a 1-layer T5 of width 32,
        a 2x VAE; 16 CLIP + 16 T5 text tokens; 32 px images = 8 x 8 = 64 image tokens."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection, T5EncoderModel


        torch.manual_seed(seed)
        text_len = 16
        clip_width, t5_width = 16, 32  # 2 CLIPs side by side (2 x 16) are padded to the T5 width (32)
        tokenizer, tokenizer_2, tokenizer_3 = tiny_clip_tokenizer(text_len), tiny_clip_tokenizer(text_len), tiny_t5_tokenizer(text_len)

        def clip():
            config = tiny_clip_text_config(
                len(tokenizer), hidden_size=clip_width, projection_dim=clip_width,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            return CLIPTextModelWithProjection(config)

        transformer = SD3Transformer2DModel(
            sample_size=16,  # latent size of a 32 px image
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=t5_width,
            caption_projection_dim=16,  # = heads * head_dim
            pooled_projection_dim=2 * clip_width,
            pos_embed_max_size=32,  # up to 128 px
        )
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's shift
            vae=tiny_tiny_autoencoder(4, scaling_factor=1.5305, shift_factor=0.0609),  # SD3's VAE constants; see its docstring
            text_encoder=clip(),
            tokenizer=tokenizer,
            text_encoder_2=clip(),
            tokenizer_2=tokenizer_2,
            text_encoder_3=T5EncoderModel(tiny_t5_config(len(tokenizer_3), d_model=t5_width)),
            tokenizer_3=tokenizer_3,
        )
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        pe, neg_pe, pooled, neg_pooled = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=with_uncond,
            negative_prompt="",
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds.named(
            ("encoder_hidden_states", "pooled_projections"), (pe, pooled), (neg_pe, neg_pooled) if with_uncond else None
        )

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        # The transformer takes the scheduler's timesteps, i.e. sigma * num_train_timesteps (1000).
        n_train = self.pipeline.scheduler.config.num_train_timesteps

        def forward(xb, tb, kw):
            return transformer(
                hidden_states=xb.to(dtype),
                timestep=tb * n_train,
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                pooled_projections=kw["pooled_projections"].to(dtype),
                return_dict=False,
            )[0]

        return self._guided(forward, x, t, embeds, guidance_scale)

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The sigmas of the pipeline's ``FlowMatchEulerDiscreteScheduler`` (static ``shift``,
        or resolution-dependent ``mu`` when the config asks for dynamic shifting, as the
        pipeline does), ``num_steps + 1`` values ending in 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = self.pipeline.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape(height, width)
            kwargs["mu"] = shift_mu(scheduler.config, (h // self.patch_size) * (w // self.patch_size), max_shift=1.16)
        return scheduler_sigmas(scheduler, num_steps, scheduler_class=FlowMatchEulerDiscreteScheduler, **kwargs)
