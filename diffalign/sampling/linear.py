"""Samplers: a kernel bound to an adapter's time convention, SDE windows, and linear rollouts.

The sampler axis sits between models (adapters) and algorithms: it only calls
``adapter.predict`` and a pure step function from :mod:`schedulers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import schedulers
from diffalign import progress as progress_bars
from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.errors import ConfigError
from schedulers.common import StepOutput, coarse as coarse_coordinates

FLOW_KERNELS = ("flow_grpo", "cps", "dance")
# kernels whose step noise std is sigma_t * sqrt(|dt|), sigma_t the SDE's diffusion coefficient: the
# ones where Flow-GRPO's reference KL (divided by sigma_t^2, not by the step's variance) is defined
# (diffalign.config keeps a copy to validate configs without importing torch)
SQRT_DT_KERNELS = ("flow_grpo", "dance")


@dataclass
class Kernel:
    """One reverse-step rule. ``step`` samples ``x_{t'}`` (``prev_sample=None``) or re-scores a
    given one; ``sde=False`` takes the deterministic step (ODE for flow models, DDIM eta=0)."""

    name: str  # flow_grpo | cps | dance | ddim
    noise_level: float  # a / eta of the kernel
    std_schedule: str = "cps"  # cps kernel only
    reduction: str = "mean"  # log-prob reduction over latent dims
    noise_pool: int = 1  # flow_grpo only: SDE noise on pool x pool block-constant images (schedulers.flow_grpo_sde_step)
    alphas_cumprod: Optional[torch.Tensor] = None  # ddim only
    final_alpha_cumprod: Optional[torch.Tensor] = None  # ddim only

    def step(
        self,
        model_output: torch.Tensor,
        x: torch.Tensor,
        t: torch.Tensor,
        t_next: torch.Tensor,
        *,
        sde: bool = True,
        prev_sample: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        noise: Optional[torch.Tensor] = None,
    ) -> StepOutput:
        if self.name == "ddim":
            return schedulers.ddim_step_with_logprob(
                model_output, x, t, t_next,
                alphas_cumprod=self.alphas_cumprod, final_alpha_cumprod=self.final_alpha_cumprod,
                eta=self.noise_level if sde else 0.0, prev_sample=prev_sample, generator=generator,
                noise=noise, reduction=self.reduction,
            )
        if not sde:
            return schedulers.ode_step(model_output, x, t, t_next)
        common = dict(noise_level=self.noise_level, prev_sample=prev_sample, generator=generator, noise=noise, reduction=self.reduction)
        if self.name == "flow_grpo":
            return schedulers.flow_grpo_sde_step(model_output, x, t, t_next, noise_pool=self.noise_pool, **common)
        if self.name == "cps":
            return schedulers.cps_sde_step(model_output, x, t, t_next, std_schedule=self.std_schedule, **common)
        if self.name == "dance":
            return schedulers.dance_sde_step(model_output, x, t, t_next, **common)
        raise ConfigError(f"config key 'sampling.kernel' is unknown: {self.name!r}")

    def abs_dt(self, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
        """``|dt| = s - s'`` of steps from ``t`` to ``t_next`` (fp32, their shape), for the kernels
        whose noise std is ``sigma_t * sqrt(|dt|)`` (:data:`SQRT_DT_KERNELS`); the others have no
        such factor and raise :class:`ConfigError`."""
        if self.name not in SQRT_DT_KERNELS:
            raise ConfigError(f"the {self.name} kernel's step std is not sigma_t * sqrt(|dt|): it has no |dt| to scale a KL by")
        return (torch.as_tensor(t).float() - torch.as_tensor(t_next).float()).abs()

    def coarse(self, y: torch.Tensor) -> torch.Tensor:
        """The coordinates a step's density is over: ``y`` itself, or its block coordinates
        under ``noise_pool`` (what a KL between two steps' means must compare)."""
        return coarse_coordinates(y, self.noise_pool)


def build_kernel(adapter: ModelAdapter, name: str, noise_level: float, *, std_schedule: str = "cps", reduction: str = "mean",
                 noise_pool: int = 1) -> Kernel:
    """Check that the kernel fits the model's prediction type and bind what it needs."""
    if noise_pool != 1 and name != "flow_grpo":
        raise ConfigError(f"config key 'sampling.noise_pool' is {noise_pool}, but only the flow_grpo kernel supports it (kernel {name!r})")
    if adapter.prediction_type == "epsilon":
        if name != "ddim":
            raise ConfigError(
                f"config key 'sampling.kernel' is {name!r}, but {adapter.family} is an epsilon-prediction model: use 'ddim'"
            )
        return Kernel(name, noise_level, reduction=reduction, alphas_cumprod=adapter.alphas_cumprod,
                      final_alpha_cumprod=adapter.final_alpha_cumprod)
    if name not in FLOW_KERNELS:
        raise ConfigError(
            f"config key 'sampling.kernel' is {name!r}, but {adapter.family} is a flow model: use one of {', '.join(FLOW_KERNELS)}"
        )
    return Kernel(name, noise_level, std_schedule=std_schedule, reduction=reduction, noise_pool=noise_pool)


def sde_window_mask(
    num_steps: int,
    window_size: int,
    *,
    mode: str = "fixed",
    start: int = 0,
    iteration: int = 0,
    slide_every: int = 1,
    stride: int = 1,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """(num_steps,) bool: which steps are stochastic (and trained) this iteration.

    ``window_size == 0``: every step. ``fixed``: ``[start, start + size)``. ``sliding`` (MixGRPO):
    the window moves ``stride`` steps every ``slide_every`` iterations, wrapping back to ``start``
    when it would pass the last step. ``random`` (Flow-GRPO-Fast): a uniformly random start in
    ``[0, num_steps - size]`` each iteration, drawn from ``generator``.
    """
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if window_size == 0:
        mask[:] = True
        return mask
    last_start = num_steps - window_size
    if mode == "fixed":
        begin = start
    elif mode == "sliding":
        positions = list(range(start, last_start + 1, stride))
        begin = positions[(iteration // slide_every) % len(positions)]
    elif mode == "random":
        begin = int(torch.randint(0, last_start + 1, (1,), generator=generator).item())
    else:
        raise ConfigError(f"config key 'sampling.window_mode' is unknown: {mode!r}")
    mask[begin : begin + window_size] = True
    return mask


@dataclass
class Trajectory:
    """A batch of B linear rollouts of T steps.

    ``latents``: (B, T+1, *latent) fp32 — states at ``t_0`` (noise) ... ``t_T`` (final sample).
    ``log_probs``: (B, T) fp32 — log p(x_{i+1} | x_i) under the sampling policy; 0 on ODE steps.
    ``timesteps``: (T+1,) — the schedule ``t_0 > ... > t_T``.
    ``sde_mask``: (T,) bool — stochastic (trainable) steps.
    ``images``: (B, 3, H, W) fp32 in [0, 1] — decoded final samples; (B, F, 3, H, W) for video models.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sde_mask: torch.Tensor
    images: torch.Tensor

    def __len__(self) -> int:
        return self.latents.shape[0]

    @staticmethod
    def cat(items: list["Trajectory"]) -> "Trajectory":
        first = items[0]
        return Trajectory(
            torch.cat([t.latents for t in items]),
            torch.cat([t.log_probs for t in items]),
            first.timesteps,
            first.sde_mask,
            torch.cat([t.images for t in items]),
        )


@dataclass
class LinearStep:
    """One step ``i`` of a linear rollout, as :func:`sample_linear` passes it to ``on_step``.

    ``x``: (B, *latent) fp32 state before the step, at times ``t`` (B,); ``model_output``: the
    adapter's prediction there; ``out``: the kernel's step from ``x`` (``out.prev_sample`` is the
    next state); ``sde``: whether the step was stochastic.
    """

    index: int
    x: torch.Tensor
    t: torch.Tensor
    model_output: torch.Tensor
    out: StepOutput
    sde: bool


def draw_noise(adapter: ModelAdapter, batch_size: int, height: int, width: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Initial noise drawn on the generator's device (CPU by default, for reproducibility across devices)."""
    shape = (batch_size, *adapter.latent_shape(height, width))
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(adapter.device)


def _sharded(module: torch.nn.Module) -> bool:
    """Whether a sharding wrapper manages ``module``'s weights (torch FSDP2, DeepSpeed ZeRO): they
    gather the full weights into buffers that the next forward reuses, so gathering them in
    inference mode would leave inference tensors in an update's forward."""
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def sampling_mode(adapter: ModelAdapter):
    """The grad mode a rollout runs in: ``torch.inference_mode()``, or ``torch.no_grad()`` when the
    denoiser is sharded (see :func:`_sharded`)."""
    return torch.no_grad() if _sharded(adapter.denoiser) else torch.inference_mode()


@torch.no_grad()
def sample_linear(
    adapter: ModelAdapter,
    kernel: Kernel,
    embeds: PromptEmbeds,
    schedule: torch.Tensor,
    sde_mask: torch.Tensor,
    *,
    guidance_scale: float,
    height: int,
    width: int,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    step_noise: Optional[torch.Tensor] = None,
    keep_latents: bool = True,
    on_step: Optional[Callable[[LinearStep], None]] = None,
) -> Trajectory:
    """Roll out ``len(embeds)`` samples along ``schedule``; stochastic where ``sde_mask``.

    Noise comes from ``noise`` (initial, ``(B, *latent)``) and ``step_noise`` (``(B, T, *latent)``,
    used on SDE steps) when given — then results do not depend on how a batch is chunked or split
    across processes — else from ``generator``. With ``keep_latents=False`` only the first and
    last states are kept (evaluation). ``on_step`` is called with every :class:`LinearStep` as it
    is taken (the dense rollout of :mod:`diffalign.sampling.dense` estimates x0 there; progress
    bars advance there).
    """
    batch = len(embeds)
    x = noise if noise is not None else draw_noise(adapter, batch, height, width, generator)
    x = x.float().to(adapter.device)
    states = [x]
    num_steps = len(schedule) - 1
    log_probs = torch.zeros(batch, num_steps, dtype=torch.float32, device=adapter.device)
    # Inference mode: no view or version tracking per op (a few % of a small model's step). What
    # it makes cannot be saved for a backward, so what leaves here is rebuilt outside it (stack,
    # clone); on_step's tensors are inference tensors (to read or stack, not to train through).
    with sampling_mode(adapter):
        for i in range(num_steps):
            t = schedule[i].expand(batch).to(adapter.device)
            t_next = schedule[i + 1].expand(batch).to(adapter.device)
            model_output = adapter.predict(x, t, embeds, guidance_scale)
            eps = step_noise[:, i].to(adapter.device) if step_noise is not None else None
            sde = bool(sde_mask[i])
            out = kernel.step(model_output, x, t, t_next, sde=sde, generator=generator, noise=eps)
            if on_step is not None:
                on_step(LinearStep(i, x, t, model_output, out, sde))
            if out.log_prob is not None:
                log_probs[:, i] = out.log_prob
            x = out.prev_sample.float()
            if keep_latents or i == num_steps - 1:
                states.append(x)
        images = adapter.decode(x).float().clamp(0, 1)
    latents = torch.stack(states, dim=1)
    return Trajectory(latents, log_probs, schedule.clone(), sde_mask.clone(), images.clone())


@torch.no_grad()
def sample_images(
    adapter: ModelAdapter,
    prompts: list[str],
    *,
    num_steps: int,
    guidance_scale: float,
    resolution: int,
    seed: int,
    batch_size: int = 16,
    progress: Optional[str] = None,
) -> torch.Tensor:
    """Deterministic samples (flow ODE / DDIM eta=0) for ``prompts`` with a fixed seed, so that
    two models compared on the same seed start from the same noise. Returns (N, 3, H, W) on CPU.
    ``progress``: a bar with this description, advanced every denoising step
    (:mod:`diffalign.progress`)."""
    gen = torch.Generator("cpu").manual_seed(seed)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    out = []
    bar = None
    if progress is not None:
        bar = progress_bars.bar(total=len(range(0, len(prompts), batch_size)) * num_steps, desc=progress, unit="step")
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        embeds = adapter.encode_prompts(chunk, with_uncond=guidance_scale > 1)
        traj = sample_linear(adapter, kernel, embeds, schedule, mask, guidance_scale=guidance_scale,
                             height=resolution, width=resolution, generator=gen, keep_latents=False,
                             on_step=None if bar is None else lambda _step: bar.update())
        out.append(traj.images.cpu())
    if bar is not None:
        bar.close()
    return torch.cat(out)


@dataclass(frozen=True)
class SampleSpec:
    """How :func:`sample_images` draws a set of images: ODE / DDIM steps, CFG scale, image side
    (None: the adapter's default), noise seed and images per batch. Evaluations and
    preference-pair generation take one instead of five loose arguments."""

    num_steps: int = 20
    guidance_scale: float = 4.5
    resolution: Optional[int] = None
    seed: int = 0
    batch_size: int = 32

    def side(self, adapter: ModelAdapter) -> int:
        return self.resolution or adapter.default_resolution

    def sample(self, adapter: ModelAdapter, prompts: list[str], *, seed_offset: int = 0, progress: Optional[str] = None) -> torch.Tensor:
        """:func:`sample_images` of ``prompts`` with this spec and noise seed ``seed + seed_offset``."""
        return sample_images(adapter, prompts, num_steps=self.num_steps, guidance_scale=self.guidance_scale,
                             resolution=self.side(adapter), seed=self.seed + seed_offset, batch_size=self.batch_size,
                             progress=progress)
