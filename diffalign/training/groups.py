"""Group planning: an iteration's prompts, SDE window and noise, drawn globally and sliced per process.

Shared by the group-rollout recipes (Flow-GRPO and its variants, Stepwise-Flow-GRPO, DRM
Step-GRPO). Every process draws the same global tensors from the trainer's shared generator and
keeps its own slice, so that N processes sample exactly what one process would. Recipes whose
sampler takes :func:`~diffalign.sampling.sample_linear`'s arguments roll a plan out in chunks
with :func:`sample_group_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from diffalign.algorithms.flow_grpo import gdpo_advantages, group_advantages
from diffalign.distributed import one_per_context_group
from diffalign.sampling import sample_linear, sde_window_mask


@dataclass
class GroupRollout:
    """What one iteration of group rollouts samples, drawn globally and sliced for this process."""

    prompts: list[str]  # this process's prompts (one per group)
    sample_prompts: list[str]  # one per sample: each prompt repeated group_size times
    n_local: int
    n_global: int
    first: int  # global id of this process's first sample
    group_ids: torch.Tensor  # (n_local,) global id of each sample's prompt group (what the reward is told)
    sde_mask: torch.Tensor  # (num_steps,) bool: which steps are SDE steps this iteration
    noise: torch.Tensor  # (n_local, *latent) initial noise
    step_noise: torch.Tensor | None  # (n_local, num_steps, *latent) per-step SDE noise (None: not drawn)
    embeds: object  # prompt embeddings, one row per sample (with the unconditional half under CFG)
    schedule: torch.Tensor


def plan_group_rollout(cfg, iteration: int, *, adapter, prompt_sampler, generator: torch.Generator, resolution: int,
                       world: int = 1, rank: int = 0, with_step_noise: bool = True) -> GroupRollout:
    """Draw an iteration's prompts (``prompt_sampler``), SDE window and all of its noise from the
    shared ``generator``: every one of the ``world`` processes draws the same global tensors and
    keeps the slice of its ``rank``, so that N processes sample exactly what one process would.
    ``cfg``: the run config (its ``rollout`` and ``sampling`` sections); ``adapter`` encodes the
    prompts and gives the latent shape and schedule at ``resolution``. A sampler that draws its
    step noise itself (DRM Step-GRPO's k candidates per step) passes ``with_step_noise=False``."""
    s = cfg.sampling
    per_proc, group = cfg.rollout.prompts_per_iteration, cfg.rollout.group_size
    all_prompts = prompt_sampler.next(per_proc * world)  # identical on every process
    prompts = all_prompts[rank * per_proc : (rank + 1) * per_proc]
    sample_prompts = [p for p in prompts for _ in range(group)]
    n_local, n_global = len(sample_prompts), len(all_prompts) * group
    local = slice(rank * n_local, (rank + 1) * n_local)
    sde_mask = sde_window_mask(s.num_steps, s.window_size, mode=s.window_mode, start=s.window_start, iteration=iteration,
                               slide_every=s.window_slide_every, stride=s.window_stride, generator=generator)
    latent = adapter.latent_shape(resolution, resolution)
    if cfg.rollout.shared_noise:  # one initial noise per group, repeated for its images
        noise = torch.randn((n_global // group, *latent), generator=generator).repeat_interleave(group, dim=0)[local]
    else:
        noise = torch.randn((n_global, *latent), generator=generator)[local]
    step_noise = torch.randn((n_global, s.num_steps, *latent), generator=generator)[local] if with_step_noise else None
    embeds = adapter.encode_prompts(prompts, with_uncond=s.guidance_scale > 1).repeat_interleave(group)
    schedule = adapter.make_schedule(s.num_steps, resolution, resolution)
    first = rank * n_local
    group_ids = torch.arange(first, first + n_local) // group
    return GroupRollout(prompts, sample_prompts, n_local, n_global, first, group_ids, sde_mask, noise, step_noise, embeds, schedule)


def sample_group_chunks(trainer, plan: GroupRollout, sampler: Callable = sample_linear, **options) -> Iterator[tuple[slice, object]]:
    """Roll out this process's samples of ``plan`` ``rollout.sample_batch_size`` at a time, with the
    denoiser in eval mode and under the trainer's autocast, using the plan's noise.

    ``sampler`` is :func:`~diffalign.sampling.sample_linear` or one with its arguments (such as
    :func:`~diffalign.sampling.sample_linear_dense`); ``options`` are its further keywords. Yields
    each chunk's local rows and trajectory as soon as it is sampled, so that the caller can submit
    the chunk's rewards to run while the next chunk samples."""
    trainer.adapter.denoiser.eval()
    s, bs = trainer.cfg.sampling, trainer.cfg.rollout.sample_batch_size
    for start in range(0, plan.n_local, bs):
        rows = slice(start, start + bs)
        with trainer.autocast():
            traj = sampler(trainer.adapter, trainer.kernel, plan.embeds.select(rows), plan.schedule, plan.sde_mask,
                           guidance_scale=s.guidance_scale, height=trainer.resolution, width=trainer.resolution,
                           noise=plan.noise[rows], step_noise=None if plan.step_noise is None else plan.step_noise[rows],
                           **options)
        yield rows, traj


def shuffled_share(perm: torch.Tensor, first: int, n_local: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's kept samples in the order of a global shuffle ``perm`` (n_global,), with
    ``first`` the global id of its first sample and ``keep`` (n_global,) bool: (global ids, local rows)."""
    mine = (perm >= first) & (perm < first + n_local) & keep[perm]
    order_global = perm[mine]
    return order_global, order_global - first


def sample_level_batches(n_rows: int, batch_size: int, levels: int) -> list[tuple[slice, int]]:
    """Micro-batches of an update that trains every sample at ``levels`` steps (or noise levels):
    ``(rows, j)`` for each slice of ``batch_size`` rows and each level j, batch-major."""
    batches = [slice(s, s + batch_size) for s in range(0, n_rows, batch_size)]
    return [(b, j) for b in batches for j in range(levels)]


def reward_summary(rewards: torch.Tensor) -> dict[str, float]:
    """``reward_mean`` / ``reward_std`` over the finite rewards (NaN / 0 when there are too few)."""
    finite = torch.isfinite(rewards)
    return {"reward_mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
            "reward_std": float(rewards[finite].std(unbiased=False)) if finite.sum() > 1 else 0.0}


def gathered_group_advantages(trainer, rewards: torch.Tensor, n_global: int, iteration: int, opts):
    """Check this process's rewards, gather every process's (sample order), and compute the group
    advantages of :func:`diffalign.algorithms.flow_grpo.group_advantages` (with
    ``trainer.reward_weights`` set, ``rewards`` are (n, K) components and the advantages GDPO's,
    :func:`~diffalign.algorithms.flow_grpo.gdpo_advantages`). ``opts``: the method's
    :class:`~diffalign.config.GroupAdvantageOptions` (``advantage_*``, ``filter_zero_std_groups``). Returns the advantages
    and the iteration's reward and advantage statistics."""
    std_mode, unbiased, eps, clip = opts.advantage_std, opts.advantage_unbiased_std, opts.advantage_eps, opts.advantage_clip
    filter_zero_std = opts.filter_zero_std_groups
    rewards = trainer.check_rewards(rewards, iteration)
    all_rewards = trainer.accelerator.gather(rewards.to(trainer.device)).cpu()
    all_rewards = one_per_context_group(all_rewards, trainer.layout)  # (n_global,) or (n_global, K) in sample order
    group_ids = torch.arange(n_global) // trainer.cfg.rollout.group_size
    if trainer.reward_weights is not None:  # GDPO: (n_global, K) component rewards, each normalised in its group
        adv = gdpo_advantages(all_rewards, trainer.reward_weights, group_ids, unbiased=unbiased, eps=eps, clip=clip,
                              filter_zero_std=filter_zero_std)
        all_rewards = all_rewards @ trainer.reward_weights  # the weighted reward, for the statistics
    else:
        adv = group_advantages(all_rewards, group_ids, std_mode=std_mode, unbiased=unbiased, eps=eps, clip=clip,
                               filter_zero_std=filter_zero_std)
    return adv, {**reward_summary(all_rewards), "advantage_abs_mean": float(adv.advantages.abs().mean()),
                 "zero_std_frac": adv.zero_std_fraction, "kept_frac": float(adv.keep.float().mean())}
