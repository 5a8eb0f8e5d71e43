"""AWM recipe: ODE rollouts of the current policy -> rewards -> group advantages ->
advantage-weighted flow matching on the clean samples -> EMA adapter update.

Paper: Xue et al. 2025 (arXiv:2509.25050), reference ``scripts/train_sd3_awm.py`` and
``config/dgx_awm.py`` of scxue/advantage_weighted_matching. The math lives in
:mod:`diffalign.algorithms.awm`; this file orchestrates, reusing DiffusionNFT's machinery
(:class:`~diffalign.recipes.diffusion_nft.DiffusionNFTTrainer`): seeded ODE rollouts, the
advantages, and the second LoRA adapter — here the EMA policy of AWM's EMA-KL term, updated after
every iteration by ``ema <- d ema + (1 - d) theta``, ``d = min(rate * optimizer_steps, max)``
(reference: ``kl_ema_decay_type linear``, 0.001 and 0.3).

Per sample, ``algorithm.train_timesteps`` noise levels are drawn one per stratum of the rollout
schedule (reference ``time_type: discrete_wo_init``), fresh noise from per-(sample, level) seeds;
multi-process runs follow Flow-GRPO's scheme (global shuffles and seeds, global term counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from diffalign.algorithms.awm import WEIGHTINGS, awm_loss, stratified_levels
from diffalign.algorithms.diffusion_nft import ema_update_, old_policy_decay
from diffalign.config import AlgorithmConfig, GroupAdvantageOptions, check, check_ranges, method_defaults
from diffalign.recipes import register_recipe
from diffalign.recipes.diffusion_nft import OLD_ADAPTER, DiffusionNFTTrainer, SeededSamples


@dataclass
@method_defaults(filter_zero_std_groups=False)  # the reference keeps them (A = 0: only the KL terms act)
class AWMConfig(GroupAdvantageOptions, AlgorithmConfig):
    """``algorithm.*`` of AWM; the advantage keys (``advantage_clip`` then scaled to
    ``+-advantage_max``) from the shared mixin of :mod:`diffalign.config`."""

    name: str = "awm"
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"  # w(l, t) of the matching loss (reference: ghuber)
    ghuber_power: float = 0.25  # p of ghuber: t / p ((l + c)^p - c^p)
    advantage_max: float = 1.0  # ... then scaled to +- this (reference: A / 5)
    train_timesteps: int = 6  # noise levels trained per sample, one per stratum (reference: 6 of 14 steps)
    timestep_fraction: float = 0.9  # strata cover schedule indices up to int(num_steps * fraction) (reference: 0.9)
    time_type: Literal["discrete_wo_init", "discrete"] = "discrete_wo_init"  # skip sigma = 1 (reference) or not
    kl_beta: float = 3.0e-3  # mean((v_theta - v_ref)^2), reference = adapter disabled (reference: 0.003; 1e-4 for PickScore); 0 skips that forward
    ema_kl_beta: float = 1.0  # mean((v_theta - v_ema)^2) against the EMA adapter (reference ema_beta: 1); 0 skips that forward
    ema_decay_rate: float = 0.001  # EMA adapter: d = min(rate * optimizer_steps, ema_decay_max) ...
    ema_decay_max: float = 0.3  # ... (reference kl_ema_decay 0.3, linear)
    train_guidance_scale: float = 1.0  # CFG in the training forwards; 1 = conditional only (reference: train.cfg False)
    sample_with: Literal["current", "old"] = "current"  # rollouts with the trained adapter (reference off_policy False) or the EMA one

    # what DiffusionNFT's inherited rollout / EMA code reads
    @property
    def old_decay_rate(self) -> float:
        return self.ema_decay_rate

    @property
    def old_decay_max(self) -> float:
        return self.ema_decay_max

    old_decay_flat: int = 0

    renamed_keys = {"adv_clip": "advantage_clip"}

    def trained_steps_per_sample(self, sde_steps: int) -> int:  # one noise level per stratum
        return self.train_timesteps

    def rewards_in_groups(self) -> bool:
        return True

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.weighting in WEIGHTINGS, f"{prefix}.weighting", f"must be one of {', '.join(WEIGHTINGS)}")
        check(self.train_timesteps >= 1, f"{prefix}.train_timesteps", "must be >= 1")
        check_ranges(self, prefix, positive=("ghuber_power", "advantage_max"),
                     nonnegative=("kl_beta", "ema_kl_beta", "ema_decay_rate", "train_guidance_scale"),
                     fraction=("timestep_fraction",), decay=("ema_decay_max",))
        super().validate(prefix)


class AWMTrainer(DiffusionNFTTrainer):
    """DiffusionNFT's rollouts, advantages and second adapter; AWM's loss and noise levels."""

    def iteration(self, iteration: int) -> dict:
        record = super().iteration(iteration)
        record["ema_decay"] = record.pop("old_decay")
        return record

    def update_old_adapter(self) -> float:
        a = self.algo
        d = old_policy_decay(self.optimizer_steps_done, rate=a.ema_decay_rate, max_decay=a.ema_decay_max)
        ema_update_(self.old_params, self.trainable, d)
        return d

    def trained_levels(self, n_global: int) -> torch.Tensor:
        a = self.algo
        num_steps = self.cfg.sampling.num_steps
        return stratified_levels(num_steps, a.train_timesteps, fraction=a.timestep_fraction,
                                 skip_first=a.time_type == "discrete_wo_init", n=n_global, generator=self.generator)

    def update(self, samples: SeededSamples, advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        """AWM updates on this process's samples; ``advantages`` / ``keep`` are global (n_global,)."""
        algo, g = self.algo, self.algo.train_guidance_scale

        def batch_loss(x0, eps, t, x_t, emb, adv):
            with self.autocast():
                v_theta = self.adapter.predict(x_t, t, emb, g)
            v_ema = v_ref = None
            if algo.ema_kl_beta > 0:
                with torch.no_grad(), self.adapter_active(OLD_ADAPTER), self.autocast():
                    v_ema = self.adapter.predict(x_t, t, emb, g)
                if not self._checked:
                    self._self_check(v_theta.detach(), v_ema)
            if algo.kl_beta > 0:
                with torch.no_grad(), self.reference_model(), self.autocast():
                    v_ref = self.adapter.predict(x_t, t, emb, g)
            return awm_loss(v_theta, x0, eps, t, adv, v_ref=v_ref, v_ema=v_ema, weighting=algo.weighting,
                            ghuber_power=algo.ghuber_power, adv_clip=algo.advantage_clip, advantage_max=algo.advantage_max,
                            kl_beta=algo.kl_beta, ema_kl_beta=algo.ema_kl_beta)

        keys = ("loss", "policy_loss", "matching_loss", "kl", "ema_kl")
        return self.matching_update(samples, advantages, keep, self.trained_levels, batch_loss, keys)

    def print_header(self) -> None:
        super(DiffusionNFTTrainer, self).print_header()
        a = self.algo
        self.log(f"  AWM: rollouts with the {self.sampling_adapter!r} adapter (ODE, {self.cfg.sampling.num_steps} steps), "
                 f"{a.train_timesteps} noise levels per sample, weighting {a.weighting}, KL {a.kl_beta}, EMA-KL {a.ema_kl_beta} "
                 f"(EMA decay min({a.ema_decay_rate} x steps, {a.ema_decay_max}))")


register_recipe("awm", AWMConfig, AWMTrainer)

__all__ = ["AWMConfig", "AWMTrainer"]
