"""DRaFT / ReFL recipe: sample with the policy, keep the graph through the last steps, decode,
score with a differentiable reward and descend ``-reward``.

Papers: Clark et al. 2023 (DRaFT-K, DRaFT-LV; arXiv:2309.17400), Xu et al. 2023 (ReFL, the
ImageReward paper; arXiv:2304.05977). The truncation and the loss are pure functions in
:mod:`diffalign.algorithms.drft`; this file binds them to the adapter, the kernel and the reward.

Every micro-batch of ``train.batch_size`` samples is rolled out inside the update (on-policy by
construction: there is no old policy, no log-probability and no advantage), from the iteration's
prompts and noise drawn globally (:meth:`~diffalign.trainer.Trainer.plan_group_rollout`, so N
processes draw what one does; ``rollout.group_size`` images per prompt). ``algorithm.mode``:

- ``drft``: the last ``grad_steps`` (K) sampling steps with gradient, the earlier ones under
  no_grad; K = 1 is DRaFT-1;
- ``refl``: stop at a random step ``s`` with ``s / num_steps`` in ``refl_range`` (one draw per
  micro-batch) and predict x0 in one step with gradient (``adapter.to_x0``: flow models
  ``x_s - t_s v``);
- ``drft_lv``: the whole rollout without gradient, then ``lv_samples`` times: re-noise the sample
  to the last step's noise level with fresh noise and take that step with gradient; the loss is
  the mean over the re-noisings.

Sampling uses the ODE (``sampling.kernel``'s deterministic step) unless ``algorithm.stochastic``,
which takes the kernel's SDE step with the plan's fixed noise (the reparameterised sample: the
gradient flows through the step's mean). CFG at ``sampling.guidance_scale`` as in every recipe
(``train.detach_uncond`` drops the unconditional branch's gradient). ``checkpoint_steps``
recomputes each grad-carrying step in the backward pass (``torch.utils.checkpoint``): the stored
activations of one step instead of K (``docs/drft.md`` has the measured sizes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

import reward_models
from diffalign.algorithms.drft import MODES, drft_loss, refl_rollout, refl_stop_candidates, refl_stop_steps, truncated_rollout
from diffalign.config import AlgorithmConfig, check, check_ranges
from diffalign.errors import ConfigError
from diffalign.forward_process import add_noise
from diffalign.recipes import register_recipe
from diffalign.trainer import Trainer
from diffalign.training.groups import GroupRollout
from diffalign.training.rewards import reward_info


# ImageReward's ReFL samples 40 steps and stops at a step drawn from 30..39 (s steps taken, x0
# predicted from there): s / num_steps in [30 / 40, 39 / 40].
REFL_REFERENCE_STEPS, REFL_REFERENCE_STOPS = 40, (30, 39)
REFL_RANGE = tuple(s / REFL_REFERENCE_STEPS for s in REFL_REFERENCE_STOPS)  # (0.75, 0.975)


@dataclass
class DrftConfig(AlgorithmConfig):
    """``algorithm.*`` of DRaFT-K / DRaFT-LV / ReFL (docs/drft.md)."""

    name: str = "drft"
    mode: Literal["drft", "refl", "drft_lv"] = "drft"  # which gradient estimate (module docstring)
    grad_steps: int = 1  # K of DRaFT-K: the last K sampling steps carry gradient (the paper: K = 1 is best per cost)
    refl_range: list[float] = field(default_factory=lambda: list(REFL_RANGE))  # ReFL stops at s with s / num_steps in this range
    lv_samples: int = 2  # DRaFT-LV: re-noisings of the final sample (the paper: 2)
    reward_scale: float = 1.0  # loss = -reward_scale x mean reward
    stochastic: bool = False  # sample with the kernel's SDE step (fixed noise) instead of the ODE
    checkpoint_steps: bool = True  # recompute grad-carrying steps in the backward (memory of one step, not K)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.mode in MODES, f"{prefix}.mode", f"must be one of {', '.join(MODES)}")
        check(self.grad_steps >= 1, f"{prefix}.grad_steps", "must be >= 1")
        check(self.lv_samples >= 1, f"{prefix}.lv_samples", "must be >= 1")
        r = self.refl_range
        check(isinstance(r, list) and len(r) == 2 and all(isinstance(v, (int, float)) for v in r) and 0 <= r[0] <= r[1] < 1,
              f"{prefix}.refl_range", "must be [lo, hi] with 0 <= lo <= hi < 1 (fractions of the sampling steps)")
        check_ranges(self, prefix, positive=("reward_scale",))
        super().validate(prefix)

    def trained_steps_per_sample(self, sde_steps: int) -> int:  # one loss term (one backward) per sample
        return 1

    def needs_differentiable_reward(self) -> bool:
        return True


class DrftTrainer(Trainer):
    """Rollouts with a truncated graph -> differentiable reward -> ``-reward`` descended."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: DrftConfig = cfg.algorithm
        if cfg.train.inner_epochs != 1:
            raise ConfigError("config key 'train.inner_epochs' must be 1 for drft (every micro-batch samples afresh)")
        a, steps = self.algo, cfg.sampling.num_steps
        if a.mode == "drft" and a.grad_steps > steps:
            raise ConfigError(f"config key 'algorithm.grad_steps' is {a.grad_steps}, more than sampling.num_steps={steps}")
        if a.mode == "refl":
            try:
                refl_stop_candidates(steps, *a.refl_range)
            except ValueError as exc:
                raise ConfigError(f"config key 'algorithm.refl_range': {exc}") from None

    # ---- one sample's graph -----------------------------------------------------------------
    def make_step(self, schedule: torch.Tensor, embeds, step_noise: torch.Tensor | None):
        """``step(i, x_i) -> x_{i+1}``: the policy's prediction (CFG) and the kernel's ODE step, or
        its SDE step with the fixed ``step_noise[:, i]`` when ``algorithm.stochastic``."""
        dev, g = self.device, self.cfg.sampling.guidance_scale

        def step(i: int, x: torch.Tensor) -> torch.Tensor:
            t = schedule[i].expand(x.shape[0]).to(dev)
            t_next = schedule[i + 1].expand(x.shape[0]).to(dev)
            with self.autocast():
                out = self.adapter.predict(x, t, embeds, g)
            noise = step_noise[:, i].to(dev) if step_noise is not None else None
            return self.kernel.step(out, x, t, t_next, sde=self.algo.stochastic, noise=noise).prev_sample.float()

        return step

    def make_predict_x0(self, schedule: torch.Tensor, embeds):
        """``predict_x0(i, x_i)``: the one-step clean estimate at step i (``adapter.to_x0``)."""
        dev, g = self.device, self.cfg.sampling.guidance_scale

        def predict_x0(i: int, x: torch.Tensor) -> torch.Tensor:
            t = schedule[i].expand(x.shape[0]).to(dev)
            with self.autocast():
                out = self.adapter.predict(x, t, embeds, g)
            return self.adapter.to_x0(out, x, t)

        return predict_x0

    def final_latents(self, plan: GroupRollout, rows: torch.Tensor, stop: int, lv_noise: torch.Tensor | None) -> torch.Tensor:
        """The latents the reward scores for local ``rows`` of ``plan``, with the mode's graph:
        (B, *latent), or (B x lv_samples, *latent) for DRaFT-LV (sample-major)."""
        a, T = self.algo, self.cfg.sampling.num_steps
        emb = plan.embeds.select(rows.to(plan.embeds.cond[next(iter(plan.embeds.cond))].device))
        noise = plan.step_noise[rows] if plan.step_noise is not None else None
        step = self.make_step(plan.schedule, emb, noise)
        x = plan.noise[rows].to(self.device).float()
        if a.mode == "drft":
            return truncated_rollout(step, x, T, a.grad_steps, checkpoint_steps=a.checkpoint_steps)
        if a.mode == "refl":
            return refl_rollout(step, self.make_predict_x0(plan.schedule, emb), x, stop)
        x0 = truncated_rollout(step, x, T, 0)  # drft_lv: the sample without gradient ...
        n = a.lv_samples
        t1 = plan.schedule[T - 1].expand(len(rows) * n)
        x_t1 = add_noise(self.adapter, x0.repeat_interleave(n, dim=0), lv_noise.flatten(0, 1).to(self.device), t1.to(self.device))
        last = self.make_step(plan.schedule, emb.repeat_interleave(n), None if noise is None else noise.repeat_interleave(n, dim=0))
        return last(T - 1, x_t1)  # ... re-noised n times, the last step with gradient

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        cfg, a = self.cfg, self.algo
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        t0 = time.perf_counter()
        plan = self.plan_group_rollout(iteration, with_step_noise=a.stochastic)
        bs = cfg.train.batch_size
        micro = [torch.arange(s, min(s + bs, plan.n_local)) for s in range(0, plan.n_local, bs)]
        stops = torch.zeros(len(micro), dtype=torch.long)
        if a.mode == "refl":  # one stop per micro-batch, drawn globally (same stream on every process)
            stops = refl_stop_steps(cfg.sampling.num_steps, *a.refl_range, len(micro) * world, self.generator)[rank * len(micro):]
        lv_noise = None
        if a.mode == "drft_lv":
            latent = self.adapter.latent_shape(self.resolution, self.resolution)
            lv_noise = torch.randn((plan.n_global, a.lv_samples, *latent), generator=self.generator)[plan.first: plan.first + plan.n_local]
        stats = {"loss": [], "reward": [], "grad_norm": []}
        results: list[tuple[torch.Tensor, dict]] = []
        steps_applied = 0
        self.adapter.denoiser.train()
        for group in self.plan_optimizer_steps([len(r) for r in micro]):
            bad = False
            for m in group.micro:
                rows = micro[m]
                latents = self.final_latents(plan, rows, int(stops[m]), None if lv_noise is None else lv_noise[rows])
                n_rep = len(latents) // len(rows)  # lv_samples for DRaFT-LV, else 1
                prompts = [plan.sample_prompts[int(r)] for r in rows for _ in range(n_rep)]
                images = self.adapter.decode_with_grad(latents).float().clamp(0, 1)
                self.guard_finals(images, prompts, iteration)  # train.guard's verifier (no gradient: it scores a detached copy)
                rewards = self.call_reward(images, prompts)  # retried on failure, as every recipe's
                scored = self.check_rewards(reward_models.check_reward_output(cfg.reward.name, rewards, len(prompts)), iteration)
                results.append((scored, dict(getattr(self.reward_fn, "last_info", None) or {})))
                out = drft_loss(rewards, scale=a.reward_scale, normalizer=group.global_terms * n_rep)
                if not self.accumulate(out.loss):
                    bad = True
                if math.isfinite(float(out.reward_mean)):
                    stats["reward"].append(float(out.reward_mean))
                    stats["loss"].append(-a.reward_scale * float(out.reward_mean))
            _, applied = self.close_step(bad, stats)
            steps_applied += int(applied)
        record = self.mean_stats(stats)
        record["reward_mean"] = record.pop("reward")
        record["optimizer_steps"] = steps_applied
        record.update(self.gather_info(reward_info(results)))
        record["time/iteration"] = time.perf_counter() - t0
        return record

    def print_header(self) -> None:
        super().print_header()
        a, T = self.algo, self.cfg.sampling.num_steps
        sampler = f"{self.cfg.sampling.kernel} SDE (fixed noise)" if a.stochastic else "ODE"
        what = {"drft": f"gradient through the last {a.grad_steps} of {T} steps",
                "refl": f"one-step x0 prediction from a step s with s / {T} in {a.refl_range}",
                "drft_lv": f"the last step re-noised {a.lv_samples} times"}[a.mode]
        self.log(f"  {a.mode}: {sampler} rollouts, {what}, loss -{a.reward_scale:g} x reward "
                 f"({self.cfg.reward.name}){', per-step checkpointing' if a.checkpoint_steps else ''}")


register_recipe("drft", DrftConfig, DrftTrainer)

__all__ = ["DrftConfig", "DrftTrainer"]
