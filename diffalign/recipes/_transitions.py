"""Clipped policy-gradient updates on a flat set of transitions with per-transition advantages.

Flow-GRPO's update (``diffalign.recipes.flow_grpo``) gives every trained step of a sample the
sample's advantage. The dense-credit methods give each *transition* its own advantage:

- Stepwise-Flow-GRPO: one transition per (sample, trained step), advantage from the step's gain;
- DRM Step-GRPO: k candidate transitions from each shared state, advantage from the k DRM scores.

Both are "a state ``x_t`` with k sampled next states" (k = 1 for the first), so one forward of the
policy at ``(x_t, t)`` re-scores all k next states. :class:`TransitionTrainer` implements that
update with the same guarantees as Flow-GRPO's: ratio 1 before the first optimizer step (checked),
the loss normalised by the global number of (state, candidate) terms, gradients summed across
processes (every process draws the same global shuffle and takes its share), non-finite losses
skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffalign.adapters.base import PromptEmbeds
from diffalign.recipes._clipped import accumulate_clipped, reference_kl
from diffalign.recipes._grpo_guard import make_guard, select_step, steps_of
from diffalign.trainer import Trainer


@dataclass
class Transitions:
    """M states of this process, each with k sampled next states (CPU tensors).

    ``states``: (M, *latent) — ``x_t``; ``next_states``: (M, k, *latent) — the sampled ``x_{t'}``;
    ``t``, ``t_next``: (M,) — times of both (the adapter's convention);
    ``embed_rows``: (M,) long — row of each state's prompt in the ``embeds`` passed to the update;
    ``old_log_probs``: (M, k) — log-probs under the sampling policy; ``advantages``: (M, k);
    ``keep``: (M, k) bool — terms that enter the loss;
    ``global_ids``: (M,) long, strictly increasing — ids unique across processes in
    ``[0, num_global)``, for the global shuffle.
    """

    states: torch.Tensor
    next_states: torch.Tensor
    t: torch.Tensor
    t_next: torch.Tensor
    embed_rows: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor
    global_ids: torch.Tensor
    num_global: int

    def __len__(self) -> int:
        return self.states.shape[0]

    @property
    def k(self) -> int:
        return self.next_states.shape[1]


class TransitionTrainer(Trainer):
    """Trainer base for algorithms whose advantages are per transition (see the module docstring).

    Subclasses set ``self.algo`` (a config with ``clip_range`` and ``beta``) and call
    :meth:`update_transitions` from ``iteration``.
    """

    supports_sample_offload = True  # update_transitions moves each micro-batch to the device

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo = cfg.algorithm
        self.needs_reference = self.algo.beta > 0
        self._checked = False  # on-policy self-check done (before the first optimizer step)

    def update_transitions(self, tr: Transitions, embeds: PromptEmbeds) -> dict:
        cfg, algo = self.cfg, self.algo
        g = cfg.sampling.guidance_scale
        dev = self.device
        tr, embeds = self.stash_samples(tr, embeds)  # CPU memory until a micro-batch uses them (rollout.offload_samples)
        stats = {"loss": [], "policy_loss": [], "kl": [], "clip_frac": [], "approx_kl": [], "ratio_mean": [], "grad_norm": []}
        steps_applied = 0
        k = tr.k
        state_keep = tr.keep.any(dim=1)
        schedule = self.adapter.make_schedule(cfg.sampling.num_steps, self.resolution, self.resolution)
        guard = make_guard(self, algo, schedule, torch.unique(steps_of(schedule, tr.t)),
                           reduction=algo.logprob_reduction)  # GRPO-Guard (None when off)
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            perm = torch.randperm(tr.num_global, generator=self.generator)  # same on every process
            mine = torch.isin(perm, tr.global_ids)
            order = torch.searchsorted(tr.global_ids, perm[mine])  # local rows in global shuffle order
            order = order[state_keep[order]]
            bs = cfg.train.batch_size
            micro = [order[s : s + bs] for s in range(0, len(order), bs)]
            for group in self.plan_optimizer_steps([int(tr.keep[rows].sum()) for rows in micro]):
                bad = False
                for m in group.micro:
                    rows = micro[m]
                    x = tr.states[rows].to(dev)
                    t = tr.t[rows].to(dev)
                    t_next = tr.t_next[rows].to(dev)
                    emb = self.to_device(embeds.select(tr.embed_rows[rows].to(next(iter(embeds.cond.values())).device)))
                    with self.autocast():
                        out = self.adapter.predict(x, t, emb, g)
                    # one forward, k candidates: repeat the state's output for each next state
                    xk, outk = _rep(x, k), _rep(out, k)
                    tk, tnk = t.repeat_interleave(k), t_next.repeat_interleave(k)
                    nxt = tr.next_states[rows].to(dev).flatten(0, 1)
                    step = self.kernel.step(outk, xk, tk, tnk, sde=True, prev_sample=nxt)
                    keep = tr.keep[rows].flatten().to(dev)
                    old = tr.old_log_probs[rows].flatten().to(dev)
                    if not self._checked:
                        times = sorted(set(round(v, 4) for v in t.tolist()))
                        self.check_log_ratio(step.log_prob.detach()[keep], old[keep], f"at times {times}")
                    kl = None
                    if algo.beta > 0:
                        kl = reference_kl(self, x, t, emb, g, step, lambda ref_out: self.kernel.step(
                            _rep(ref_out, k), xk, tk, tnk, sde=True, prev_sample=nxt), step_times=(tk, tnk))[keep]
                    logp, old, adv = step.log_prob[keep], old[keep], tr.advantages[rows].flatten().to(dev)[keep]
                    if guard is not None:
                        logp, old, adv = guard(select_step(step, keep), old, adv, steps_of(schedule, tk[keep]))
                    if not accumulate_clipped(self, logp, old, adv, kl, algo, group.global_terms, stats):
                        bad = True
                for _ in range(group.forwards - len(group.micro)):  # FSDP padding: this process's first state
                    rows = torch.zeros(1, dtype=torch.long)
                    emb = self.to_device(embeds.select(tr.embed_rows[rows].to(next(iter(embeds.cond.values())).device)))
                    self.idle_forward(tr.states[rows].to(dev), tr.t[rows].to(dev), emb, g, reference=algo.beta > 0)
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
                self._checked |= applied  # the policy has moved: later ratios need not be 1
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        out["trained_terms"] = int(tr.keep.sum())
        if guard is not None:
            out.update(guard.metrics())
        return out


def _rep(x: torch.Tensor, k: int) -> torch.Tensor:
    """(M, ...) -> (M k, ...), each row repeated k times in place (row-major over (M, k))."""
    return x.repeat_interleave(k, dim=0) if k > 1 else x
