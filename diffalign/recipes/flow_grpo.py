"""Flow-GRPO recipe: SDE group rollouts -> rewards -> group advantages -> clipped PPO updates.

Also covers DDPO-style GRPO on epsilon models (``sampling.kernel: ddim``), Flow-GRPO-Fast
(``sampling.window_mode: random``) and MixGRPO's sliding SDE window (``window_mode: sliding``).
The math lives in :mod:`diffalign.algorithms.flow_grpo`; this file only orchestrates.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from diffalign.algorithms.flow_grpo import gaussian_mean_kl, group_advantages, ppo_clip_loss
from diffalign.config import FlowGRPOConfig
from diffalign.sampling import Trajectory, sample_linear, sde_window_mask
from diffalign.trainer import SelfCheckError, Trainer


class FlowGRPOTrainer(Trainer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: FlowGRPOConfig = cfg.algorithm
        self.needs_reference = self.algo.beta > 0
        self._checked = False  # on-policy self-check done

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int):
        cfg = self.cfg
        prompts = self.prompt_sampler.next(cfg.rollout.prompts_per_iteration)
        group = cfg.rollout.group_size
        sample_prompts = [p for p in prompts for _ in range(group)]
        group_ids = torch.arange(len(prompts)).repeat_interleave(group)
        use_cfg = cfg.sampling.guidance_scale > 1
        embeds = self.adapter.encode_prompts(prompts, with_uncond=use_cfg).repeat_interleave(group)
        s = cfg.sampling
        schedule = self.adapter.make_schedule(s.num_steps, self.resolution, self.resolution)
        sde_mask = sde_window_mask(s.num_steps, s.window_size, mode=s.window_mode, start=s.window_start, iteration=iteration,
                                   slide_every=s.window_slide_every, stride=s.window_stride, generator=self.generator)
        self.adapter.denoiser.eval()
        trajs, futures = [], []
        bs = cfg.rollout.sample_batch_size
        for start in range(0, len(sample_prompts), bs):
            idx = slice(start, start + bs)
            with self.autocast():
                traj = sample_linear(self.adapter, self.kernel, embeds.select(idx), schedule, sde_mask,
                                     guidance_scale=s.guidance_scale, height=self.resolution, width=self.resolution,
                                     generator=self.generator)
            trajs.append(traj)
            futures.append(self.score_async(traj.images, sample_prompts[idx]))  # overlaps the next chunk
        results = [f.result() for f in futures]
        rewards = torch.cat([r for r, _ in results])
        info: dict = {}
        for _, i in results:  # average per-batch reward info (e.g. per-family accuracy)
            for k, v in i.items():
                info.setdefault(k, []).append(v)
        info = {f"reward/{k}" if not k.startswith("reward/") else k: float(np.mean(v)) for k, v in info.items()}
        return Trajectory.cat(trajs), embeds, sample_prompts, group_ids, rewards, info

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        cfg, algo = self.cfg, self.algo
        traj, embeds, prompts, group_ids, rewards, info = self.rollout(iteration)
        rewards = self.check_rewards(rewards, iteration)
        # Advantages over the whole batch of all processes (global std), then our own slice.
        all_rewards = self.accelerator.gather(rewards.to(self.device)).cpu()
        all_groups = self.accelerator.gather((group_ids + self.accelerator.process_index * len(group_ids)).to(self.device)).cpu()
        adv = group_advantages(all_rewards, all_groups, std_mode=algo.advantage_std, eps=algo.advantage_eps,
                               clip=algo.advantage_clip, filter_zero_std=algo.filter_zero_std_groups)
        n = len(rewards)
        lo = self.accelerator.process_index * n
        advantages, keep = adv.advantages[lo : lo + n], adv.keep[lo : lo + n]
        finite = torch.isfinite(all_rewards)
        record = {
            "reward_mean": float(all_rewards[finite].mean()) if finite.any() else float("nan"),
            "reward_std": float(all_rewards[finite].std(unbiased=False)) if finite.sum() > 1 else 0.0,
            "zero_std_frac": adv.zero_std_fraction,
            "kept_frac": float(keep.float().mean()),
            **info,
        }
        record.update(self.update(traj, embeds, advantages.to(self.device), keep))
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

    def update(self, traj: Trajectory, embeds, advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        cfg, algo = self.cfg, self.algo
        kept = torch.nonzero(keep).flatten()
        stats = {"loss": [], "policy_loss": [], "kl": [], "clip_frac": [], "approx_kl": [], "ratio_mean": [], "grad_norm": []}
        if len(kept) == 0:  # every group had equal rewards: nothing to learn from this batch
            return {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "optimizer_steps": 0}
        self.adapter.denoiser.train()
        steps_applied = 0
        g = cfg.sampling.guidance_scale
        dev = self.device
        for _epoch in range(cfg.train.inner_epochs):
            order = kept[torch.randperm(len(kept), generator=self.generator)]
            step_idx = self.trained_steps(traj.sde_mask, len(order))  # (n, K), aligned with `order`
            batches = [slice(s, s + cfg.train.batch_size) for s in range(0, len(order), cfg.train.batch_size)]
            micro = [(b, j) for b in batches for j in range(step_idx.shape[1])]
            groups = np.array_split(np.arange(len(micro)), cfg.train.optimizer_steps_per_iteration)
            for group in groups:
                bad = False
                for m in group:
                    b, j = micro[m]
                    rows = order[b]
                    steps = step_idx[b, j]
                    x = traj.latents[rows, steps].to(dev)
                    x_next = traj.latents[rows, steps + 1].to(dev)
                    t = traj.timesteps[steps].to(dev)
                    t_next = traj.timesteps[steps + 1].to(dev)
                    emb = embeds.select(rows.to(embeds.cond[next(iter(embeds.cond))].device))
                    with self.autocast():
                        out = self.adapter.predict(x, t, emb, g)
                    step = self.kernel.step(out, x, t, t_next, sde=True, prev_sample=x_next)
                    old_logp = traj.log_probs[rows, steps].to(dev)
                    if not self._checked:
                        self._self_check(step.log_prob.detach(), old_logp, steps)
                    kl = None
                    if algo.beta > 0:
                        with torch.no_grad(), self.reference_model(), self.autocast():
                            ref_out = self.adapter.predict(x, t, emb, g)
                        ref = self.kernel.step(ref_out, x, t, t_next, sde=True, prev_sample=x_next)
                        kl = gaussian_mean_kl(step.mean, ref.mean, step.std)
                    res = ppo_clip_loss(step.log_prob, old_logp, advantages[rows], clip_range=algo.clip_range, kl=kl, beta=algo.beta)
                    if not torch.isfinite(res.loss):
                        self.stats["nonfinite_losses"] += 1
                        bad = True
                        continue
                    self.accelerator.backward(res.loss / len(group))
                    for key in ("loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean"):
                        stats[key].append(float(getattr(res, key).detach()))
                if bad:  # a non-finite loss poisons the accumulated step: drop it, count it
                    self.optimizer.zero_grad(set_to_none=True)
                    self.stats["skipped_steps"] += 1
                    self._consecutive_bad_steps += 1
                    if self._consecutive_bad_steps > cfg.train.max_nonfinite_losses:
                        from diffalign.errors import NonFiniteError

                        raise NonFiniteError(f"{self._consecutive_bad_steps} consecutive optimizer steps had non-finite losses; stopping")
                    continue
                norm, applied = self.optimizer_step()
                stats["grad_norm"].append(norm)
                steps_applied += int(applied)
                self._checked = True  # the policy has moved: later ratios need not be 1
        out = {k: float(np.mean(v)) if v else float("nan") for k, v in stats.items()}
        out["optimizer_steps"] = steps_applied
        return out

    def _self_check(self, new_logp: torch.Tensor, old_logp: torch.Tensor, steps: torch.Tensor) -> None:
        """Before the first update the policy *is* the sampling policy: the ratio must be 1."""
        if not self.cfg.train.self_check:
            return
        diff = (new_logp.float() - old_logp.float()).abs()
        worst = float(diff.max())
        if not math.isfinite(worst) or worst > self.cfg.train.self_check_tolerance:
            raise SelfCheckError(
                f"on-policy self-check failed: |log ratio| = {worst:.3g} before any update (tolerance "
                f"{self.cfg.train.self_check_tolerance:g}) at steps {sorted(set(steps.tolist()))}; the training forward does not "
                "reproduce the sampler (check the adapter's predict, CFG batching and dtype), or raise train.self_check_tolerance"
            )
