"""SPO's step-wise resampler: k candidates of the next state from one shared state, judged by a
step-aware preference model; the (best, worst) pair of each confident judgement is kept.

Sampler axis: this module only calls ``adapter.predict`` / ``to_x0`` / ``decode``, a
:class:`~diffalign.sampling.Kernel` (DDIM with eta > 0 for SD1.5 / SDXL, or a flow SDE kernel)
and a scorer; the pair selection is :func:`diffalign.algorithms.spo.select_pairs`.

One rollout of a batch of B prompts (step indices ``i = 0 .. T-1``, state ``x_i`` at time ``t_i``):

1. Steps ``i < start_step``: one ordinary SDE step (the first, very noisy steps are not judged:
   their x0 predictions are too blurry to compare; the reference starts at step 4 of 20).
2. At a branch point ``i``: the shared state is copied into ``k`` chains that each take
   ``m = branch_steps`` SDE steps with their own noise (``m = 1``: SD1.5 recipe, the pair shares
   its starting state; the SDXL recipe uses ``m = 3``). Each chain's end state is scored by the
   SPM on the decoded x0 prediction of the *policy* at the end state's noise level (the final,
   clean state is scored as it is, at noise level 0).
3. :func:`select_pairs` keeps (best, worst) when ``softmax(s_best, s_worst)[0] - [1] > threshold``:
   each of the ``m`` transitions of the best chain is paired with the same step of the worst chain.
4. The trajectory continues from one chain (uniformly random, or the best one); its policy output
   at the end state, already computed for scoring, is reused for its next step.

Model evaluations: ``start_step + (T - start_step) * k`` forwards per prompt (CFG doubles rows,
not calls). Noise and random choices of sample ``b`` come from its own generator, so a rollout
does not depend on batching or on how samples are split across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.algorithms.continuation import choose_continuation
from diffalign.algorithms.spo import select_pairs
from diffalign.forward_process import noise_level
from diffalign.sampling.linear import Kernel

# scorer(images (N,3,H,W) in [0,1], prompts (N), noise levels (N,)) -> scores (N,)
Scorer = Callable[[torch.Tensor, Sequence[str], torch.Tensor], torch.Tensor]


@dataclass
class StepPairs:
    """``P`` kept (win, lose) transition pairs, on the CPU.

    ``state_win`` / ``state_lose``: ``(P, *latent)`` states ``x_i`` the transitions start from
    (identical when ``branch_steps == 1``); ``next_win`` / ``next_lose``: ``(P, *latent)`` the
    states ``x_{i+1}`` reached; ``t`` / ``t_next``: ``(P,)`` model times; ``log_prob_win`` /
    ``log_prob_lose``: ``(P,)`` log-densities under the sampling policy; ``sample``: ``(P,)`` row of
    the rollout batch (prompt / embeddings); ``step``: ``(P,)`` step index ``i``; ``margin``:
    ``(P,)`` the SPM's softmax margin that kept the pair.
    """

    state_win: torch.Tensor
    state_lose: torch.Tensor
    next_win: torch.Tensor
    next_lose: torch.Tensor
    t: torch.Tensor
    t_next: torch.Tensor
    log_prob_win: torch.Tensor
    log_prob_lose: torch.Tensor
    sample: torch.Tensor
    step: torch.Tensor
    margin: torch.Tensor

    def __len__(self) -> int:
        return int(self.t.shape[0])

    def select(self, index) -> "StepPairs":
        return StepPairs(*(getattr(self, f)[index] for f in self.fields()))

    @staticmethod
    def fields() -> tuple[str, ...]:
        return ("state_win", "state_lose", "next_win", "next_lose", "t", "t_next", "log_prob_win", "log_prob_lose",
                "sample", "step", "margin")

    @staticmethod
    def cat(items: Sequence["StepPairs"]) -> "StepPairs":
        return StepPairs(*(torch.cat([getattr(p, f) for p in items]) for f in StepPairs.fields()))

    @staticmethod
    def empty(latent_shape: tuple[int, ...]) -> "StepPairs":
        z = torch.zeros((0, *latent_shape))
        e = torch.zeros(0)
        return StepPairs(z, z, z, z, e, e, e, e, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), e)


@dataclass
class StepwiseRollout:
    """Result of :func:`sample_stepwise` for B prompts.

    ``pairs``: the kept pairs; ``images``: ``(B, 3, H, W)`` final images of the continued
    trajectories; ``scores``: ``(J, B, k)`` SPM scores of every judgement (J branch points);
    ``keep``: ``(J, B)`` bool, judgements that produced a pair; ``judged_steps``: the J branch-point
    step indices; ``nfe``: denoiser evaluations (batched calls x rows / B).
    """

    pairs: StepPairs
    images: torch.Tensor
    scores: torch.Tensor
    keep: torch.Tensor
    judged_steps: list[int] = field(default_factory=list)
    nfe: int = 0


def _randn(generators: Sequence[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """``(len(generators), *shape)`` standard normals, row b from ``generators[b]`` (CPU)."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators])


