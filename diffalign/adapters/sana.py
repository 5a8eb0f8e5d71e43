"""Sana (``SanaPipeline``): a linear-attention DiT on a 32x deep-compression autoencoder (DC-AE).

- Text: one Gemma-2 decoder (``text_encoder``) through the pipeline's own ``encode_prompt``:
  ``encoder_hidden_states`` ``(B, L, 2304)`` plus ``encoder_attention_mask`` ``(B, L)`` (Sana
  attends only to real tokens). With the *complex human instruction* (CHI) the pipeline prepends
  a long instruction to each prompt and keeps the first token plus the last ``L - 1`` ones; the
  empty (unconditional) prompt never gets it. ``SanaPipeline.__call__`` turns CHI on by default,
  so :meth:`SanaAdapter.from_pretrained` does too; the tiny build turns it off.
- Schedule: Sana ships ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas`` and
  ``prediction_type="flow_prediction"``: its sigmas are a rectified-flow schedule
  ``shift * s / (1 + (shift - 1) s)`` over ``s = 1 - linspace(1, 1/1000, N + 1)``, largest first
  and without ``s = 0`` (``flow_shift`` 3, so ``sigma_0 = 0.9997``), then a final 0.
  :meth:`SanaAdapter.make_schedule` returns exactly those sigmas; the samplers step them with the
  flow kernels (first-order DPM-Solver++ on a flow model is the Euler step, so a deterministic
  sample equals the pipeline's for N <= 2 and differs from its second-order multistep solver
  beyond). A ``FlowMatchEulerDiscreteScheduler`` config works too.
- Timestep input, as the pipeline: ``transformer(timestep=scheduler_timestep * timestep_scale)``
  where the scheduler timestep is ``sigma * num_train_timesteps``, **truncated to an integer**
  by DPM-Solver (``int64`` timesteps), kept as float by FlowMatchEuler. The sigma of the schedule
  is fp32, so ``sigma * 1000`` can land on the other side of an integer than the scheduler's fp64
  value when it is within ~1e-4 of one (then the transformer sees t +- 1).
- Prediction: velocity ``v = eps - x0`` (``flow_prediction``), as SD3 / FLUX.
"""

from __future__ import annotations

import inspect
from typing import Sequence, Union

import torch

from ..errors import ModelLoadError
from ._tiny import TINY_WORDS, tiny_decoder_config
from ._util import gives_integer_timesteps, is_flow_scheduler, module_dtype
from .base import ModelAdapter, PromptEmbeds

# Every attention projection: linear self-attention (attn1) and cross-attention (attn2) of each
# block, as Flow-GRPO's choice of attention q/k/v/out for the other DiTs.
SANA_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
SANA_MAX_SEQUENCE_LENGTH = 300  # the pipeline's default Gemma length

ComplexHumanInstruction = Union[bool, Sequence[str], None]


