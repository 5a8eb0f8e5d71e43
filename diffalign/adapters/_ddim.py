"""What SD1.x and SDXL share: a UNet on DDPM timesteps, sampled with DDIM (not public API).

Sampling uses DDIM (the DDPO / SPO kernel) whatever scheduler the checkpoint ships (SD1.5 ships
PNDM, SDXL Euler): a ``DDIMScheduler`` is built from the pipeline's scheduler config, so the
betas, ``steps_offset``, ``timestep_spacing`` and ``set_alpha_to_one`` are the checkpoint's.
``predict`` must always return an epsilon prediction: a ``v_prediction`` checkpoint is converted
with ``eps = sqrt(abar_t) * v + sqrt(1 - abar_t) * x_t`` (:meth:`UNetDDIMMixin._as_epsilon`);
``sample`` prediction is refused.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError
from ._util import bcast

FINAL_T = -1.0  # schedule entry meaning "the clean state", whose abar is final_alpha_cumprod
SUPPORTED_UNET_PREDICTIONS = ("epsilon", "v_prediction")


class UNetDDIMMixin:
    """DDIM schedule quantities, Tweedie and latent shapes for epsilon adapters with a UNet.

    The adapter calls :meth:`_init_ddim` from its ``__init__`` (after ``ModelAdapter.__init__``)
    and gets :attr:`scheduler`, :attr:`model_prediction_type`, :attr:`vae_scale_factor`,
    :attr:`alphas_cumprod`, :attr:`final_alpha_cumprod`, :meth:`alpha_cumprod_at`,
    :meth:`to_x0`, :meth:`make_schedule` and :meth:`latent_shape`.
    """

    family: str
    pipeline: object

    def _init_ddim(self, pipeline) -> None:
        from diffusers import DDIMScheduler

        self.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
        self.model_prediction_type = self.scheduler.config.prediction_type  # what the UNet outputs
        if self.model_prediction_type not in SUPPORTED_UNET_PREDICTIONS:
            raise ModelLoadError(
                f"{self.family}: scheduler prediction_type {self.model_prediction_type!r} is not supported "
                f"(supported: {', '.join(repr(p) for p in SUPPORTED_UNET_PREDICTIONS)})"
            )
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.default_resolution = pipeline.unet.config.sample_size * self.vae_scale_factor

    # ---- DDIM quantities ----------------------------------------------------------------
    @property
    def alphas_cumprod(self) -> torch.Tensor:
        """``abar_t`` for ``t = 0 .. num_train_timesteps - 1`` (fp32, CPU)."""
        return self.scheduler.alphas_cumprod.float()

    @property
    def final_alpha_cumprod(self) -> torch.Tensor:
        """``abar`` of the state after the last DDIM step (``t = -1``): 1 with
        ``set_alpha_to_one``, else ``abar_0`` (SD1.5, SDXL). A 0-dim fp32 tensor."""
        return torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32)

    def alpha_cumprod_at(self, t: torch.Tensor) -> torch.Tensor:
        """``abar_t`` for a tensor of timesteps, with ``t < 0`` mapping to the final value."""
        t = torch.as_tensor(t)
        table = self.alphas_cumprod.to(t.device)
        abar = table[t.long().clamp(min=0)]
        return torch.where(t < 0, self.final_alpha_cumprod.to(t.device), abar)

    def _as_epsilon(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The UNet's (guided) output as epsilon; guidance is linear, so converting after it is exact."""
        if self.model_prediction_type == "v_prediction":
            abar = bcast(self.alpha_cumprod_at(t), x)
            return abar.sqrt() * out + (1 - abar).sqrt() * x.float()
        return out

    # ---- contract methods ---------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        # Every down block beyond the first halves the latent, so its size must divide by 2^(levels-1).
        config = self.pipeline.unet.config
        multiple = self.vae_scale_factor * 2 ** (len(config.block_out_channels) - 1)
        return self._latent_shape(height, width, multiple=multiple, channels=config.in_channels, downsample=self.vae_scale_factor)

    def to_x0(self, model_output: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x0_hat = (x_t - sqrt(1 - abar_t) * eps) / sqrt(abar_t)``."""
        abar = bcast(self.alpha_cumprod_at(torch.as_tensor(t, device=x.device)), x)
        return (x.float() - (1 - abar).sqrt() * model_output.float()) / abar.sqrt()

    def make_schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The stock ``DDIMScheduler.set_timesteps(num_steps)`` timesteps (the checkpoint's
        spacing and ``steps_offset``), then ``-1`` for the clean state: ``num_steps + 1`` values."""
        from diffusers import DDIMScheduler

        scheduler = DDIMScheduler.from_config(self.scheduler.config)  # fresh: no shared step state
        scheduler.set_timesteps(num_steps, device="cpu")
        return torch.cat([scheduler.timesteps.float(), torch.tensor([FINAL_T])])