@torch.no_grad()
def sample_stepwise(
    adapter: ModelAdapter,
    kernel: Kernel,
    embeds: PromptEmbeds,
    prompts: Sequence[str],
    schedule: torch.Tensor,
    scorer: Scorer,
    *,
    num_candidates: int,
    threshold: float,
    start_step: int,
    guidance_scale: float,
    height: int,
    width: int,
    generators: Sequence[torch.Generator],
    branch_steps: int = 1,
    continue_from: str = "random",
) -> StepwiseRollout:
    """Step-wise resampled rollouts of ``len(prompts)`` samples (see the module docstring).

    ``generators``: one ``torch.Generator`` (CPU) per sample; it draws the sample's initial noise,
    every candidate's step noise and the random continuation choices, in that order per step.
    """
    if num_candidates < 2:
        raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")
    if branch_steps < 1:
        raise ValueError(f"branch_steps must be >= 1, got {branch_steps}")
    batch, k = len(prompts), num_candidates
    if len(embeds) != batch or len(generators) != batch:
        raise ValueError(f"got {batch} prompts, {len(embeds)} embeddings and {len(generators)} generators")
    device = adapter.device
    latent = adapter.latent_shape(height, width)
    num_steps = len(schedule) - 1
    x = _randn(generators, latent).to(device)
    out: Optional[torch.Tensor] = None  # policy output at (x, t_i) when already known
    embeds_k = embeds.repeat_interleave(k)
    prompts_k = [p for p in prompts for _ in range(k)]
    rows = torch.arange(batch)
    pairs: list[StepPairs] = []
    all_scores, all_keep, judged = [], [], []
    images: Optional[torch.Tensor] = None
    nfe = 0

    def times(i: int, n: int) -> torch.Tensor:
        return schedule[i].expand(n).to(device)

    i = 0
    while i < num_steps:
        if out is None:
            out = adapter.predict(x, times(i, batch), embeds, guidance_scale)
            nfe += 1
        if i < start_step:  # an ordinary SDE step
            eps = _randn(generators, latent).to(device)
            x = kernel.step(out, x, times(i, batch), times(i + 1, batch), sde=True, noise=eps).prev_sample.float()
            out, images = None, None
            i += 1
            continue
        m = min(branch_steps, num_steps - i)
        xs = x.repeat_interleave(k, dim=0)  # (B*k, ...): row b*k + j is candidate j of sample b
        outs = out.repeat_interleave(k, dim=0)
        starts, nexts, logps = [], [], []
        for j in range(m):
            if j > 0:
                outs = adapter.predict(xs, times(i + j, batch * k), embeds_k, guidance_scale)
                nfe += k
            eps = _randn(generators, (k, *latent)).reshape(batch * k, *latent).to(device)
            step = kernel.step(outs, xs, times(i + j, batch * k), times(i + j + 1, batch * k), sde=True, noise=eps)
            logp = step.log_prob if step.log_prob is not None else torch.zeros(batch * k, device=device)
            starts.append(xs)
            nexts.append(step.prev_sample.float())
            logps.append(logp.float())
            xs = step.prev_sample.float()
        end = i + m
        if end < num_steps:  # judge the x0 prediction of the end state; its output is reused below
            out_end = adapter.predict(xs, times(end, batch * k), embeds_k, guidance_scale)
            nfe += k
            x0 = adapter.to_x0(out_end, xs, times(end, batch * k))
        else:  # the final state is clean
            out_end, x0 = None, xs
        cand_images = adapter.decode(x0).float().clamp(0, 1)
        tau = noise_level(adapter, schedule[end]).expand(batch * k)
        scores = torch.as_tensor(scorer(cand_images, prompts_k, tau)).float().cpu().view(batch, k)
        sel = select_pairs(scores, threshold)
        all_scores.append(scores)
        all_keep.append(sel.keep)
        judged.append(i)
        kept = torch.nonzero(sel.keep).flatten()
        if len(kept):
            w = kept * k + sel.best[kept]
            l = kept * k + sel.worst[kept]  # noqa: E741
            for j in range(m):
                pairs.append(StepPairs(
                    starts[j][w].cpu(), starts[j][l].cpu(), nexts[j][w].cpu(), nexts[j][l].cpu(),
                    schedule[i + j].expand(len(kept)).clone(), schedule[i + j + 1].expand(len(kept)).clone(),
                    logps[j][w].cpu(), logps[j][l].cpu(), kept.clone(), torch.full((len(kept),), i + j, dtype=torch.long),
                    sel.margin[kept].clone(),
                ))
        cont = torch.cat([choose_continuation(scores[b : b + 1], continue_from, generators[b]) for b in range(batch)])
        chosen = rows * k + cont
        x = xs[chosen.to(device)]
        out = out_end[chosen.to(device)] if out_end is not None else None
        images = cand_images[chosen.to(cand_images.device)]
        i = end
    if images is None:  # the last step was not a branch point
        images = adapter.decode(x).float().clamp(0, 1)
    return StepwiseRollout(
        pairs=StepPairs.cat(pairs) if pairs else StepPairs.empty(latent),
        images=images.cpu(),
        scores=torch.stack(all_scores) if all_scores else torch.zeros(0, batch, k),
        keep=torch.stack(all_keep) if all_keep else torch.zeros(0, batch, dtype=torch.bool),
        judged_steps=judged,
        nfe=nfe,
    )
