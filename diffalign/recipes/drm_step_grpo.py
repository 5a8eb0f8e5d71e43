"""DRM Step-GRPO recipe: at each reverse step, k candidates scored on their noisy state by a DRM.

Per prompt, G chains (``rollout.group_size``) start from their own noise. At every SDE step
(``sampling.window_*`` as in Flow-GRPO; the Flow-GRPO SDE kernel by default) each chain's state
``x_t`` is branched into ``algorithm.num_candidates`` k candidates ``x_{t'}^j`` with one denoiser
forward; the reward — a DRM (``reward.name: drm``), which scores **noisy** latents through its
``score_latents`` — scores each candidate at ``t'`` without decoding; the k scores are z-scored
(:func:`diffalign.algorithms.drm_step_grpo.candidate_advantages`), and every candidate transition is
trained with Flow-GRPO's clipped loss (:class:`~diffalign.recipes._transitions.TransitionTrainer`;
one forward re-scores all k candidates of a state). The chain continues from a uniformly random
candidate (``continuation: random``, as SPO) or the best one (``best``); the paper does not say
which *(unverified)*.

The DRM is the training signal; ``algorithm.monitor_reward`` (e.g. ``shapes_eval``) scores the
final samples of the rollouts and the evaluation images, so that runs report the task metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import reward_models
from diffalign.algorithms.continuation import CONTINUATIONS, choose_continuation
from diffalign.algorithms.drm_step_grpo import candidate_advantages
from diffalign.config import AdvantageOptions, AlgorithmConfig, ClippedPolicyOptions, check
from diffalign.drm.model import check_compatible
from diffalign.drm.sampling import MAX_BRANCHES, branch_candidates
from diffalign.errors import ConfigError
from diffalign.recipes import register_recipe
from diffalign.recipes._transitions import TransitionTrainer, Transitions


@dataclass
class DRMStepGRPOConfig(AdvantageOptions, ClippedPolicyOptions, AlgorithmConfig):
    """``algorithm.*`` of DRM Step-GRPO; advantages z-score the k candidates of a state (a group is
    a state: ``filter_zero_std_groups`` drops states whose k scores are all equal); clipped-loss and
    guard_* keys from the shared mixins of :mod:`diffalign.config` (GRPO-Guard: docs/grpo_guard.md)."""

    name: str = "drm_step_grpo"
    num_candidates: int = 6  # k: SDE candidates branched from each state (paper: 6)
    continuation: Literal["random", "best"] = "random"  # which candidate a chain continues from (unverified in the paper)
    monitor_reward: str = ""  # reward of rollout finals and evaluation (e.g. shapes_eval); "" = the DRM on clean images
    monitor_reward_kwargs: dict = field(default_factory=dict)
    # The DRM's training recipe for `diffalign train-reward THIS_CONFIG` (keys of diffalign.drm.train.DRMRunConfig;
    # output_dir defaults to reward.kwargs.path, drm.base to model.id, prompts to this run's); unused by `train`.
    drm_train: dict = field(default_factory=dict)

    renamed_keys = {"filter_zero_std": "filter_zero_std_groups"}

    def validate(self, prefix: str = "algorithm") -> None:
        check(2 <= self.num_candidates <= MAX_BRANCHES, f"{prefix}.num_candidates", f"must be in [2, {MAX_BRANCHES}] (z-scores need 2)")
        check(self.continuation in CONTINUATIONS, f"{prefix}.continuation", f"must be one of {', '.join(CONTINUATIONS)}")
        super().validate(prefix)

    def untrained_judge(self, cfg, config_path: str) -> str | None:
        path = str((cfg.reward.kwargs or {}).get("path", "")) if cfg.reward.name == "drm" else ""
        if path and self.drm_train and not Path(path).exists():
            return (f"the diffusion reward model {path!r} (reward.kwargs.path) is not trained yet; "
                    f"train it first with: diffalign train-reward {config_path}")
        return None


class DRMStepGRPOTrainer(TransitionTrainer):
    algo: DRMStepGRPOConfig
    learned_reward_key = "drm_score_mean"  # the DRM's scores of the candidates train the policy

    def _setup_trainable(self) -> None:
        # Runs after the reward and the model are built and before the run directory is touched.
        name = self.cfg.reward.name
        if not callable(getattr(self.reward_fn, "score_latents", None)):
            raise ConfigError(f"config key 'reward.name': reward {name!r} cannot score noisy states (no score_latents); "
                              "drm_step_grpo needs a DRM: reward.name=drm reward.kwargs.path=DIR (diffalign train-reward)")
        check_compatible(self.reward_fn, self.adapter)
        self.monitor_fn = None
        if self.algo.monitor_reward:
            self.monitor_fn = reward_models.build(self.algo.monitor_reward, device=str(self.device), **self.algo.monitor_reward_kwargs)
        super()._setup_trainable()

    def score(self, images, prompts, metadata=None):
        """Rewards of clean images (rollout finals, evaluation): the monitor reward when set."""
        if self.monitor_fn is None:
            return super().score(images, prompts, metadata)
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        value = self.monitor_fn(images, prompts, metadata)
        rewards = reward_models.check_reward_output(self.algo.monitor_reward, value, len(prompts))
        return rewards, dict(getattr(self.monitor_fn, "last_info", None) or {})

    def print_header(self) -> None:
        cfg, s, k = self.cfg, self.cfg.sampling, self.algo.num_candidates
        chains = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size * self.accelerator.num_processes
        branched = s.window_size or s.num_steps
        self.log(f"diffalign: drm_step_grpo on {cfg.model.id} ({self.adapter.family}, {self.resolution}px) -> {self.run_dir}")
        self.log(f"  chains per iteration {chains}, candidates k {k}, branched steps {branched} of {s.num_steps}, DRM forwards per "
                 f"iteration {chains * branched * k}, trained transitions per iteration {chains * branched * k}, continuation "
                 f"{self.algo.continuation}, trainable params {sum(p.numel() for p in self.trainable):,}, device {self.device}")

    # ---- rollout ----------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, iteration: int) -> dict:
        cfg, s, algo = self.cfg, self.cfg.sampling, self.algo
        k = algo.num_candidates
        plan = self.plan_group_rollout(iteration, with_step_noise=False)  # the step noise is drawn per step below
        chain_prompts, n_local, n_global, embeds = plan.sample_prompts, plan.n_local, plan.n_global, plan.embeds
        sde_mask, schedule, local = plan.sde_mask, plan.schedule, slice(plan.first, plan.first + plan.n_local)
        latent = self.adapter.latent_shape(self.resolution, self.resolution)
        x = plan.noise.to(self.device)
        self.adapter.denoiser.eval()
        bs = cfg.rollout.sample_batch_size
        steps, states, nexts, olds, scores = [], [], [], [], []
        for i in range(s.num_steps):
            branched = bool(sde_mask[i])
            if branched:  # all noise and random picks of the step drawn globally, then sliced (process-count independent)
                eps = torch.randn((n_global, k, *latent), generator=self.generator)[local]
                random_pick = torch.randint(0, k, (n_global,), generator=self.generator)[local]  # choose_continuation's "random" rule
            new_x = torch.empty_like(x)
            step_scores, step_next, step_old = [], [], []
            for start in range(0, n_local, bs):
                c = slice(start, start + bs)
                t = schedule[i].expand(len(x[c])).to(self.device)
                t_next = schedule[i + 1].expand(len(x[c])).to(self.device)
                with self.autocast():
                    v = self.adapter.predict(x[c], t, embeds.select(c), s.guidance_scale)
                if not branched:
                    new_x[c] = self.kernel.step(v, x[c], t, t_next, sde=False).prev_sample.float()
                    continue
                cands = branch_candidates(self.kernel, v, x[c], t, t_next, k, noise=eps[c])
                sc = self.reward_fn.score_latents(cands.next_states.flatten(0, 1), t_next.repeat_interleave(k),
                                                  [p for p in chain_prompts[c] for _ in range(k)])
                sc = reward_models.check_reward_output(cfg.reward.name, sc, len(x[c]) * k).view(-1, k)
                pick = random_pick[c] if algo.continuation == "random" else choose_continuation(sc, "best")
                new_x[c] = cands.next_states[torch.arange(len(sc)), pick.to(cands.next_states.device)]
                step_scores.append(sc)
                step_next.append(cands.next_states.cpu())
                step_old.append(cands.log_probs.cpu())
            if branched:
                steps.append(i)
                states.append(x.cpu())
                nexts.append(torch.cat(step_next))
                olds.append(torch.cat(step_old))
                scores.append(torch.cat(step_scores))
            x = new_x
        images = torch.cat([self.adapter.decode(x[c : c + bs]).float().clamp(0, 1).cpu() for c in range(0, n_local, bs)])
        return {"prompts": chain_prompts, "embeds": embeds, "first": plan.first, "n_global": n_global, "schedule": schedule,
                "steps": steps, "states": states, "nexts": nexts, "olds": olds, "scores": scores, "images": images}

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo, num_steps = self.algo, self.cfg.sampling.num_steps
        ro = self.rollout(iteration)
        self.guard_finals(ro["images"], ro["prompts"], iteration)  # train.guard's verifier: the chains' final images
        (finals, info), = self.reward_results([self.score_async(ro["images"], ro["prompts"])])  # agreed over processes
        finals = self.check_rewards(finals, iteration)
        all_finals = self.accelerator.gather(finals.to(self.device)).cpu()
        ok = torch.isfinite(all_finals)
        record = {
            "reward_mean": float(all_finals[ok].mean()) if ok.any() else float("nan"),
            "reward_std": float(all_finals[ok].std(unbiased=False)) if ok.sum() > 1 else 0.0,
            **{f"reward/{key}" if not key.startswith("reward/") else key: float(v) for key, v in info.items()},
        }
        if not ro["steps"]:
            return {**record, "optimizer_steps": 0}
        # (chains, branched steps, ...) in chain-major order so that global ids increase
        scores = torch.stack(ro["scores"], 1)  # (C, S, k)
        c, n_steps = scores.shape[:2]
        adv = candidate_advantages(scores.flatten(0, 1), eps=algo.advantage_eps, clip=algo.advantage_clip,
                                   filter_zero_std=algo.filter_zero_std_groups)
        step_ids = torch.tensor(ro["steps"])
        chain_ids = torch.arange(c).repeat_interleave(n_steps)
        flat_steps = step_ids.repeat(c)
        schedule = ro["schedule"]
        tr = Transitions(
            states=torch.stack(ro["states"], 1).flatten(0, 1),
            next_states=torch.stack(ro["nexts"], 1).flatten(0, 1),
            t=schedule[flat_steps],
            t_next=schedule[flat_steps + 1],
            embed_rows=chain_ids,
            old_log_probs=torch.stack(ro["olds"], 1).flatten(0, 1),
            advantages=adv.advantages,
            keep=adv.keep,
            global_ids=(ro["first"] + chain_ids) * num_steps + flat_steps,
            num_global=ro["n_global"] * num_steps,
        )
        finite = torch.isfinite(scores)
        record.update({
            "drm_score_mean": float(scores[finite].mean()) if finite.any() else float("nan"),
            "drm_score_spread": float(scores.std(dim=2, unbiased=False).nanmean()),  # mean within-state std of the k scores
            "advantage_abs_mean": float(adv.advantages[adv.keep].abs().mean()) if adv.keep.any() else 0.0,
            "zero_std_frac": adv.zero_std_fraction,
            "kept_frac": float(adv.keep.float().mean()),
            "branched_steps": n_steps,
            "drm_forwards": int(np.prod(scores.shape)),
        })
        record.update(self.update_transitions(tr, ro["embeds"]))
        return record


register_recipe("drm_step_grpo", DRMStepGRPOConfig, DRMStepGRPOTrainer)