def pipeline_default_instruction() -> list[str]:
    """The complex human instruction ``SanaPipeline.__call__`` uses by default."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


class SanaAdapter(ModelAdapter):
    """Adapter for ``SanaPipeline``.

    Args:
        pipeline: a loaded ``SanaPipeline`` whose scheduler is a flow scheduler (see the module
            docstring).
        max_sequence_length: Gemma tokens per prompt (default 300, as the pipeline).
        complex_human_instruction: ``True`` = the pipeline's default instruction, ``False`` /
            ``None`` = off, or a list of lines.
    """

    family = "sana"
    prediction_type = "flow"
    default_resolution = 1024
    default_lora_targets = SANA_LORA_TARGETS
    pipeline_class = "SanaPipeline"
    options = ("max_sequence_length", "complex_human_instruction")
    pretrained_defaults = {"complex_human_instruction": True}  # on, as in SanaPipeline.__call__
    display_name = "Sana"

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: int = SANA_MAX_SEQUENCE_LENGTH,
        complex_human_instruction: ComplexHumanInstruction = False,
        **base,  # device, dtype: see ModelAdapter
    ):
        super().__init__(pipeline, **base)
        config = pipeline.scheduler.config
        if not is_flow_scheduler(pipeline.scheduler):
            raise ModelLoadError(
                f"sana: scheduler {type(pipeline.scheduler).__name__!r} is not a flow "
                "scheduler (expected DPMSolverMultistepScheduler with use_flow_sigmas and prediction_type "
                "'flow_prediction', or FlowMatchEulerDiscreteScheduler)"
            )
        self.max_sequence_length = max_sequence_length
        if complex_human_instruction is True:
            complex_human_instruction = pipeline_default_instruction()
        self.complex_human_instruction = list(complex_human_instruction) if complex_human_instruction else None
        self.vae_scale_factor = pipeline.vae_scale_factor
        transformer = pipeline.transformer
        self.patch_size = transformer.config.patch_size
        self.default_resolution = transformer.config.sample_size * self.vae_scale_factor
        self.num_train_timesteps = config.num_train_timesteps
        # Does the scheduler hand the transformer integer timesteps (DPM-Solver) or float ones?
        self.integer_timesteps = gives_integer_timesteps(pipeline.scheduler)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, *, device="cpu", dtype=torch.float32, seed: int = 0, **kwargs) -> "SanaAdapter":
        """1 Sana block of width 16 (2 heads of 8), a 1-layer Gemma-2 of width 16, a 2x DC-AE
        with 4 latent channels, Sana's DPM-Solver flow scheduler config; 16 text tokens, no
        complex human instruction; 32 px images = 16 x 16 = 256 image tokens."""
        from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
        from transformers import Gemma2Config, Gemma2Model


        kwargs.setdefault("max_sequence_length", 16)
        kwargs.setdefault("complex_human_instruction", False)
        torch.manual_seed(seed)
        width = 16
        tokenizer = tiny_gemma_tokenizer()
        text_encoder = Gemma2Model(tiny_decoder_config(
            Gemma2Config, len(tokenizer), width=width, head_dim=8, max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))
        transformer = SanaTransformer2DModel(
            in_channels=4, out_channels=4, patch_size=1, sample_size=16,  # latent size of a 32 px image
            num_layers=1, num_attention_heads=2, attention_head_dim=8,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=width, caption_channels=width,
        )
        vae = AutoencoderDC(  # the shape of diffusers' own Sana test VAE: 2x, 4 latent channels
            in_channels=3, latent_channels=4, attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"), decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
            downsample_block_type="conv", upsample_block_type="interpolate",
            decoder_norm_types="rms_norm", decoder_act_fns="silu",
            scaling_factor=0.41407,  # Sana's DC-AE f32c32 constant
        )
        # Sana 1600M 1024px's scheduler_config.json.
        scheduler = DPMSolverMultistepScheduler(
            algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", lower_order_final=True,
            beta_schedule="linear", beta_start=0.0001, beta_end=0.02, num_train_timesteps=1000,
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, final_sigmas_type="zero",
            timestep_spacing="linspace", steps_offset=0,
        )
        pipe = SanaPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
        )
        return cls(pipe, device=device, dtype=dtype, **kwargs)  # kwargs: adapter options

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        pe, mask, neg_pe, neg_mask = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=with_uncond,
            negative_prompt="",
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=self.complex_human_instruction,
        )
        return PromptEmbeds.named(
            ("encoder_hidden_states", "encoder_attention_mask"), (pe, mask), (neg_pe, neg_mask) if with_uncond else None
        )

    def model_timestep(self, t: torch.Tensor) -> torch.Tensor:
        """Sigma -> the ``timestep`` the pipeline feeds the transformer (see the module docstring)."""
        if self.integer_timesteps:
            ts = torch.floor(t.double() * self.num_train_timesteps)  # t >= 0: floor == int64 truncation
        else:
            ts = t.float() * self.num_train_timesteps
        return (ts * self.pipeline.transformer.config.timestep_scale).float()

    def predict(self, x: torch.Tensor, t: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Velocity at ``(x, t)``, ``t`` = sigma in ``[0, 1]``."""
        transformer = self.pipeline.transformer
        dtype = module_dtype(transformer)
        latent_channels = x.shape[1]

        def forward(xb, tb, kw):
            out = transformer(
                xb.to(dtype),
                encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
                encoder_attention_mask=kw["encoder_attention_mask"],
                timestep=self.model_timestep(tb),
                return_dict=False,
            )[0]
            if out.shape[1] == 2 * latent_channels:  # learned sigma: keep the mean half, as the pipeline
                out = out.chunk(2, dim=1)[0]
            return out

        return self._guided(forward, x, t, embeds, guidance_scale)

    # decode: the default, z / scaling_factor through the DC-AE; make_schedule: the default, the
    # pipeline's own scheduler after set_timesteps(num_steps), what SanaPipeline calls.


# ---- tiny offline tokenizer --------------------------------------------------------------------
def tiny_gemma_tokenizer():
    """A byte-fallback BPE ``GemmaTokenizer`` built in memory: Gemma's special tokens (``<pad>``
    0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4), letters / digits / punctuation,
    the 256 ``<0xNN>`` byte tokens, and one token per word of ``TINY_WORDS`` (with and without the
    ``▁`` space marker). Adds ``<bos>`` like Gemma."""
    from transformers import GemmaTokenizer


    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for token in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"):
        add(token)
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;\n":
        add(c)
    for b in range(256):
        add(f"<0x{b:02X}>")
    merges: list[tuple[str, str]] = []
    for word in TINY_WORDS:
        left = word[0]
        for c in word[1:]:
            if (left, c) not in merges:
                merges.append((left, c))
            left += c
            add(left)
        merges.append(("▁", word))  # after the word itself: "▁red" = "▁" + "red"
        add("▁" + word)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
