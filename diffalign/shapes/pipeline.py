"""``ShapesPipeline``: the embedded text-to-image flow model as a regular diffusers pipeline.

Pixel-space rectified flow at 32x32 (no VAE): the sample ``x`` is the image mapped to
``[-1, 1]``; ``x_t = (1 - t) * x0 + t * eps`` with ``t`` = sigma in ``[0, 1]``; the UNet
predicts the velocity ``v = eps - x0`` and takes ``t * 1000`` as its timestep input (the
``timesteps`` of ``FlowMatchEulerDiscreteScheduler``).

Use it like any diffusers pipeline (``ShapesPipeline`` and ``SHIPPED_MODEL_DIR`` are this module's)::

    pipe = ShapesPipeline.from_pretrained(SHIPPED_MODEL_DIR)
    images = pipe(["two red circles"], generator=torch.Generator().manual_seed(0)).images

Components: ``text_encoder`` (``CLIPTextModel``, ``BertModel`` (the shipped model's) or ``T5EncoderModel``),
``tokenizer`` (``CLIPTokenizer``), ``unet`` (``UNet2DConditionModel``), ``scheduler``
(``FlowMatchEulerDiscreteScheduler``); see
:mod:`diffalign.shapes.model` for the architecture.

Without diffalign: this file and ``coordinates.py`` (its one relative import) need only torch and
diffusers (diffusers reads every line that starts with ``import`` or ``from ... import``, docstrings
too, as an import the file needs: none here names diffalign). ``diffalign export`` copies both into an exported pipeline folder and names them in its
``model_index.json`` (``"_class_name": ["pipeline", "ShapesPipeline"]``), diffusers' layout for a
pipeline whose code lives in the folder, so that
``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel
from diffusers.loaders import StableDiffusionLoraLoaderMixin
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from .coordinates import attach_coordinates  # relative: the exported copy imports its neighbour file

# The pretrained model shipped inside the package (a few MB of safetensors).
SHIPPED_MODEL_DIR = str(Path(__file__).resolve().parent.parent / "assets" / "shapes-t2i")

DEFAULT_GUIDANCE_SCALE = 4.0  # CFG scale of the shipped model's reported accuracy; not its best (diffalign eval --best-scale)


class ShapesPipeline(DiffusionPipeline, StableDiffusionLoraLoaderMixin):
    # LoRA loading/saving as for SD1.5 (`unet` + `text_encoder`): pipe.load_lora_weights(run_dir / 'final')
    model_cpu_offload_seq = "text_encoder->unet"

    def __init__(self, text_encoder, tokenizer, unet: UNet2DConditionModel, scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler)
        if unet is not None:
            attach_coordinates(unet)  # a UNet with coordinate input channels appends them itself

    @classmethod
    def load_config(cls, *args, **kwargs):
        """diffusers' ``load_config``; a ``model_index.json`` that names the folder's own copy of the
        code (``"_class_name": ["pipeline", "ShapesPipeline"]``, an export's) reads as this class, so
        ``ShapesPipeline.from_pretrained(folder)`` loads with this code and runs none of the folder's."""
        loaded = super().load_config(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        name = config.get("_class_name")
        if isinstance(name, (list, tuple)) and list(name)[-1] == cls.__name__:
            config["_class_name"] = cls.__name__
        return loaded

    @property
    def sample_size(self) -> int:
        return int(self.unet.config.sample_size)

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """Token ids ``(B, L)``, padded with ``<|endoftext|>`` to ``model_max_length``."""
        return self.tokenizer(
            list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
            truncation=True, return_tensors="pt",
        ).input_ids

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[str], device=None) -> torch.Tensor:
        """Text -> ``encoder_hidden_states`` ``(B, L, D)``. As in Stable Diffusion, no attention
        mask is passed: CLIP's causal attention keeps padding from changing the prompt tokens
        (a bidirectional encoder sees the padding it was trained with), and the UNet attends to the
        padding positions it was trained with."""
        device = device or self.text_encoder.device
        ids = self.tokenize(prompts).to(device)
        return self.text_encoder(ids).last_hidden_state

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """UNet velocity ``v = eps - x0`` at ``(x, sigma)``; ``sigma`` has shape ``(B,)`` in [0, 1]."""
        return self.unet(x, sigma * 1000.0, encoder_hidden_states=encoder_hidden_states).sample

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        num_inference_steps: int = 20,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        num_images_per_prompt: int = 1,
        height: Optional[int] = None,
        width: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        latents: Optional[torch.Tensor] = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ):
        """Deterministic Euler ODE sampling from ``t = 1`` (noise) to ``t = 0``.

        ``guidance_scale > 1`` enables classifier-free guidance (cond and uncond in one batched
        forward). ``output_type``: ``"pil"`` (list of PIL images), ``"pt"`` (``(B, 3, H, W)``
        fp32 in [0, 1]), ``"np"`` (``(B, H, W, 3)`` in [0, 1]) or ``"latent"`` (``x`` in [-1, 1]).
        """
        if output_type not in ("pil", "pt", "np", "latent"):
            raise ValueError(f"output_type must be 'pil', 'pt', 'np' or 'latent', got {output_type!r}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        height = height or self.sample_size
        width = width or self.sample_size
        device = self._execution_device
        dtype = self.unet.dtype

        cond = self.encode_prompt(prompts, device).to(dtype)
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            uncond = self.encode_prompt([""] * len(prompts), device).to(dtype)
            context = torch.cat([uncond, cond])
        else:
            context = cond

        if latents is None:
            noise_device = generator.device if generator is not None else torch.device("cpu")
            latents = torch.randn((len(prompts), 3, height, width), generator=generator, device=noise_device)
        x = latents.to(device=device, dtype=torch.float32)

        self.scheduler.set_timesteps(num_inference_steps, device=device)
        for t in self.progress_bar(self.scheduler.timesteps):
            x_in = torch.cat([x, x]) if do_cfg else x
            v = self.unet(x_in.to(dtype), t.expand(x_in.shape[0]), encoder_hidden_states=context).sample.float()
            if do_cfg:
                v_uncond, v_cond = v.chunk(2)
                v = v_uncond + guidance_scale * (v_cond - v_uncond)
            x = self.scheduler.step(v, t, x).prev_sample

        self.maybe_free_model_hooks()
        if output_type == "latent":
            images = x
        else:
            images = ((x + 1) / 2).clamp(0, 1)
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).cpu().numpy()
            elif output_type == "pil":
                images = self.numpy_to_pil(images.permute(0, 2, 3, 1).cpu().numpy())
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)
