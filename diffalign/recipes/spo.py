"""SPO recipe: step-wise resampled rollouts judged by a step-aware preference model -> kept
(win, lose) transition pairs -> the SPO loss against the frozen initial model.

The math lives in :mod:`diffalign.algorithms.spo`, the rollout in
:mod:`diffalign.spm.sampling`, the preference model in :mod:`diffalign.spm.model` (trained with
``diffalign train-spm``); this file only orchestrates. Kernels: DDIM with eta > 0 for epsilon
models (``sampling.kernel: ddim``, the paper's SD1.5 / SDXL setting) and the flow SDE kernels
(``flow_grpo``, ``cps``, ``dance``) for flow models.

Choices (documented because the reference differs or is silent):

- The reference model is the frozen initial trainable weights: with LoRA the adapter-disabled
  network (the reference code keeps a separate copy of the UNet; identical values, no extra
  memory here), with full fine-tuning a frozen copy.
- The SPM judges the *policy's* x0 prediction of each candidate (as the reference sampler, which
  reuses that forward to continue the trajectory).
- ``rollout.group_size`` trajectories are drawn per prompt (the reference draws one per prompt
  and ``sample_batch_size`` prompts; set ``prompts_per_iteration x group_size`` accordingly).
- One optimizer step every ``algorithm.accumulation_steps`` micro-batches of ``train.batch_size``
  pairs (the reference's gradient accumulation), so the number of optimizer steps per iteration
  follows the number of kept pairs; ``train.optimizer_steps_per_iteration`` must stay 1.
- The final images of the continued trajectories are scored with ``reward`` (the eval reward,
  e.g. ShapesEval) for the training curve only; the SPM is the only training signal.

Multi-process runs: rollouts are split across processes (each sample has its own noise
generator seeded from one shared draw), kept pairs are gathered, shuffled with the shared
generator and split evenly (the remainder is dropped, as in the reference), and losses are
normalised by the global pair count of each optimizer step; the update's shuffle is a global
draw, so the shared generator advances alike for any number of processes. Two gloo processes
give the same update as one (``tests/test_distributed.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import reward_models
from diffalign.algorithms.spo import spo_loss
from diffalign.config import AlgorithmConfig, check
from diffalign.config_files import from_dict
from diffalign.errors import ConfigError, RewardError
from diffalign.recipes import register_recipe
from diffalign.spm.sampling import StepPairs, sample_stepwise
from diffalign.spm.train import SPMTrainConfig
from diffalign.trainer import Trainer
from diffalign.training.rewards import reward_info


@dataclass
class SPOConfig(AlgorithmConfig):
    name: str = "spo"
    spm: str = "spm"  # reward name or dotted path of the step-aware preference model; it must take a timestep
    spm_kwargs: dict = field(default_factory=dict)  # e.g. {model: runs/spm_shapes} (an SPM folder from `diffalign train-spm`)
    # How `diffalign train-spm <this config>` trains that SPM: diffalign.spm.train.SPMTrainConfig keys; model, prompts,
    # reward and seed default to the run's, output_dir to spm_kwargs.model. Not used by the SPO run itself.
    spm_train: dict = field(default_factory=dict)
    num_candidates: int = 4  # k: candidates of the next state drawn from each shared state (SD1.5 4, SDXL 2)
    threshold: float = 0.3  # keep (best, worst) when softmax(s_best, s_worst)[0] - [1] > threshold (SD1.5 0.3, SDXL 0.4)
    resample_start: int = 4  # first step index that branches; earlier steps are plain SDE steps (reference: 4 of 20)
    branch_steps: int = 1  # m: SDE steps each candidate chain takes before it is judged (SD1.5 1; SDXL recipe 3)
    continue_from: Literal["random", "best"] = "random"  # candidate the trajectory continues from (paper: random)
    beta: float = 10.0  # beta of -log sigmoid(beta * (log r_w - log r_l))
    clip_range: float = 0.1  # r = clamp(pi_theta / pi_ref, 1 - eps, 1 + eps)
    accumulation_steps: int = 1  # micro-batches of train.batch_size pairs per optimizer step
    logprob_reduction: Literal["mean", "sum"] = "mean"  # Gaussian log-density over latent dims (reference: mean)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.num_candidates >= 2, "algorithm.num_candidates", f"must be >= 2 (a pair needs two candidates), got {self.num_candidates}")
        check(0.0 <= self.threshold < 1.0, "algorithm.threshold",
               f"must be in [0, 1) (a softmax margin of two scores lies in [0, 1)), got {self.threshold}")
        check(self.resample_start >= 0, "algorithm.resample_start", "must be >= 0")
        check(self.branch_steps >= 1, "algorithm.branch_steps", "must be >= 1")
        check(self.beta > 0, "algorithm.beta", "must be > 0")
        check(0 < self.clip_range < 1, "algorithm.clip_range", "must be in (0, 1)")
        check(self.accumulation_steps >= 1, "algorithm.accumulation_steps", "must be >= 1")
        check(bool(self.spm), "algorithm.spm", "must name a step-aware preference model (e.g. spm)")
        if self.spm_train:  # checked with the run config's defaults by `train-spm`; here its own keys and values
            try:
                from_dict(SPMTrainConfig, self.spm_train, "algorithm.spm_train").validate()
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("config key '", "config key 'algorithm.spm_train.")
                                  .replace("algorithm.spm_train.algorithm.spm_train.", "algorithm.spm_train.")) from None
        super().validate(prefix)

    def named_rewards(self) -> list[tuple[str, str, dict]]:
        return [("algorithm.spm", self.spm, self.spm_kwargs)]  # the step-aware preference model is a reward by name

    def kernel_reduction(self) -> str:
        return self.logprob_reduction

    def untrained_judge(self, cfg, config_path: str) -> str | None:
        model = str((self.spm_kwargs or {}).get("model", ""))
        if self.spm == "spm" and self.spm_train and model and not model.startswith("tiny:") and not Path(model).exists():
            return (f"the step-aware preference model {model!r} (algorithm.spm_kwargs.model) is not trained yet; "
                    f"train it first with: diffalign train-spm {config_path}")
        return None


def build_step_aware_scorer(name: str, kwargs: dict, device: str):
    """Build the SPM reward and check that it takes a timestep (``takes_timestep`` and a
    ``score(images, prompts, tau)`` method); anything else is a ConfigError naming ``algorithm.spm``."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(
            f"config key 'algorithm.spm': reward {name!r} cannot take a timestep ({what} scores clean images only); SPO needs a "
            "step-aware preference model, e.g. algorithm.spm=spm with algorithm.spm_kwargs.model=<SPM folder>"
        )

    # a registered reward class says whether it takes a timestep before it is built
    factory = reward_models.base.registered(name)
    if isinstance(factory, type) and not getattr(factory, "takes_timestep", False):
        raise refuse(factory.__name__)
    try:
        fn = reward_models.build(name, device=device, **kwargs)
    except RewardError:
        if not kwargs:
            raise
        try:  # the SPM's kwargs may not fit a reward that is no SPM at all: say that instead
            bare = reward_models.build(name, device=device)
        except Exception:
            bare = None
        if bare is not None and not getattr(bare, "takes_timestep", False):
            raise refuse(type(bare).__name__) from None
        raise
    if not getattr(fn, "takes_timestep", False) or not callable(getattr(fn, "score", None)):
        raise refuse(type(fn).__name__)
    return fn


