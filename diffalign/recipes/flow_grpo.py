"""Flow-GRPO recipe: SDE group rollouts -> rewards -> group advantages -> clipped PPO updates.

Also covers DDPO-style GRPO on epsilon models (``sampling.kernel: ddim``), Flow-GRPO-Fast
(``sampling.window_mode: random``) and MixGRPO's sliding SDE window (``window_mode: sliding``).
The math lives in :mod:`diffalign.algorithms.flow_grpo`; this file only orchestrates.

Multi-process runs are exact: every process draws the same global prompts, noise and shuffles
from the shared seed and takes its own slice, rewards are gathered for the advantages, losses are
normalised by the global number of (sample, step) terms, and gradients are summed across
processes. Two processes therefore compute the same update as one process over the same samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from diffalign.algorithms.flow_grpo import TRUST_REGIONS, gaussian_mean_kl
from diffalign.config import AlgorithmConfig, ClippedPolicyOptions, GroupAdvantageOptions, check, fraction_of_steps, method_defaults
from diffalign.errors import ConfigError
from diffalign.recipes import register_recipe
from diffalign.recipes._clipped import accumulate_clipped, reference_kl
from diffalign.recipes._grpo_guard import make_guard
from diffalign.sampling import Trajectory
from diffalign.trainer import Trainer
from diffalign.training.rewards import reward_info
from diffalign.training.groups import (gathered_group_advantages, sample_group_chunks, sample_level_batches,
                                       shuffled_share)


@dataclass
@method_defaults(beta=0.04)
class FlowGRPOConfig(GroupAdvantageOptions, ClippedPolicyOptions, AlgorithmConfig):
    """``algorithm.*`` of Flow-GRPO; advantage, clipped-loss and guard_* keys from the shared mixins
    of :mod:`diffalign.config` (GRPO-Guard: docs/grpo_guard.md)."""

    name: str = "flow_grpo"
    train_timestep_fraction: float = 0.99  # fraction of SDE steps trained per sample (0.99 of 10 -> 9)
    timestep_selection: Literal["first", "random"] = "first"  # which SDE steps: the first ones, or random per sample
    # how the update stays near the rollout policy: "clip" = PPO's clipped ratio (clip_range);
    # "kl_mask" = Flow-DPPO: the unclipped ratio, each step's gradient masked where the KL of its old
    # and current Gaussian step reaches kl_mask_threshold and the step moves farther out (docs/flow_dppo.md)
    trust_region: Literal["clip", "kl_mask"] = "clip"
    kl_mask_threshold: float = 1.0e-5  # Flow-DPPO's epsilon_D: mean((mu - mu_old)^2) / (2 std^2) per latent element (verl-omni's default)

    def validate(self, prefix: str = "algorithm") -> None:
        check(0 < self.train_timestep_fraction <= 1, f"{prefix}.train_timestep_fraction", "must be in (0, 1]")
        check(self.trust_region in TRUST_REGIONS, f"{prefix}.trust_region", f"must be one of {', '.join(TRUST_REGIONS)}")
        check(self.kl_mask_threshold > 0, f"{prefix}.kl_mask_threshold", "must be > 0")
        check(not (self.trust_region == "kl_mask" and self.guard_ratio_norm), f"{prefix}.trust_region",
              "kl_mask needs the policy's own log-ratio; it cannot run with guard_ratio_norm (GRPO-Guard's normalised ratio)")
        super().validate(prefix)

    def check_sampling(self, sampling, prefix: str = "algorithm") -> None:
        check(not (self.trust_region == "kl_mask" and sampling.noise_pool != 1), f"{prefix}.trust_region",
              "kl_mask recovers each old step's mean from the rollout's full-resolution step noise: sampling.noise_pool must be 1")
        super().check_sampling(sampling, prefix)

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        return fraction_of_steps(sde_steps, self.train_timestep_fraction)

    def rewards_in_groups(self) -> bool:
        return True


class FlowGRPOTrainer(Trainer):
    supports_fsdp = True
    supports_context_parallel = True  # group rollouts from plan_group_rollout, rewards from gathered_group_advantages
    supports_sample_offload = True

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: FlowGRPOConfig = cfg.algorithm
        self.needs_reference = self.algo.beta > 0
        self._checked = False  # on-policy self-check done
        if self.algo.guard_active and cfg.sampling.noise_pool != 1:
            raise ConfigError("config key 'sampling.noise_pool' must be 1 with GRPO-Guard (its ratio normalisation assumes "
                              "full-resolution noise)")

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """Sample this process's share of the iteration's groups and score them.

        Returns (trajectory, embeds, prompts, global sample indices, rewards, reward info)."""
        plan = self.plan_group_rollout(iteration)
        trajs, futures = [], []
        for idx, traj in sample_group_chunks(self, plan):
            trajs.append(traj)
            futures.append(self.score_async(traj.images, plan.sample_prompts[idx], plan.group_ids[idx]))  # overlaps the next chunk
            self.guard_finals(traj.images, plan.sample_prompts[idx], iteration)  # train.guard's verifier
        results = self.reward_results(futures)  # every process learns here of a reward failure on any
        rewards = torch.cat([r for r, _ in results])
        info = self.gather_info(reward_info(results))  # per-batch means, then over processes
        sample_ids = torch.arange(plan.first, plan.first + plan.n_local)
        # the rollout's step noise, kept where an update needs each old step's mean (x' - std eps):
        # GRPO-Guard's analytic norm, Flow-DPPO's KL mask
        keep_noise = getattr(self.algo, "guard_ratio_norm", False) or self.algo.trust_region == "kl_mask"
        self._step_noise = plan.step_noise if keep_noise else None
        return Trajectory.cat(trajs), plan.embeds, sample_ids, plan.n_global, rewards, info

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo = self.algo
        t0 = time.perf_counter()
        traj, embeds, sample_ids, n_global, rewards, info = self.rollout(iteration)
        traj, embeds = self.stash_samples(traj, embeds)  # CPU memory until the update (rollout.offload_samples)
        t_rollout = time.perf_counter() - t0
        adv, record = gathered_group_advantages(self, rewards, n_global, iteration, algo)
        record.update(info)
        t0 = time.perf_counter()
        record.update(self.update(traj, embeds, sample_ids, n_global, adv.advantages, adv.keep))
        record.update({"time/rollout": t_rollout, "time/update": time.perf_counter() - t0})
        return record

    # ---- policy update ----------------------------------------------------------------------
    def trained_steps(self, sde_mask: torch.Tensor, n_samples: int) -> torch.Tensor:
        """(n_samples, K) step indices trained for each sample: K = fraction x #SDE steps."""
        candidates = torch.nonzero(sde_mask).flatten()
        frac = self.algo.train_timestep_fraction
        k = len(candidates) if frac >= 1 else max(1, int(len(candidates) * frac + 1e-9))
        if self.algo.timestep_selection == "first":
            return candidates[:k].expand(n_samples, k).clone()
        perms = torch.stack([torch.randperm(len(candidates), generator=self.generator)[:k] for _ in range(n_samples)])
        return candidates[perms]

    def update(self, traj: Trajectory, embeds, sample_ids: torch.Tensor, n_global: int,
               advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        """Clipped policy-gradient updates on this process's samples.

        ``advantages`` / ``keep`` are global (n_global,); ``sample_ids`` maps local rows to global ids.
        """
        cfg, algo = self.cfg, self.algo
        g = cfg.sampling.guidance_scale
        dev = self.device
        first_local = int(sample_ids[0])
        stats = {"loss": [], "policy_loss": [], "kl": [], "clip_frac": [], "approx_kl": [], "ratio_mean": [], "grad_norm": []}
        steps_applied = 0
        guard = make_guard(self, algo, traj.timesteps, torch.nonzero(traj.sde_mask).flatten(), reduction=algo.logprob_reduction,
                           step_noise=getattr(self, "_step_noise", None) if algo.guard_ratio_norm else None)  # GRPO-Guard (None when off)
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            # Global shuffle and step choice (same RNG use on every process), then our share.
            perm = torch.randperm(n_global, generator=self.generator)
            step_idx_global = self.trained_steps(traj.sde_mask, n_global)  # (n_global, K)
            order_global, order = shuffled_share(perm, first_local, len(sample_ids), keep)
            step_idx = step_idx_global[order_global]
            micro = sample_level_batches(len(order), cfg.train.batch_size, step_idx.shape[1])
            # The loss of a step is its global mean; a step with no term anywhere (all groups zero-std) is left out.
            for group in self.plan_optimizer_steps([len(order[b]) for b, _ in micro]):
                bad = False
                for m in group.micro:
                    b, j = micro[m]
                    rows = order[b]
                    steps = step_idx[b, j]
                    x = traj.latents[rows, steps].to(dev)
                    x_next = traj.latents[rows, steps + 1].to(dev)
                    t = traj.timesteps[steps].to(dev)
                    t_next = traj.timesteps[steps + 1].to(dev)
                    emb = self.to_device(embeds.select(rows.to(embeds.cond[next(iter(embeds.cond))].device)))
                    with self.autocast():
                        out = self.adapter.predict(x, t, emb, g)
                    step = self.kernel.step(out, x, t, t_next, sde=True, prev_sample=x_next)
                    old_logp = traj.log_probs[rows, steps].to(dev)
                    if not self._checked:
                        self.check_log_ratio(step.log_prob.detach(), old_logp, f"at steps {sorted(set(steps.tolist()))}")
                    kl = None
                    if algo.beta > 0:
                        kl = reference_kl(self, x, t, emb, g, step, lambda ref_out: self.kernel.step(
                            ref_out, x, t, t_next, sde=True, prev_sample=x_next), step_times=(t, t_next))
                    logp, adv = step.log_prob, advantages[rows + first_local].to(dev)
                    policy_kl = self.policy_kl(step, rows, steps, x_next) if algo.trust_region == "kl_mask" else None
                    if guard is not None:
                        logp, old_logp, adv = guard(step, old_logp, adv, steps, rows=rows, x_next=x_next)
                    if not accumulate_clipped(self, logp, old_logp, adv, kl, algo, group.global_terms, stats, policy_kl=policy_kl):
                        bad = True
                for _ in range(group.forwards - len(group.micro)):  # FSDP: the same forwards everywhere
                    self._idle_forward(traj, embeds, g)
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
                self._checked |= applied  # the policy has moved: later ratios need not be 1
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        if guard is not None:
            out.update(guard.metrics())
        return out

    def policy_kl(self, step, rows: torch.Tensor, steps: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
        """(B,) KL of each rollout step and its re-scored step, ``mean((mu - mu_old)^2) / (2 std^2)``
        (Flow-DPPO's D): the old mean is the rollout's state less its noise, ``x' - std eps``."""
        std = step.std.float()
        eps = self._step_noise[rows.cpu(), steps.cpu()].to(x_next.device).float()
        old_mean = x_next.float() - std * eps
        return gaussian_mean_kl(step.mean.detach(), old_mean, std)

    def _idle_forward(self, traj: Trajectory, embeds, g: float) -> None:
        """FSDP padding: a zero-loss forward on this process's first sample at its first SDE step."""
        rows = torch.zeros(1, dtype=torch.long)
        step = int(torch.nonzero(traj.sde_mask).flatten()[0])
        emb = self.to_device(embeds.select(rows.to(embeds.cond[next(iter(embeds.cond))].device)))
        self.idle_forward(traj.latents[rows, step].to(self.device), traj.timesteps[step].to(self.device), emb, g,
                          reference=self.algo.beta > 0)


register_recipe("flow_grpo", FlowGRPOConfig, FlowGRPOTrainer)
