"""Wan2.1 and Wan2.2 text-to-video (``WanPipeline``): a rectified-flow video DiT on a 3D-causal VAE.

- Frames are one more latent axis: one latent is ``(C, T, h, w)`` with ``C = 16``,
  ``T = (num_frames - 1) / 4 + 1`` latent frames (the VAE keeps the first frame and compresses
  the rest 4x in time) and ``h = H / 8``. ``num_frames`` is an adapter option (the pipeline's 81
  by default; it must be ``4k + 1``). Samplers and kernels are unchanged: every per-element
  formula runs over the extra axis.
- ``decode`` returns videos ``(B, F, 3, H, W)`` in ``[0, 1]`` (frames second). A reward sees
  every frame: image rewards are applied per frame and averaged over frames
  (:func:`reward_models.call_reward`); video rewards such as ``temporal_consistency`` take the
  frames as they are.
- Text: umT5-XXL through the pipeline's ``encode_prompt`` (``max_sequence_length`` tokens, 512 as
  in ``__call__``; padding positions are zeroed). CFG with ``negative_prompt`` (default ``""``,
  as the pipeline when none is given) in one batched forward.
- Schedule: the checkpoint's scheduler (``UniPCMultistepScheduler`` with flow sigmas and
  ``flow_shift`` for the released Wan2.1 checkpoints, or ``FlowMatchEulerDiscreteScheduler``)
  after ``set_timesteps(N)``, as the pipeline calls it; the transformer gets the scheduler's
  timesteps ``1000 sigma`` (truncated to integers by UniPC). The flow kernels step these sigmas,
  so a deterministic sample equals the pipeline's for a FlowMatchEuler scheduler, and for UniPC
  for N <= 2 (its multistep predictor-corrector differs from Euler beyond, as Sana's DPM-Solver).
- Wan2.2 A14B: two experts of the same architecture, ``transformer`` for high noise and
  ``transformer_2`` for low noise. As in ``WanPipeline.__call__``, a step whose timestep is
  ``>= boundary_ratio * num_train_timesteps`` (875 for T2V-A14B) runs ``transformer`` with
  ``guidance_scale``, the others ``transformer_2`` with ``guidance_scale_2`` (adapter option;
  ``guidance_scale`` when unset). ``predict`` routes each sample by its own time, so a batch may
  straddle the boundary. The denoiser is :class:`WanExperts`, both experts as one module: LoRA
  goes on both, every step of a rollout is trainable, and the reference / low-precision copies
  swap both. ``final/`` holds one LoRA file per expert (``transformer_2``'s loads with
  ``load_lora_weights(folder, weight_name="pytorch_lora_weights_transformer_2.safetensors",
  load_into_transformer_2=True)``, diffusers' way). ``expand_timesteps`` (TI2V-5B) is refused.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch

from ..errors import ModelLoadError
from ._tiny import QWEN_LATENTS_MEAN, QWEN_LATENTS_STD, tiny_t5_config, tiny_t5_tokenizer
from ._util import batch_t, denormalize_latents, gives_integer_timesteps, is_flow_scheduler, module_dtype, to_unit_range
from .base import ModelAdapter, PromptEmbeds

WAN_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default umT5 length
WAN_NUM_FRAMES = 81  # WanPipeline.__call__'s default (5 s at 16 fps)
# Self- (attn1) and cross-attention (attn2) projections of every block, as for Sana.
WAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as one trainable denoiser; the children carry the pipeline's component
    names (``transformer``: high noise, ``transformer_2``: low noise), so parameter names, LoRA
    files and copies map onto the pipeline part by part (``ModelAdapter.denoiser_parts``)."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    def add_adapter(self, config, adapter_name: str = "default") -> None:
        """The same LoRA (a copy of peft's ``config`` each) on both experts."""
        for expert in self.children():
            expert.add_adapter(copy.deepcopy(config), adapter_name=adapter_name)

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.children():
            expert.enable_gradient_checkpointing()


class WanAdapter(ModelAdapter):
    """Adapter for ``WanPipeline`` (Wan2.1 T2V, and Wan2.2 T2V-A14B with its two experts).

    Args:
        pipeline: a loaded ``WanPipeline`` with a flow scheduler and either one transformer or,
            with ``boundary_ratio`` set, two (``transformer_2``).
        num_frames: video frames per sample (``4k + 1`` for the real VAE; 81 by default).
        max_sequence_length: umT5 tokens per prompt (512).
        negative_prompt: the prompt of the unconditional branch (``""``).
        boundary_ratio: Wan2.2's switch between the experts, as a fraction of the training
            timesteps (default: the pipeline's, 0.875 for T2V-A14B; setting it overrides the
            pipeline's config, so its own ``__call__`` switches at the same step). ``tiny:wan``
            builds two experts when it is given.
        guidance_scale_2: the CFG scale of the low-noise expert (Wan2.2 only; default the sampling
            ``guidance_scale``, as the pipeline). CFG itself is on when ``guidance_scale > 1``.
    """

    family = "wan"
    prediction_type = "flow"
    default_resolution = 480  # the pipeline's default height (its default width is 832; ours are square)
    default_lora_targets = WAN_LORA_TARGETS
    pipeline_class = "WanPipeline"
    options = ("num_frames", "max_sequence_length", "negative_prompt", "boundary_ratio", "guidance_scale_2")
    display_name = "Wan"

    def __init__(
        self,
        pipeline,
        *,
        num_frames: int = WAN_NUM_FRAMES,
        max_sequence_length: int = WAN_MAX_SEQUENCE_LENGTH,
        negative_prompt: str = "",
        boundary_ratio: Optional[float] = None,
        guidance_scale_2: Optional[float] = None,
        **base,  # device, dtype: see ModelAdapter
    ):
        ratio = pipeline.config.get("boundary_ratio") if boundary_ratio is None else boundary_ratio
        if ratio is not None and not 0.0 < ratio < 1.0:
            raise ModelLoadError(f"wan: boundary_ratio must be in (0, 1), got {ratio}")
        if pipeline.transformer is None:
            raise ModelLoadError("wan: the pipeline has no transformer (high-noise expert)")
        if (pipeline.transformer_2 is None) != (ratio is None):
            raise ModelLoadError(
                "wan: Wan2.2's two experts need both transformer_2 and boundary_ratio, "
                f"got transformer_2 {'set' if pipeline.transformer_2 is not None else 'None'} and boundary_ratio {ratio}"
            )
        if guidance_scale_2 is not None and ratio is None:
            raise ModelLoadError("wan: guidance_scale_2 is for Wan2.2's low-noise expert; this pipeline has one transformer")
        if pipeline.config.get("expand_timesteps", False):
            raise ModelLoadError("wan: expand_timesteps (Wan2.2 TI2V) is not supported")
        if not is_flow_scheduler(pipeline.scheduler):
            raise ModelLoadError(f"wan: scheduler {type(pipeline.scheduler).__name__!r} is not a flow scheduler")
        if boundary_ratio is not None:
            pipeline.register_to_config(boundary_ratio=boundary_ratio)  # the stock __call__ switches where predict does
        self.experts = None if ratio is None else WanExperts(pipeline.transformer, pipeline.transformer_2)
        super().__init__(pipeline, **base)
        self.temporal_factor = pipeline.vae_scale_factor_temporal
        self.spatial_factor = pipeline.vae_scale_factor_spatial
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise ModelLoadError(f"wan: num_frames must be {self.temporal_factor}k + 1, got {num_frames}")
        self.num_frames = num_frames
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.patch_size = tuple(pipeline.transformer.config.patch_size)  # (t, h, w)
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps
        self.integer_timesteps = gives_integer_timesteps(pipeline.scheduler)
        # WanPipeline.__call__: timesteps >= boundary_ratio * num_train_timesteps go to the high-noise expert
        self.boundary_timestep = None if ratio is None else ratio * self.num_train_timesteps
        self.guidance_scale_2 = guidance_scale_2

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "WanAdapter":
        """1 Wan block of width 16 (2 heads of 8), a 1-layer umT5 of width 32, a Wan VAE with 4
        latent channels that halves time and space; 16 text tokens; 5 frames of 32 px = 3 latent
        frames of 16 x 16 = 192 video tokens (2x2 patches). With ``boundary_ratio``: Wan2.2's two
        experts, each such a block with its own random weights."""
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel


        kwargs.setdefault("max_sequence_length", 16)
        kwargs.setdefault("num_frames", 5)
        torch.manual_seed(seed)
        text_width, latent_channels = 32, 4
        tokenizer = tiny_t5_tokenizer(16)
        text_encoder = UMT5EncoderModel(tiny_t5_config(len(tokenizer), d_model=text_width, config_class=UMT5Config))
        def expert():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=latent_channels,
                out_channels=latent_channels, text_dim=text_width, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
            )

        transformer = expert()
        ratio = kwargs.pop("boundary_ratio", None)
        transformer_2 = expert() if ratio is not None else None
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
            latents_mean=QWEN_LATENTS_MEAN[:latent_channels], latents_std=QWEN_LATENTS_STD[:latent_channels],
            scale_factor_temporal=2, scale_factor_spatial=2,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # Wan2.1 480p's flow shift
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer,
                           transformer_2=transformer_2, boundary_ratio=ratio)
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @property
    def denoiser(self) -> torch.nn.Module:
        """The transformer, or for Wan2.2 both experts as one :class:`WanExperts`."""
        return self.pipeline.transformer if self.experts is None else self.experts

    def denoiser_parts(self) -> dict[str, torch.nn.Module]:
        if self.experts is None:
            return super().denoiser_parts()
        return dict(self.experts.named_children())

    def frozen_modules(self) -> list[torch.nn.Module]:
        experts = list(self.experts.children()) if self.experts is not None else []
        return [m for m in super().frozen_modules() if not any(m is e for e in experts)]

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return self._latent_shape(
            height, width, multiple=max(16, self.spatial_factor * self.patch_size[1]),  # the pipeline asks for multiples of 16
            channels=self.pipeline.transformer.config.in_channels, downsample=self.spatial_factor,
            frames=self.latent_frames, what="frame",
        )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        prompts = list(prompts)
        pe, neg_pe = self.pipeline.encode_prompt(
            prompt=prompts,
            negative_prompt=[self.negative_prompt] * len(prompts),
            do_classifier_free_guidance=with_uncond,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return PromptEmbeds.named(("encoder_hidden_states",), (pe,), (neg_pe,) if with_uncond else None)

    def model_timestep(self, t: torch.Tensor) -> torch.Tensor:
        """Sigma -> the ``timestep`` the pipeline feeds the transformer: the scheduler's
        ``1000 sigma``, truncated to an integer when the scheduler does (UniPC)."""
        ts = t.double() * self.num_train_timesteps
        return (torch.floor(ts) if self.integer_timesteps else ts).float()

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``, ``x`` of shape ``(B, C, T, h, w)``; for Wan2.2 each sample from
        the expert its time falls to (see the module docstring)."""
        if self.boundary_timestep is None:
            return self._expert_predict(self.pipeline.transformer, x, t, embeds, guidance_scale)
        t = batch_t(t, x.shape[0], x.device)
        high = self.model_timestep(t) >= self.boundary_timestep
        low_scale = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        if high.all():
            return self._expert_predict(self.pipeline.transformer, x, t, embeds, guidance_scale)
        if not high.any():
            return self._expert_predict(self.pipeline.transformer_2, x, t, embeds, low_scale)
        rows_high, rows_low = high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)
        out_high = self._expert_predict(self.pipeline.transformer, x[rows_high], t[rows_high], embeds.select(rows_high), guidance_scale)
        out_low = self._expert_predict(self.pipeline.transformer_2, x[rows_low], t[rows_low], embeds.select(rows_low), low_scale)
        order = torch.argsort(torch.cat([rows_high, rows_low]))  # back to the batch's order
        return torch.cat([out_high, out_low])[order]

    def _expert_predict(self, transformer, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float) -> torch.Tensor:
        dtype = module_dtype(transformer)

        def forward(xb, tb, kw):
            return transformer(
                hidden_states=xb.to(dtype),
                timestep=self.model_timestep(tb),
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                return_dict=False,
            )[0]

        return self._guided(forward, x, t, embeds, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, T, h, w)`` -> videos ``(B, F, 3, H, W)`` fp32 in ``[0, 1]``."""
        video = self.pipeline.vae.decode(denormalize_latents(self.pipeline.vae, latents), return_dict=False)[0]
        return to_unit_range(video.permute(0, 2, 1, 3, 4))  # (B, 3, F, H, W) in [-1, 1] -> frames second

    # make_schedule: the default, the pipeline's own scheduler after set_timesteps(num_steps), what
    # WanPipeline calls.