class SPOTrainer(Trainer):
    supports_fsdp = True  # equal rollouts and equal pair shares: every process runs the same forwards
    needs_reference = True  # the loss is a ratio against the frozen initial model
    learned_reward_key = "spm_score_mean"  # the SPM trains the policy; `reward` only scores the final images

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: SPOConfig = cfg.algorithm
        self._checked = False  # on-policy self-check done

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, algo = self.cfg, self.algo
        # Cross-section checks and the SPM come first: bad input must not touch the run directory.
        check(cfg.sampling.noise_level > 0, "sampling.noise_level", "must be > 0 for SPO (candidates drawn with no noise are identical)")
        check(algo.resample_start < cfg.sampling.num_steps, "algorithm.resample_start",
               f"must be < sampling.num_steps = {cfg.sampling.num_steps} (no step would be judged)")
        check(cfg.train.optimizer_steps_per_iteration == 1, "train.optimizer_steps_per_iteration",
               "must be 1 for SPO: it steps every algorithm.accumulation_steps micro-batches of kept pairs")
        self.spm = build_step_aware_scorer(algo.spm, algo.spm_kwargs, "cpu")
        super().setup()
        if self.device.type != "cpu":
            self.spm = build_step_aware_scorer(algo.spm, algo.spm_kwargs, str(self.device))

    def print_header(self) -> None:
        cfg, algo = self.cfg, self.algo
        steps = cfg.sampling.num_steps
        judged = math.ceil((steps - algo.resample_start) / algo.branch_steps)
        trajectories = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size * self.accelerator.num_processes
        n_train = sum(p.numel() for p in self.trainable)
        self.log(f"diffalign: spo on {cfg.model.id} ({self.adapter.family}, {self.resolution}px) -> {self.run_dir}")
        self.log(f"  trajectories per iteration {trajectories}, judgements per trajectory {judged} (k={algo.num_candidates}, "
                 f"from step {algo.resample_start} of {steps}, {algo.branch_steps} step(s) per branch), at most "
                 f"{trajectories * (steps - algo.resample_start)} pairs per iteration, "
                 f"~{algo.resample_start + (steps - algo.resample_start) * algo.num_candidates} denoiser forwards per trajectory, "
                 f"trainable params {n_train:,}, processes {self.accelerator.num_processes}, device {self.device}")

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """This process's trajectories: kept pairs, prompts, final-image rewards and statistics."""
        cfg, algo, s = self.cfg, self.algo, self.cfg.sampling
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_proc, group = cfg.rollout.prompts_per_iteration, cfg.rollout.group_size
        all_prompts = self.prompt_sampler.next(per_proc * world)  # identical on every process
        prompts = all_prompts[rank * per_proc : (rank + 1) * per_proc]
        sample_prompts = [p for p in prompts for _ in range(group)]
        n_local = len(sample_prompts)
        # One shared draw per iteration seeds a generator per (global) sample.
        base_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        first = rank * n_local
        generators = [torch.Generator("cpu").manual_seed(base_seed + first + i) for i in range(n_local)]
        embeds = self.adapter.encode_prompts(prompts, with_uncond=s.guidance_scale > 1).repeat_interleave(group)
        schedule = self.adapter.make_schedule(s.num_steps, self.resolution, self.resolution)
        self.adapter.denoiser.eval()
        pairs, prompt_of_pair, futures, scores, keeps, nfe = [], [], [], [], [], 0
        bs = cfg.rollout.sample_batch_size
        for start in range(0, n_local, bs):
            idx = slice(start, start + bs)
            with self.autocast():
                out = sample_stepwise(
                    self.adapter, self.kernel, embeds.select(idx), sample_prompts[idx], schedule, self.spm.score,
                    num_candidates=algo.num_candidates, threshold=algo.threshold, start_step=algo.resample_start,
                    branch_steps=algo.branch_steps, continue_from=algo.continue_from, guidance_scale=s.guidance_scale,
                    height=self.resolution, width=self.resolution, generators=generators[idx],
                )
            pairs.append(out.pairs)
            prompt_of_pair += [sample_prompts[start + int(j)] for j in out.pairs.sample]
            scores.append(out.scores.flatten())
            keeps.append(out.keep.flatten())
            nfe = out.nfe
            futures.append(self.score_async(out.images, sample_prompts[idx]))
            self.guard_finals(out.images, sample_prompts[idx], iteration)  # train.guard's verifier: the continued trajectories' finals
        results = self.reward_results(futures)
        rewards = self.check_rewards(torch.cat([r for r, _ in results]), iteration)
        info = self.gather_info(reward_info(results))  # per-batch means, then over processes
        # every process judges the same number of states: gather them for run-wide statistics
        all_scores = self.accelerator.gather(torch.cat(scores).to(self.device)).cpu()
        all_keep = self.accelerator.gather(torch.cat(keeps).to(self.device)).cpu()
        stats = {"spm_score_mean": float(all_scores.mean()), "spm_score_std": float(all_scores.std(unbiased=False)),
                 "kept_frac": float(all_keep.float().mean()) if len(all_keep) else 0.0, "nfe_per_trajectory": nfe}
        return StepPairs.cat(pairs), prompt_of_pair, rewards, info, stats

    def _share_pairs(self, pairs: StepPairs, prompts: list[str]) -> tuple[StepPairs, list[str], int]:
        """Gather every process's pairs, shuffle them with the shared generator and return this
        process's equal share (and the global number of pairs used)."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if world > 1:
            from accelerate.utils import gather_object

            counts = self.accelerator.gather(torch.tensor([len(pairs)], device=self.device)).cpu()
            longest = int(counts.max())
            fields = {}
            for name in StepPairs.fields():
                value = getattr(pairs, name).to(self.device)
                pad = torch.zeros((longest - len(value), *value.shape[1:]), dtype=value.dtype, device=self.device)
                gathered = self.accelerator.gather(torch.cat([value, pad])).cpu()
                fields[name] = torch.cat([gathered[r * longest : r * longest + int(counts[r])] for r in range(world)])
            pairs = StepPairs(**fields)
            prompts = [p for chunk in gather_object([prompts]) for p in chunk]
        total = len(pairs)
        perm = torch.randperm(total, generator=self.generator)
        share = total // world
        mine = perm[rank * share : (rank + 1) * share]
        return pairs.select(mine), [prompts[int(i)] for i in mine], share * world

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        pairs, prompts, rewards, info, stats = self.rollout(iteration)
        all_rewards = self.accelerator.gather(rewards.to(self.device)).cpu()
        finite = torch.isfinite(all_rewards)
        kept_local = len(pairs)
        pairs, prompts, n_used = self._share_pairs(pairs, prompts)
        record = {
            "reward_mean": float(all_rewards[finite].mean()) if finite.any() else float("nan"),
            "reward_std": float(all_rewards[finite].std(unbiased=False)) if finite.sum() > 1 else 0.0,
            "pairs": n_used, "pairs_local_kept": kept_local,
            **stats, **info,
        }
        # every process holds an equal share of the pairs: the mean of the shares' means
        record.update(self.gather_info({"margin_mean": float(pairs.margin.mean()) if len(pairs) else float("nan")}))
        record.update(self.update(pairs, prompts, n_used))
        return record

    # ---- policy update ----------------------------------------------------------------------
    def _log_probs(self, pairs: StepPairs, embeds) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(next | state) of the win and the lose transitions under the current network (the
        policy, or the reference inside ``reference_model()``). Pairs whose two transitions share their state take one forward."""
        dev, g = self.device, self.cfg.sampling.guidance_scale
        x_w, x_l = pairs.state_win.to(dev), pairs.state_lose.to(dev)
        t, t_next = pairs.t.to(dev), pairs.t_next.to(dev)
        differ = torch.nonzero((x_w != x_l).flatten(1).any(dim=1)).flatten()
        states = torch.cat([x_w, x_l[differ]])
        rows = torch.cat([torch.arange(len(x_w), device=dev), differ])
        emb = embeds.select(rows.to(next(iter(embeds.cond.values())).device))
        with self.autocast():
            out = self.adapter.predict(states, torch.cat([t, t[differ]]), emb, g)
        out_w = out[: len(x_w)]
        out_l = out_w.index_put((differ,), out[len(x_w) :]) if len(differ) else out_w
        step_w = self.kernel.step(out_w, x_w, t, t_next, sde=True, prev_sample=pairs.next_win.to(dev))
        step_l = self.kernel.step(out_l, x_l, t, t_next, sde=True, prev_sample=pairs.next_lose.to(dev))
        return step_w.log_prob, step_l.log_prob

    def update(self, pairs: StepPairs, prompts: list[str], n_global: int) -> dict:
        cfg, algo = self.cfg, self.algo
        world = self.accelerator.num_processes
        stats = {k: [] for k in ("loss", "ratio_win", "ratio_lose", "clip_frac", "implicit_acc", "grad_norm")}
        steps_applied = 0
        if n_global == 0:
            return {**{k: float("nan") for k in stats}, "optimizer_steps": 0}
        self.adapter.denoiser.train()
        g = cfg.sampling.guidance_scale
        bs = cfg.train.batch_size
        for _epoch in range(cfg.train.inner_epochs):
            # A global draw, then this process's rows: the generator advances alike for any number of
            # processes (every process holds len(pairs) = n_global / world pairs, see _share_pairs).
            perm = torch.randperm(n_global, generator=self.generator)
            first = self.accelerator.process_index * len(pairs)
            order = perm[(perm >= first) & (perm < first + len(pairs))] - first
            batches = [order[s : s + bs] for s in range(0, len(order), bs)]
            groups = [batches[s : s + algo.accumulation_steps] for s in range(0, len(batches), algo.accumulation_steps)]
            for group in groups:
                global_terms = sum(len(b) for b in group) * world  # every process holds the same number of pairs
                bad = False
                for rows in group:
                    batch = pairs.select(rows)
                    batch_prompts = [prompts[int(i)] for i in rows]
                    embeds = self.adapter.encode_prompts(batch_prompts, with_uncond=g > 1)
                    logp_w, logp_l = self._log_probs(batch, embeds)
                    if not self._checked:
                        self.check_log_ratio(torch.cat([logp_w, logp_l]).detach(),
                                             torch.cat([batch.log_prob_win, batch.log_prob_lose]).to(logp_w.device),
                                             f"at steps {sorted(set(batch.step.tolist()))}", "step-wise sampler")
                    with torch.no_grad(), self.reference_model():
                        ref_w, ref_l = self._log_probs(batch, embeds)
                    res = spo_loss(logp_w, ref_w, logp_l, ref_l, beta=algo.beta, clip_range=algo.clip_range)
                    loss = res.per_pair.sum() / float(global_terms)
                    if not self.accumulate(loss):
                        bad = True
                        continue
                    stats["loss"].append(float(res.loss.detach()))
                    stats["ratio_win"].append(float(res.ratio_win.mean()))
                    stats["ratio_lose"].append(float(res.ratio_lose.mean()))
                    stats["clip_frac"].append(float(res.clip_frac))
                    stats["implicit_acc"].append(float(res.accuracy))
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
                self._checked |= applied
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        return out

    # ---- state ------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"checked": self._checked}

    def load_extra_state(self, state: dict) -> None:
        self._checked = bool(state.get("checked", self._checked))


register_recipe("spo", SPOConfig, SPOTrainer)
