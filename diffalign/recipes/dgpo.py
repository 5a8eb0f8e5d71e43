"""DGPO recipe: seeded ODE rollouts -> rewards -> group advantages -> DGPO's group preference loss.

Paper: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization"
(ICLR 2026, arXiv:2510.08425); reference ``scripts/train_sd3_dgpo.py`` and ``config/dgpo.py`` of
github.com/Luo-Yihong/DGPO. The math lives in :mod:`diffalign.algorithms.dgpo`; this file
orchestrates:

1. rollout: G seeds per prompt, deterministic ODE with the current policy (DiffusionNFT's seeded
   rollout, :func:`~diffalign.recipes.diffusion_nft.seeded_group_rollout`): clean samples only, no
   SDE, no log-probabilities;
2. rewards -> per-prompt advantages (Flow-GRPO's estimator, or GDPO's for several rewards);
3. per epoch ``algorithm.train_timesteps`` noise levels drawn from the rollout schedule's indices
   ``0 .. trunc_steps`` (the high-noise end, ``t >= t_min``), shared by every sample (the reference's
   ``generate_shared_sampled_timesteps``), and noise shared within each prompt group
   (``use_shared_noise``); ``x_t = (1 - t) x0 + t eps``;
4. a no-gradient pass over the epoch's (sample, level) terms gives each group's logit
   ``s_g = beta / G sum A_i (l_theta - l_ref)`` (gathered over processes), then the gradient pass
   trains ``sigmoid(s_g) A_i l_theta(i)`` plus the optional KL to the reference.

The reference computes ``s_g`` inside each micro-batch, whose rows hold whole groups across its
GPUs, and steps the optimizer once per epoch; the pass of step 4 gives the same weights for any
micro-batch size. With ``train.optimizer_steps_per_iteration`` above 1 the weights of later
optimizer steps are those of the epoch's start (the reference's setting is 1). Multi-process runs
follow Flow-GRPO's scheme (global prompts, seeds and shuffles; global term counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from diffalign.algorithms.dgpo import dgpo_loss, group_weights, matching_loss, train_levels
from diffalign.config import AlgorithmConfig, GroupAdvantageOptions, check, check_ranges
from diffalign.errors import ConfigError
from diffalign.recipes import register_recipe
from diffalign.recipes.diffusion_nft import SeededSamples, seeded_group_rollout
from diffalign.sampling.seeded import SEED_HIGH, seed_noise
from diffalign.trainer import Trainer
from diffalign.training.groups import gathered_group_advantages, sample_level_batches, shuffled_share


@dataclass
class DGPOConfig(GroupAdvantageOptions, AlgorithmConfig):
    """``algorithm.*`` of DGPO; the advantage keys from the shared mixin of :mod:`diffalign.config`."""

    name: str = "dgpo"
    dpo_beta: float = 100.0  # beta of s_g = beta / G sum A (l_theta - l_ref) (reference train.beta_dpo: 100 GenEval / OCR, 10 PickScore)
    kl_beta: float = 0.02  # weight of mean((v_theta - v_ref)^2) (reference train.beta: 0.02 GenEval / OCR, 0.001 PickScore); 0 skips that forward
    train_timesteps: int = 4  # noise levels trained per epoch, shared by all samples (reference num_train_timesteps)
    trunc_steps: int = 6  # levels drawn from schedule indices 0 .. trunc_steps: t >= t_min (reference 6; 4 for GenEval)
    shared_noise: bool = True  # one noise per (prompt group, level): the group's losses differ by their samples only (reference use_shared_noise)
    train_guidance_scale: float = 1.0  # CFG in the policy's training forwards; 1 = conditional only (reference: rollout with CFG, train without)
    reference_guidance_scale: float = 1.0  # CFG of the reference's forwards, in s_g and the KL (reference kl_cfg: 1; 4.5 in its CFG-free mode)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.train_timesteps >= 1, f"{prefix}.train_timesteps", "must be >= 1")
        check(self.trunc_steps + 1 >= self.train_timesteps, f"{prefix}.trunc_steps",
              f"must be >= train_timesteps - 1 ({self.train_timesteps - 1}): the levels are distinct indices 0 .. trunc_steps")
        check_ranges(self, prefix, positive=("dpo_beta",), nonnegative=("kl_beta", "train_guidance_scale", "reference_guidance_scale"))
        super().validate(prefix)

    def check_sampling(self, sampling, prefix: str = "algorithm") -> None:
        check(self.trunc_steps < sampling.num_steps, f"{prefix}.trunc_steps",
              f"must be < sampling.num_steps ({sampling.num_steps}): it indexes the rollout schedule's noise levels")
        super().check_sampling(sampling, prefix)

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        return self.train_timesteps

    def rewards_in_groups(self) -> bool:
        return True


class DGPOTrainer(Trainer):
    needs_reference = True  # l_ref of the group preference: the adapter disabled (LoRA) or a frozen copy

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: DGPOConfig = cfg.algorithm

    def _setup_trainable(self) -> None:
        if self.adapter.prediction_type != "flow":
            raise ConfigError(f"config key 'model.id': DGPO needs a flow-matching model (x_t = (1 - t) x0 + t eps); "
                              f"{self.adapter.family} predicts {self.adapter.prediction_type}")
        super()._setup_trainable()

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo = self.algo
        samples = seeded_group_rollout(self, iteration)  # the current policy's ODE samples
        t_update = time.perf_counter()
        adv, record = gathered_group_advantages(self, samples.rewards, samples.n_global, iteration, algo)
        record.update(samples.info)
        record.update(self.update(samples, adv.advantages, adv.keep))
        record["time/update"] = time.perf_counter() - t_update
        return record

    # ---- policy update ----------------------------------------------------------------------
    def velocities(self, x_t: torch.Tensor, t: torch.Tensor, emb, *, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(v_theta, v_ref) at ``x_t``: the policy with or without gradient, the reference (no
        gradient) when the loss or the weights need it (``grad``: only with a KL term)."""
        a = self.algo
        with torch.set_grad_enabled(grad), self.autocast():
            v_theta = self.adapter.predict(x_t, t, emb, a.train_guidance_scale)
        v_ref = None
        if not grad or a.kl_beta > 0:
            with torch.no_grad(), self.reference_model(), self.autocast():
                v_ref = self.adapter.predict(x_t, t, emb, a.reference_guidance_scale)
        return v_theta, v_ref

    def update(self, samples: SeededSamples, advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        """DGPO updates on this process's samples; ``advantages`` / ``keep`` are global (n_global,)."""
        cfg, algo, dev = self.cfg, self.algo, self.device
        group = cfg.rollout.group_size
        schedule = self.adapter.make_schedule(cfg.sampling.num_steps, self.resolution, self.resolution)
        latent = tuple(samples.x0.shape[1:])
        n_global, first_local, n_local = samples.n_global, int(samples.sample_ids[0]), len(samples.sample_ids)
        n_groups = n_global // group
        group_ids = torch.arange(n_global) // group
        keys = ("loss", "policy_loss", "matching_loss", "group_weight", "kl")
        stats: dict[str, list] = {k: [] for k in keys + ("grad_norm",)}
        steps_applied = 0
        emb_device = samples.embeds.cond[next(iter(samples.embeds.cond))].device
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            # Global shuffle, levels and noise seeds (same RNG use on every process), then our share.
            perm = torch.randperm(n_global, generator=self.generator)
            levels = train_levels(algo.trunc_steps, algo.train_timesteps, generator=self.generator)  # (K,)
            noise_seeds = torch.randint(0, SEED_HIGH, (n_groups if algo.shared_noise else n_global, len(levels)),
                                        generator=self.generator)
            order_global, order = shuffled_share(perm, first_local, n_local, keep)
            micro = sample_level_batches(len(order), cfg.train.batch_size, len(levels))

            def term(m: int):
                """Micro-batch m: (global ids, x0, eps, t, x_t, embeds, level index)."""
                b, j = micro[m]
                rows, grows = order[b], order_global[b]
                x0 = samples.x0[rows].to(dev).float()
                eps, _ = seed_noise(noise_seeds[grows // group if algo.shared_noise else grows, j], latent)
                eps = eps.to(dev)
                t = schedule[levels[j]].to(dev).expand(len(rows))
                tb = t.reshape(-1, *([1] * len(latent)))
                x_t = (1 - tb) * x0 + tb * eps  # fresh noise on the forward process
                return grows, x0, eps, t, x_t, samples.embeds.select(rows.to(emb_device)), j

            # 1. s_g of every (group, level) from l_theta - l_ref of the epoch's start, over all processes
            delta = torch.zeros(n_local, len(levels))  # this process's rows
            for m in range(len(micro)):
                grows, x0, eps, t, x_t, emb, j = term(m)
                v_theta, v_ref = self.velocities(x_t, t, emb, grad=False)
                delta[grows - first_local, j] = (matching_loss(v_theta, x0, eps) - matching_loss(v_ref, x0, eps)).cpu()
            delta = self.accelerator.gather(delta.to(dev)).cpu()  # (n_global, K) in sample order
            weights = torch.stack([group_weights(delta[:, j], advantages, group_ids, n_groups, beta=algo.dpo_beta,
                                                 group_size=group) for j in range(len(levels))], dim=1)
            # 2. the surrogate sigmoid(s_g) A l_theta (+ KL), gradients summed between optimizer steps
            for step in self.plan_optimizer_steps([len(order[b]) for b, _ in micro]):
                bad = False
                for m in step.micro:
                    grows, x0, eps, t, x_t, emb, j = term(m)
                    v_theta, v_ref = self.velocities(x_t, t, emb, grad=True)
                    res = dgpo_loss(v_theta, x0, eps, advantages[grows].to(dev), weights[grows, j].to(dev), v_ref=v_ref,
                                    kl_beta=algo.kl_beta)
                    if not self.accumulate(res.per_sample.sum() / step.global_terms):
                        bad = True
                        continue
                    for key in keys:
                        stats[key].append(float(getattr(res, key).detach()))
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        return out

    def print_header(self) -> None:
        super().print_header()
        a = self.algo
        self.log(f"  DGPO: ODE rollouts ({self.cfg.sampling.num_steps} steps), {a.train_timesteps} noise levels per epoch from "
                 f"schedule indices 0..{a.trunc_steps}, beta {a.dpo_beta}, KL {a.kl_beta}, "
                 f"{'shared' if a.shared_noise else 'per-sample'} noise per group")


register_recipe("dgpo", DGPOConfig, DGPOTrainer)

__all__ = ["DGPOConfig", "DGPOTrainer"]
