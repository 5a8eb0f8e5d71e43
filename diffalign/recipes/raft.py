"""RAFT recipe: group rollouts -> rewards -> keep the best images -> the pretraining loss on them.

Paper: Dong et al. 2023 (arXiv:2304.06767). The math lives in :mod:`diffalign.algorithms.raft`;
the noising in :mod:`diffalign.forward_process`; this file orchestrates:

1. rollout: ``rollout.prompts_per_iteration`` prompts x ``rollout.group_size`` images with the
   ordinary linear sampler and the ``sampling`` section's kernel (``sampling.noise_level: 0`` is
   the deterministic ODE / DDIM, natural here: nothing needs a log-probability), keeping only the
   final clean latents;
2. rewards -> :func:`~diffalign.algorithms.raft.select_kept` (the best ``keep_top`` or
   ``keep_fraction`` of each prompt group, optionally only above ``min_reward``; non-finite
   rewards never kept);
3. per kept image ``algorithm.noise_draws`` fresh (t, eps) pairs, ``x_t`` on the model's forward
   process, and the squared error of the model's prediction against its own target
   (:func:`~diffalign.algorithms.raft.raft_loss`): ``train.optimizer_steps_per_iteration``
   optimizer steps per epoch over the kept images.

CFG: the kept images are trained **conditioned on their prompt only** (one forward of the
conditional branch, guidance 1): that is the pretraining loss of a text-conditional model, and
RAFT is exactly supervised fine-tuning on the kept images. No loss term asks anything of the
unconditional branch (the empty prompt): it is not fitted to the kept images, which would pull
``v_uncond`` toward them too and shrink the guidance direction ``v_cond - v_uncond`` that moves
samples toward the prompt. It shares the weights, so it changes with them, but not by design.
Rollouts use ``sampling.guidance_scale`` as every recipe does.

Multi-process runs follow Flow-GRPO's scheme: every process draws the same global prompts,
noise, shuffle, noise levels and noise seeds, gathers the rewards and selects on all of them,
then trains its own kept images with losses divided by the global number of terms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from diffalign.adapters.base import PromptEmbeds
from diffalign.algorithms.raft import RaftSelection, keep_count, raft_loss, sample_noise_levels, select_kept
from diffalign.config import AlgorithmConfig, check, check_ranges
from diffalign.errors import ConfigError
from diffalign.forward_process import add_noise, denoising_target, model_time, pretraining_loss_weight, scheduler_shift
from diffalign.recipes import register_recipe
from diffalign.sampling.seeded import SEED_HIGH, seed_noise
from diffalign.trainer import Trainer
from diffalign.training.groups import reward_summary, sample_group_chunks, sample_level_batches, shuffled_share
from diffalign.training.rewards import reward_info

SUPPORTED_PREDICTIONS = ("flow", "epsilon")  # what diffalign.forward_process noises and targets


@dataclass
class RaftConfig(AlgorithmConfig):
    """``algorithm.*`` of RAFT (docs/raft.md)."""

    name: str = "raft"
    keep_top: int = 1  # k: images kept per prompt group (the paper: the best 1 of K); rollout.group_size keeps all
    keep_fraction: float = 0.0  # > 0: keep ceil(fraction x group size) per group instead of keep_top (0.25 of 8 -> 2)
    ranking: Literal["group", "batch"] = "group"  # rank within each prompt's group (best-of-K), or all images together (same count)
    min_reward: Optional[float] = None  # also require reward >= this to keep an image; None = no threshold
    noise_draws: int = 1  # fresh (t, eps) pairs per kept image and epoch: each a term of the loss
    # noise levels of the training draws: "uniform" / "logit_normal" (SD3's pretraining density) in
    # [0, 1] then shifted, or "schedule": uniformly among the rollout schedule's noisy states (as DiffusionNFT)
    timestep_distribution: Literal["uniform", "logit_normal", "schedule"] = "uniform"
    # t -> s t / (1 + (s - 1) t) after drawing; None = the model's scheduler shift (shapes 2.0, its
    # pretraining draw; SD3 3.0; 1.0 for epsilon models and dynamic shifting); 1.0 = none
    timestep_shift: Optional[float] = None
    logit_mean: float = 0.0  # logit_normal: mean of the logit (SD3: 0)
    logit_std: float = 1.0  # logit_normal: std of the logit (SD3: 1)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.keep_top >= 1, f"{prefix}.keep_top", "must be >= 1")
        check(0 <= self.keep_fraction <= 1, f"{prefix}.keep_fraction", "must be in [0, 1] (0 = use keep_top)")
        check(self.noise_draws >= 1, f"{prefix}.noise_draws", "must be >= 1")
        check(self.timestep_shift is None or self.timestep_shift > 0, f"{prefix}.timestep_shift", "must be > 0 (or null)")
        check(self.timestep_shift is None or self.timestep_distribution != "schedule", f"{prefix}.timestep_shift",
              "does not apply to timestep_distribution=schedule (the schedule is already shifted); set it to null")
        check_ranges(self, prefix, positive=("logit_std",))
        super().validate(prefix)

    def trained_steps_per_sample(self, sde_steps: int) -> int:  # terms per kept image
        return self.noise_draws

    def trained_images_per_iteration(self, images: int, group_size: int) -> int:  # at most: min_reward may keep fewer
        count = keep_count(group_size, keep_top=self.keep_top, keep_fraction=self.keep_fraction)
        return images // group_size * count

    def rewards_in_groups(self) -> bool:
        return True


@dataclass
class RaftRollout:
    """This process's share of an iteration's images; n = n_local.

    ``x0``: (n, *latent) fp32 final (clean) latents. ``embeds``: prompt embeddings, n rows (with the
    unconditional half under CFG). ``first``: global index of this process's first image (all
    processes together hold ``n_global``). ``rewards``: (n,). ``info``: reward info, rollout seconds.
    """

    x0: torch.Tensor
    embeds: PromptEmbeds
    first: int
    n_global: int
    rewards: torch.Tensor
    info: dict


class RaftTrainer(Trainer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: RaftConfig = cfg.algorithm
        group = cfg.rollout.group_size
        check(self.algo.keep_top <= group, "algorithm.keep_top", f"must be <= rollout.group_size ({group})")

    def _setup_trainable(self) -> None:
        if self.adapter.prediction_type not in SUPPORTED_PREDICTIONS:
            raise ConfigError(f"config key 'model.id': RAFT trains the denoising loss of flow or epsilon models; "
                              f"{self.adapter.family} predicts {self.adapter.prediction_type}")
        super()._setup_trainable()
        a = self.algo
        self.timestep_shift = a.timestep_shift if a.timestep_shift is not None else scheduler_shift(self.adapter)

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int) -> RaftRollout:
        """Sample this process's share of the iteration's groups, keep the final latents, score them."""
        t0 = time.perf_counter()
        stochastic = self.kernel.noise_level > 0  # the ODE / DDIM eta 0 kernel uses no step noise
        plan = self.plan_group_rollout(iteration, with_step_noise=stochastic)
        x0, futures = [], []
        for rows, traj in sample_group_chunks(self, plan, keep_latents=False):
            x0.append(traj.latents[:, -1])
            futures.append(self.score_async(traj.images, plan.sample_prompts[rows], plan.group_ids[rows]))  # overlaps the next chunk
            self.guard_finals(traj.images, plan.sample_prompts[rows], iteration)  # train.guard's verifier
        results = [f.result() for f in futures]
        rewards = torch.cat([r for r, _ in results])
        info = self.gather_info(reward_info(results))
        info["time/rollout"] = time.perf_counter() - t0
        return RaftRollout(torch.cat(x0), plan.embeds, plan.first, plan.n_global, rewards, info)

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo = self.algo
        ro = self.rollout(iteration)
        rewards = self.check_rewards(ro.rewards, iteration)
        all_rewards = self.accelerator.gather(rewards.to(self.device)).cpu()  # (n_global,) in sample order
        sel = select_kept(all_rewards, self.cfg.rollout.group_size, keep_top=algo.keep_top, keep_fraction=algo.keep_fraction,
                          min_reward=algo.min_reward, ranking=algo.ranking)
        record = {**reward_summary(all_rewards), **selection_metrics(all_rewards, sel), **ro.info}
        t0 = time.perf_counter()
        record.update(self.update(ro, sel.keep))
        record["time/update"] = time.perf_counter() - t0
        return record

    # ---- policy update ----------------------------------------------------------------------
    def noise_levels(self, n: int) -> torch.Tensor:
        """(n,) model times of training draws (sigma for flow models, the DDPM index for epsilon ones)."""
        a, s = self.algo, self.cfg.sampling
        if a.timestep_distribution == "schedule":
            schedule = self.adapter.make_schedule(s.num_steps, self.resolution, self.resolution)
            return schedule[torch.randint(0, s.num_steps, (n,), generator=self.generator)].float()  # the clean end excluded
        tau = sample_noise_levels(n, distribution=a.timestep_distribution, shift=self.timestep_shift, logit_mean=a.logit_mean,
                                  logit_std=a.logit_std, generator=self.generator)
        return model_time(self.adapter, tau)

    def update(self, ro: RaftRollout, keep: torch.Tensor) -> dict:
        """The denoising loss on this process's kept images; ``keep`` is global (n_global,).

        Per epoch a global shuffle, the noise levels and one noise seed per (image, draw), drawn the
        same on every process (for every image, kept or not: the draws do not depend on the
        selection's size); micro-batches of (kept images, draw j)."""
        cfg, dev, draws = self.cfg, self.device, self.algo.noise_draws
        latent = tuple(ro.x0.shape[1:])
        n_local = ro.x0.shape[0]
        embeds_device = next(iter(ro.embeds.cond.values())).device
        stats: dict[str, list] = {"loss": [], "mse": [], "grad_norm": []}
        steps_applied = 0
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            perm = torch.randperm(ro.n_global, generator=self.generator)
            levels = self.noise_levels(ro.n_global * draws).reshape(ro.n_global, draws)
            noise_seeds = torch.randint(0, SEED_HIGH, (ro.n_global, draws), generator=self.generator)
            order_global, order = shuffled_share(perm, ro.first, n_local, keep)
            micro = sample_level_batches(len(order), cfg.train.batch_size, draws)
            for group in self.plan_optimizer_steps([len(order[b]) for b, _ in micro]):
                bad = False
                for m in group.micro:
                    b, j = micro[m]
                    rows, grows = order[b], order_global[b]
                    x0 = ro.x0[rows].to(dev).float()
                    t = levels[grows, j].to(dev)
                    eps = seed_noise(noise_seeds[grows, j], latent)[0].to(dev)
                    x_t = add_noise(self.adapter, x0, eps, t)  # fresh noise on the model's forward process
                    emb = ro.embeds.select(rows.to(embeds_device))
                    with self.autocast():
                        prediction = self.adapter.predict(x_t, t, emb, 1.0)  # the conditional branch (module docstring)
                    res = raft_loss(prediction, denoising_target(self.adapter, x0, eps), pretraining_loss_weight(self.adapter, t))
                    if not self.accumulate(res.per_sample.sum() / group.global_terms):
                        bad = True
                        continue
                    stats["loss"].append(float(res.loss.detach()))
                    stats["mse"].append(float(res.mse))
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        return out

    def print_header(self) -> None:
        super().print_header()
        a, g = self.algo, self.cfg.rollout.group_size
        kept = f"the best {keep_count(g, keep_top=a.keep_top, keep_fraction=a.keep_fraction)} of {g}"
        kept += " per prompt group" if a.ranking == "group" else " images per group, ranked over the whole batch"
        if a.min_reward is not None:
            kept += f" with reward >= {a.min_reward:g}"
        dist = "the rollout schedule's sigmas" if a.timestep_distribution == "schedule" else (
            f"{a.timestep_distribution} shifted by {self.timestep_shift:g}")
        sampler = "ODE" if self.kernel.noise_level == 0 else f"{self.kernel.name} SDE (noise level {self.kernel.noise_level:g})"
        self.log(f"  RAFT: rollouts {sampler}, {self.cfg.sampling.num_steps} steps; keeping {kept}; {a.noise_draws} noise "
                 f"draw(s) per kept image, t ~ {dist}; conditional denoising loss")


def selection_metrics(rewards: torch.Tensor, sel: RaftSelection) -> dict[str, float]:
    """What the selection kept: ``kept_frac`` of all images, ``reward_kept_mean`` (NaN when none
    was kept) against ``reward_mean``, and the images dropped for a non-finite reward or the threshold."""
    kept = rewards[sel.keep]
    return {"kept_frac": sel.kept / max(len(rewards), 1), "kept_images": sel.kept,
            "reward_kept_mean": float(kept.mean()) if len(kept) else float("nan"),
            "nonfinite_dropped": sel.nonfinite, "below_min_reward": sel.below_threshold, "empty_groups": sel.empty_groups}


register_recipe("raft", RaftConfig, RaftTrainer)

__all__ = ["RaftConfig", "RaftRollout", "RaftTrainer", "selection_metrics"]
