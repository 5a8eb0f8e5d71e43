"""Stepwise-Flow-GRPO recipe: dense rollouts -> per-step rewards -> gains -> per-step clipped updates.

Per prompt a group of G SDE rollouts (the CPS / "DDIM-inspired" kernel by default,
``sampling.kernel: cps``; its noise rule is ``sampling.std_schedule``: ``cps`` or ``stepwise``).
At every visited state the clean estimate (Tweedie, refined by ``algorithm.tweedie_substeps`` K
ODE substeps) is decoded; the final state uses the real sample. All ``T + 1`` images of a rollout
chunk go to the reward in **one** call (in a worker thread that overlaps the next chunk's
sampling when ``reward.async``), so an iteration makes one reward call per chunk of
``rollout.sample_batch_size`` samples. Gains ``g_t = r_{t+1} - r_t`` are z-scored jointly over a
group's gains (or per step) by :mod:`diffalign.algorithms.stepwise_flow_grpo`, and every trained step gets
its own advantage in Flow-GRPO's clipped loss (:class:`~diffalign.recipes._transitions.TransitionTrainer`).

Trained steps are the SDE steps with a non-zero transition std: CPS's last step (to sigma 0) and,
with ``std_schedule: stepwise``, the first step (from sigma 1) are deterministic and carry no
log-probability, so they are scored but not trained, and their gains enter no statistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from diffalign.algorithms.stepwise_flow_grpo import stepwise_advantages, stepwise_gains
from diffalign.config import AdvantageOptions, AlgorithmConfig, ClippedPolicyOptions, check
from diffalign.recipes import register_recipe
from diffalign.recipes._transitions import TransitionTrainer, Transitions
from diffalign.training.groups import sample_group_chunks
from diffalign.sampling import Kernel, sde_window_mask
from diffalign.sampling.dense import MAX_SUBSTEPS, DenseTrajectory, check_flow, decode_estimates, sample_linear_dense


@dataclass
class StepwiseFlowGRPOConfig(AdvantageOptions, ClippedPolicyOptions, AlgorithmConfig):
    """``algorithm.*`` of Stepwise-Flow-GRPO; advantages z-score the per-step gains of a group
    (``filter_zero_std_groups``: per_step drops group-steps whose gains are all equal); clipped-loss
    and guard_* keys from the shared mixins of :mod:`diffalign.config` (GRPO-Guard: docs/grpo_guard.md)."""

    name: str = "stepwise_flow_grpo"
    tweedie_substeps: int = 5  # K: ODE substeps refining each x0_hat (paper 5, robust 2..8); 0 = plain Tweedie (1 is the same)
    advantage_norm: Literal["joint", "per_step"] = "joint"  # z-score gains over all of a group's gains (paper) or per step

    def validate(self, prefix: str = "algorithm") -> None:
        check(0 <= self.tweedie_substeps <= MAX_SUBSTEPS, f"{prefix}.tweedie_substeps", f"must be in [0, {MAX_SUBSTEPS}]")
        super().validate(prefix)


def trainable_steps(kernel: Kernel, schedule: torch.Tensor, sde_mask: torch.Tensor) -> torch.Tensor:
    """(T,) bool: SDE steps whose transition std is > 0 (evaluated on a dummy 1-element state)."""
    x = torch.zeros(1, 1)
    out = torch.zeros(len(schedule) - 1, dtype=torch.bool)
    for i in range(len(out)):
        if sde_mask[i]:
            step = kernel.step(torch.zeros_like(x), x, schedule[i], schedule[i + 1], sde=True, noise=torch.zeros_like(x))
            out[i] = bool((step.std > 0).all())
    return out


class StepwiseFlowGRPOTrainer(TransitionTrainer):
    supports_fsdp = True  # the per-transition update keeps every process's forwards in lockstep
    algo: StepwiseFlowGRPOConfig

    def _setup_trainable(self) -> None:
        # Runs after the model is loaded and before the run directory is touched: bad input fails cleanly.
        check_flow(self.adapter, "stepwise_flow_grpo")
        super()._setup_trainable()

    def print_header(self) -> None:
        cfg, s = self.cfg, self.cfg.sampling
        schedule = self.adapter.make_schedule(s.num_steps, self.resolution, self.resolution)
        # window at its start position (a random window is not drawn here: that would use an RNG stream)
        mask = sde_window_mask(s.num_steps, s.window_size, mode="fixed", start=s.window_start)
        trained = int(trainable_steps(self.kernel, schedule, mask).sum())
        n = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size * self.accelerator.num_processes
        k = self.algo.tweedie_substeps
        self.log(f"diffalign: stepwise_flow_grpo on {cfg.model.id} ({self.adapter.family}, {self.resolution}px) -> {self.run_dir}")
        self.log(f"  images per iteration {n}, scored estimates per iteration {n * (s.num_steps + 1)}, trained steps per sample "
                 f"{trained} (of {s.num_steps}), refinement forwards per sample {max(k - 1, 0) * s.num_steps}, kernel {s.kernel}"
                 f"{'/' + s.std_schedule if s.kernel == 'cps' else ''}, advantages {self.algo.advantage_norm}, "
                 f"trainable params {sum(p.numel() for p in self.trainable):,}, processes {self.accelerator.num_processes}, device {self.device}")

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """Sample this process's share of the groups with dense estimates and score every state.

        Returns (trajectory, embeds, global id of the first local sample, n_global, rewards
        (n_local, T+1))."""
        s = self.cfg.sampling
        plan = self.plan_group_rollout(iteration)
        trajs, futures = [], []
        for idx, traj in sample_group_chunks(self, plan, sample_linear_dense, substeps=self.algo.tweedie_substeps):
            images = decode_estimates(self.adapter, traj.x0_estimates, self.cfg.rollout.sample_batch_size)  # (b (T+1), 3, H, W)
            traj.x0_estimates = traj.x0_estimates[:, :0]  # scored; free the memory
            repeated = [p for p in plan.sample_prompts[idx] for _ in range(s.num_steps + 1)]
            futures.append(self.score_async(images, repeated))  # one call for all T+1 estimates of the chunk
            finals = images.view(-1, s.num_steps + 1, *images.shape[1:])[:, -1]  # the real final sample of each rollout
            self.guard_finals(finals, plan.sample_prompts[idx], iteration)  # train.guard's verifier
            trajs.append(traj)
        rewards = torch.cat([r for r, _ in self.reward_results(futures)]).view(plan.n_local, s.num_steps + 1)
        return DenseTrajectory.cat(trajs), plan.embeds, plan.first, plan.n_global, rewards

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo, num_steps = self.algo, self.cfg.sampling.num_steps
        traj, embeds, first, n_global, rewards = self.rollout(iteration)
        rewards = self.check_rewards(rewards.flatten(), iteration).view(rewards.shape)
        all_rewards = self.accelerator.gather(rewards.to(self.device)).cpu()  # (n_global, T+1)
        gains = stepwise_gains(all_rewards)
        steps = traj.trainable_steps
        group_ids = torch.arange(n_global) // self.cfg.rollout.group_size
        adv = stepwise_advantages(gains, group_ids, normalize=algo.advantage_norm, step_mask=steps, eps=algo.advantage_eps,
                                  clip=algo.advantage_clip, filter_zero_std=algo.filter_zero_std_groups)
        final = all_rewards[:, -1]
        ok = torch.isfinite(final)
        finite_gains = gains[torch.isfinite(gains).all(1)][:, steps]
        record = {
            "reward_mean": float(final[ok].mean()) if ok.any() else float("nan"),
            "reward_std": float(final[ok].std(unbiased=False)) if ok.sum() > 1 else 0.0,
            "reward_first_estimate_mean": float(all_rewards[ok, 0].mean()) if ok.any() else float("nan"),
            "gain_abs_mean": float(finite_gains.abs().mean()) if finite_gains.numel() else float("nan"),
            "advantage_abs_mean": float(adv.advantages[adv.keep].abs().mean()) if adv.keep.any() else 0.0,
            "zero_std_frac": adv.zero_std_fraction,
            "kept_frac": float(adv.keep[:, steps].float().mean()) if steps.any() else 0.0,
            "trained_steps_per_sample": int(steps.sum()),
            "refinement_forwards": traj.extra_forwards,
        }
        record.update(self.update_transitions(self._transitions(traj, adv.advantages, adv.keep, first, n_global, num_steps), embeds))
        return record

    @staticmethod
    def _transitions(traj: DenseTrajectory, advantages: torch.Tensor, keep: torch.Tensor, first: int, n_global: int,
                     num_steps: int) -> Transitions:
        """One transition per kept (local sample, step); global id = sample id * T + step."""
        n_local = len(traj)
        mine = keep[first : first + n_local]  # (n_local, T)
        rows, steps = torch.nonzero(mine, as_tuple=True)  # row-major: global ids increase
        return Transitions(
            states=traj.latents[rows, steps],
            next_states=traj.latents[rows, steps + 1].unsqueeze(1),
            t=traj.timesteps[steps],
            t_next=traj.timesteps[steps + 1],
            embed_rows=rows,
            old_log_probs=traj.log_probs[rows, steps].unsqueeze(1),
            advantages=advantages[first + rows, steps].unsqueeze(1),
            keep=torch.ones(len(rows), 1, dtype=torch.bool),
            global_ids=(first + rows) * num_steps + steps,
            num_global=n_global * num_steps,
        )


register_recipe("stepwise_flow_grpo", StepwiseFlowGRPOConfig, StepwiseFlowGRPOTrainer)
