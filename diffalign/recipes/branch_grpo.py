"""BranchGRPO recipe: tree rollouts -> leaf rewards -> fused node values -> depth-wise advantages
-> (pruned) parent -> child edges -> clipped PPO updates.

The math lives in :mod:`diffalign.algorithms.branch_grpo`, the sampler in
:mod:`diffalign.sampling.tree`; this file orchestrates, following :mod:`diffalign.recipes.flow_grpo`
(global prompts / noise / shuffles sliced per process, losses over global term counts, the
on-policy self-check, non-finite handling).

- One tree per prompt; its leaves are the prompt's group, so ``rollout.group_size`` must equal
  ``branch_factor ** len(split_steps)``.
- **BranchGRPO-Mix** is this recipe with an SDE window (``sampling.window_size > 0``,
  ``window_mode: sliding``): stochastic steps are the window plus every split step, ODE
  elsewhere, and only stochastic edges are trained (ODE edges have no log-probability).
- Each iteration logs exact model-evaluation counts: ``nfe_rollout`` (node evaluations of all
  trees, all processes), ``nfe_per_image`` (the same per final image; a linear rollout costs
  ``sampling.num_steps``), ``rollout_forwards`` (batched forwards), ``denoiser_rows`` (rows through
  the denoiser, 2 per evaluation with CFG) and ``nfe_train`` (training forwards, +1 per edge for
  the KL reference).
- The run report gets a picture of one prompt's tree from the last iteration (``report/tree.png``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from diffalign import runs
from diffalign.algorithms.branch_grpo import (
    TreeStructure,
    active_pruned_depths,
    depthwise_advantages,
    fuse_rewards,
    training_edges,
    zero_std_trees,
)
from diffalign.config import AdvantageOptions, AlgorithmConfig, ClippedPolicyOptions, check, method_defaults
from diffalign.errors import ConfigError
from diffalign.recipes import register_recipe
from diffalign.recipes._clipped import accumulate_clipped, reference_kl
from diffalign.recipes._grpo_guard import make_guard
from diffalign.sampling import build_kernel, sde_window_mask
from diffalign.sampling.tree import TreeTrajectory, draw_tree, measure_forward_memory, sample_tree
from diffalign.trainer import Trainer
from diffalign.training.rewards import reward_info

MIB = 1024 * 1024


@dataclass
@method_defaults(clip_range=1e-3, advantage_eps=1e-8)  # the BranchGRPO reference's PPO epsilon and z-score eps
class BranchGRPOConfig(AdvantageOptions, ClippedPolicyOptions, AlgorithmConfig):
    """``algorithm.*`` of BranchGRPO; advantage (z-scores per tree depth), clipped-loss and guard_*
    keys from the shared mixins of :mod:`diffalign.config` (GRPO-Guard: docs/grpo_guard.md)."""

    name: str = "branch_grpo"
    # ---- the tree (rollout) ----
    split_steps: list[int] = field(default_factory=lambda: [0, 3, 6, 9])  # 0-based steps where every node branches (paper: 0,3,6,9 of 20)
    branch_factor: int = 2  # children per node at a split step; leaves = branch_factor ** len(split_steps) = rollout.group_size
    split_noise_scale: float = 1.0  # split edges use scale * eps; their log-prob stays the kernel's density (reference rule)
    shared_root_noise: bool = False  # every prompt's tree starts from the same noise (reference: init_same_noise)
    forward_memory_mb: float = 0.0  # working memory per rollout forward; 0 = chunk by rollout.sample_batch_size nodes
    # ---- credit ----
    reward_fusion: Literal["mean", "prob_weighted"] = "mean"  # node value: mean of leaf descendants (code) or softmax(alpha logp)-weighted children (paper)
    fusion_temperature: float = 1.0  # alpha of prob_weighted fusion
    advantage_unbiased_std: bool = True  # z-score per depth with Bessel's std (torch.std, as the reference) or the population std
    # ---- pruning of training edges (the rollout is unchanged) ----
    depth_pruning: list[int] = field(default_factory=list)  # child depths (1..num_steps) whose edges are not trained
    depth_pruning_slide: bool = False  # slide the pruned depths one step towards the root every depth_pruning_slide_every iterations
    depth_pruning_slide_every: int = 1
    depth_pruning_stop_depth: int = -1  # the window's shallowest depth never goes above this; -1 = the last split step
    width_pruning: Literal["none", "top", "best_worst"] = "none"  # after the last split keep the top ratio of branches, or best and worst ratio/2
    width_pruning_ratio: float = 0.5
    pruning_iterations: int = 0  # prune only in the first N iterations (reference pruning_step_ratio); 0 = always
    tree_picture: bool = True  # add a picture of one prompt's tree to report.md

    renamed_keys = {"filter_zero_std_trees": "filter_zero_std_groups"}  # a group is a prompt's tree

    def rewards_in_groups(self) -> bool:  # a group is a prompt's tree: its leaves
        return True

    def validate(self, prefix: str = "algorithm") -> None:
        check(len(self.split_steps) >= 1, "algorithm.split_steps", "must list at least one step")
        check(len(set(self.split_steps)) == len(self.split_steps), "algorithm.split_steps", f"has duplicates: {self.split_steps}")
        check(all(s >= 0 for s in self.split_steps), "algorithm.split_steps", f"must be >= 0: {self.split_steps}")
        check(self.branch_factor >= 2, "algorithm.branch_factor", "must be >= 2")
        check(self.split_noise_scale > 0, "algorithm.split_noise_scale", "must be > 0")
        check(self.forward_memory_mb >= 0, "algorithm.forward_memory_mb", "must be >= 0 (0 = chunk by rollout.sample_batch_size)")
        check(self.fusion_temperature > 0, "algorithm.fusion_temperature", "must be > 0")
        check(all(d >= 1 for d in self.depth_pruning), "algorithm.depth_pruning", f"depths must be >= 1: {self.depth_pruning}")
        check(self.depth_pruning_slide_every >= 1, "algorithm.depth_pruning_slide_every", "must be >= 1")
        check(0 < self.width_pruning_ratio <= 1, "algorithm.width_pruning_ratio", "must be in (0, 1]")
        check(self.pruning_iterations >= 0, "algorithm.pruning_iterations", "must be >= 0")
        super().validate(prefix)


def check_tree_config(cfg) -> TreeStructure:
    """Checks that need more than the algorithm section; raises :class:`ConfigError` naming the key."""
    algo, n = cfg.algorithm, cfg.sampling.num_steps
    bad = sorted(s for s in algo.split_steps if not 0 <= s < n)
    if bad:
        raise ConfigError(f"config key 'algorithm.split_steps' has {bad} outside the schedule: sampling.num_steps={n} "
                          f"has steps 0..{n - 1}")
    tree = TreeStructure(n, tuple(sorted(algo.split_steps)), algo.branch_factor)
    if tree.num_leaves != cfg.rollout.group_size:
        raise ConfigError(
            f"config key 'rollout.group_size' is {cfg.rollout.group_size}, but the tree (branch_factor {algo.branch_factor} at "
            f"{len(algo.split_steps)} split steps) has {tree.num_leaves} leaves; set rollout.group_size={tree.num_leaves} or "
            "change algorithm.split_steps / algorithm.branch_factor")
    bad = sorted(d for d in algo.depth_pruning if d > n)
    if bad:
        raise ConfigError(f"config key 'algorithm.depth_pruning' has depths {bad} beyond the tree's depth {n} (sampling.num_steps)")
    if algo.depth_pruning_stop_depth > n:
        raise ConfigError(f"config key 'algorithm.depth_pruning_stop_depth' is beyond the tree's depth {n}")
    return tree


class BranchGRPOTrainer(Trainer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: BranchGRPOConfig = cfg.algorithm
        self.tree = check_tree_config(cfg)  # bad input fails here: before any model, file or sample
        self.needs_reference = self.algo.beta > 0
        self._checked = False  # on-policy self-check done
        self._picture: Optional[dict] = None  # last iteration's first tree, for the report

    # ---- setup: checks that need the model, before the run directory changes -----------------
    def _setup_trainable(self) -> None:
        super()._setup_trainable()
        s = self.cfg.sampling
        self.schedule = self.adapter.make_schedule(s.num_steps, self.resolution, self.resolution)
        probe = build_kernel(self.adapter, s.kernel, s.noise_level, std_schedule=s.std_schedule, reduction=self.algo.logprob_reduction)
        self.step_has_density = self._steps_with_noise(probe)
        flat = [st for st in self.tree.split_steps if not self.step_has_density[st]]
        if flat:
            raise ConfigError(
                f"config key 'algorithm.split_steps' has {flat}: the {s.kernel} kernel (noise_level {s.noise_level}) adds no noise "
                "there (e.g. the last step to t=0 of cps/ddim), so the children of a split would be identical")
        self.nodes_per_forward = self._nodes_per_forward()

    def _steps_with_noise(self, kernel) -> torch.Tensor:
        """(N,) bool: the SDE transition of each step has std > 0 (std depends on t only)."""
        latent = self.adapter.latent_shape(self.resolution, self.resolution)
        z = torch.zeros((1, *latent), device=self.device)
        out = torch.zeros(self.cfg.sampling.num_steps, dtype=torch.bool)
        for i in range(len(out)):
            t = self.schedule[i].expand(1).to(self.device)
            t_next = self.schedule[i + 1].expand(1).to(self.device)
            step = kernel.step(z, z, t, t_next, sde=True, noise=z)
            out[i] = bool((step.std > 0).all())
        return out

    def _nodes_per_forward(self) -> int:
        """Nodes per rollout forward: ``rollout.sample_batch_size``, or what fits the memory budget."""
        budget = self.algo.forward_memory_mb
        if budget <= 0:
            return self.cfg.rollout.sample_batch_size
        s = self.cfg.sampling
        embeds = self.adapter.encode_prompts(self.train_prompts[:1], with_uncond=s.guidance_scale > 1)
        self.adapter.denoiser.eval()
        with self.autocast():
            mem = measure_forward_memory(self.adapter, embeds, float(self.schedule[0]), s.guidance_scale, self.resolution, self.resolution)
        n = mem.nodes_within(budget * MIB)
        if n < 1:
            raise ConfigError(
                f"config key 'algorithm.forward_memory_mb' is {budget:g} MiB, too small for one node: a rollout forward of one node "
                f"needs about {(mem.fixed_bytes + mem.per_node_bytes) / MIB:.3g} MiB ({mem.method}); raise it, or set it to 0 to "
                "chunk by rollout.sample_batch_size")
        self.log(f"  forward memory budget {budget:g} MiB -> {n} nodes per forward ({mem.per_node_bytes / MIB:.3g} MiB per node, "
                 f"{mem.method})")
        return n

    def print_header(self) -> None:
        super().print_header()
        self.log(f"  tree: {self.tree.describe()}; up to {self.nodes_per_forward} nodes per forward")

    # ---- rollout ----------------------------------------------------------------------------
    def sde_mask(self, iteration: int) -> torch.Tensor:
        """(N,) bool: stochastic steps this iteration (the Mix window, plus every split step)."""
        s = self.cfg.sampling
        mask = sde_window_mask(s.num_steps, s.window_size, mode=s.window_mode, start=s.window_start, iteration=iteration,
                               slide_every=s.window_slide_every, stride=s.window_stride, generator=self.generator)
        mask[list(self.tree.split_steps)] = True
        return mask

    def rollout(self, iteration: int):
        """Grow this process's trees and score their leaves.

        Returns (trajectory, embeds, prompts, first global tree index, global tree count,
        rewards (P_local, L), reward info)."""
        cfg, s, tree = self.cfg, self.cfg.sampling, self.tree
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_proc = cfg.rollout.prompts_per_iteration
        all_prompts = self.prompt_sampler.next(per_proc * world)  # identical on every process
        prompts = all_prompts[rank * per_proc : (rank + 1) * per_proc]
        n_global = len(all_prompts)
        local = slice(rank * per_proc, (rank + 1) * per_proc)
        sde_mask = self.sde_mask(iteration)
        latent = self.adapter.latent_shape(self.resolution, self.resolution)
        # All noise of the iteration, drawn globally from the shared generator, then sliced.
        if self.algo.shared_root_noise:
            root = torch.randn(latent, generator=self.generator).expand(n_global, *latent).clone()
        else:
            root = torch.randn((n_global, *latent), generator=self.generator)
        edge_noise = [torch.randn((n_global, tree.widths[i + 1], *latent), generator=self.generator)[local] if sde_mask[i] else None
                      for i in range(tree.num_steps)]
        embeds = self.adapter.encode_prompts(prompts, with_uncond=s.guidance_scale > 1)
        preview = [0] if (self.accelerator.is_main_process and self.algo.tree_picture and cfg.log.report) else []
        self.adapter.denoiser.eval()
        with self.autocast():
            traj = sample_tree(self.adapter, self.kernel, embeds, self.schedule, tree, sde_mask, guidance_scale=s.guidance_scale,
                               max_nodes_per_forward=self.nodes_per_forward, height=self.resolution, width=self.resolution,
                               root_noise=root[local], edge_noise=edge_noise, split_noise_scale=self.algo.split_noise_scale,
                               preview_trees=preview)
        images = traj.images.flatten(0, 1)  # (P * L, 3, H, W), tree-major
        leaf_prompts = [p for p in prompts for _ in range(tree.num_leaves)]
        bs = cfg.rollout.sample_batch_size
        trees = torch.arange(rank * per_proc, (rank + 1) * per_proc).repeat_interleave(tree.num_leaves)  # each leaf's global tree
        futures = [self.score_async(images[i : i + bs], leaf_prompts[i : i + bs], trees[i : i + bs], tree.num_leaves)
                   for i in range(0, len(images), bs)]
        self.guard_finals(images, leaf_prompts, iteration)  # train.guard's verifier: the leaves are the final images
        results = self.reward_results(futures)
        rewards = torch.cat([r for r, _ in results]).view(len(prompts), tree.num_leaves)
        info = self.gather_info(reward_info(results))  # per-batch means, then over processes
        return traj, embeds, prompts, rank * per_proc, n_global, rewards, info

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo, tree = self.algo, self.tree
        t0 = time.perf_counter()
        traj, embeds, prompts, first, n_global, rewards, info = self.rollout(iteration)
        rollout_seconds = time.perf_counter() - t0
        rewards = self.check_rewards(rewards.flatten(), iteration).view_as(rewards)
        all_rewards = self.accelerator.gather(rewards.to(self.device)).cpu().view(n_global, tree.num_leaves)
        all_logp = self.accelerator.gather(traj.log_probs.to(self.device)).cpu().view(n_global, tree.num_nodes)
        values = fuse_rewards(all_rewards, tree, mode=algo.reward_fusion, edge_log_probs=all_logp, temperature=algo.fusion_temperature)
        adv = depthwise_advantages(values, tree, unbiased=algo.advantage_unbiased_std, eps=algo.advantage_eps,
                                   clip=algo.advantage_clip)
        trainable = traj.sde_mask & self.step_has_density  # edges with a density
        prune = algo.pruning_iterations == 0 or iteration < algo.pruning_iterations
        stop = algo.depth_pruning_stop_depth if algo.depth_pruning_stop_depth >= 0 else (tree.last_split or 0)
        pruned_depths = active_pruned_depths(algo.depth_pruning, iteration, slide=algo.depth_pruning_slide,
                                             slide_every=algo.depth_pruning_slide_every, stop_depth=stop) if prune else []
        finite = torch.isfinite(values)
        unpruned = training_edges(tree, adv, trainable_steps=trainable, finite=finite)
        edges = training_edges(tree, adv, trainable_steps=trainable, finite=finite, pruned_depths=pruned_depths,
                               width_mode=algo.width_pruning if prune else "none", width_ratio=algo.width_pruning_ratio)
        flat = zero_std_trees(all_rewards)
        considered = unpruned  # the edges pruning chooses from
        if algo.filter_zero_std_groups:
            edges &= ~flat[:, None]
            considered = unpruned & ~flat[:, None]
        nfe = self._reduce_sum([traj.nfe, traj.forwards, traj.denoiser_rows])
        finite_r = all_rewards[torch.isfinite(all_rewards)]
        record = {
            "reward_mean": float(finite_r.mean()) if finite_r.numel() else float("nan"),
            "reward_std": float(finite_r.std(unbiased=False)) if finite_r.numel() > 1 else 0.0,
            "advantage_abs_mean": float(adv[edges].abs().mean()) if edges.any() else 0.0,
            "zero_std_frac": float(flat.float().mean()),
            "edges_trainable": int(unpruned.sum()),
            "edges_trained": int(edges.sum()),
            "pruned_frac": 1.0 - float(edges.sum()) / max(1, int(considered.sum())),  # share of edges cut by pruning
            "pruned_depths": pruned_depths,
            "sde_steps": int(traj.sde_mask.sum()),
            "nfe_rollout": int(nfe[0]),
            "nfe_per_image": float(nfe[0]) / (n_global * tree.num_leaves),
            "nfe_per_image_linear": self.cfg.sampling.num_steps,
            "rollout_forwards": int(nfe[1]),
            "denoiser_rows": int(nfe[2]),
            "rollout_seconds": rollout_seconds,
            **info,
        }
        if traj.previews is not None:
            self._capture_picture(iteration, prompts[0], traj, all_rewards[first], adv[first], edges[first])
        t1 = time.perf_counter()
        record.update(self.update(traj, embeds, first, n_global, adv, edges))
        record["train_seconds"] = time.perf_counter() - t1
        return record

    def _reduce_sum(self, values: list[int]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.accelerator.num_processes > 1:
            t = self.accelerator.reduce(t, reduction="sum")
        return t.cpu().tolist()

    # ---- policy update ----------------------------------------------------------------------
    def update(self, traj: TreeTrajectory, embeds, first: int, n_global: int, advantages: torch.Tensor, edges: torch.Tensor) -> dict:
        """Clipped policy-gradient updates on this process's training edges.

        ``advantages`` / ``edges`` are global (n_global, num_nodes); this process holds trees
        ``first .. first + len(traj) - 1``. Every edge is one term of the loss; the loss of an
        optimizer step is the sum of its terms over the global number of terms."""
        cfg, algo, tree = self.cfg, self.algo, self.tree
        g = cfg.sampling.guidance_scale
        dev = self.device
        n_local = len(traj)
        parent, depth = tree.parent, tree.depth
        all_edges = edges.nonzero()  # (E, 2): (global tree, node), same order on every process
        stats = {"loss": [], "policy_loss": [], "kl": [], "clip_frac": [], "approx_kl": [], "ratio_mean": [], "grad_norm": []}
        steps_applied, train_nfe = 0, 0
        emb_dev = next(iter(embeds.cond.values())).device
        guard = make_guard(self, algo, traj.timesteps, torch.unique(depth[all_edges[:, 1]] - 1),
                           reduction=algo.logprob_reduction)  # GRPO-Guard (None when off)
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            perm = torch.randperm(len(all_edges), generator=self.generator)  # global shuffle, then our share
            order = all_edges[perm]
            order = order[(order[:, 0] >= first) & (order[:, 0] < first + n_local)]
            batches = [order[s : s + cfg.train.batch_size] for s in range(0, len(order), cfg.train.batch_size)]
            for group in self.plan_optimizer_steps([len(batch) for batch in batches]):
                bad = False
                for m in group.micro:
                    batch = batches[m]
                    trees_g, nodes = batch[:, 0], batch[:, 1]
                    trees_l = trees_g - first
                    x = traj.latents[trees_l, parent[nodes]].to(dev)
                    x_next = traj.latents[trees_l, nodes].to(dev)
                    t = traj.timesteps[depth[nodes] - 1].to(dev)
                    t_next = traj.timesteps[depth[nodes]].to(dev)
                    emb = embeds.select(trees_l.to(emb_dev))
                    with self.autocast():
                        out = self.adapter.predict(x, t, emb, g)
                    train_nfe += len(batch)
                    step = self.kernel.step(out, x, t, t_next, sde=True, prev_sample=x_next)
                    old_logp = traj.log_probs[trees_l, nodes].to(dev)
                    if not self._checked:
                        steps_seen = sorted(set((depth[nodes] - 1).tolist()))
                        self.check_log_ratio(step.log_prob.detach(), old_logp, f"on tree edges at steps {steps_seen}", "tree sampler")
                    kl = None
                    if algo.beta > 0:
                        kl = reference_kl(self, x, t, emb, g, step, lambda ref_out: self.kernel.step(
                            ref_out, x, t, t_next, sde=True, prev_sample=x_next), step_times=(t, t_next))
                        train_nfe += len(batch)
                    logp, adv = step.log_prob, advantages[trees_g, nodes].to(dev)
                    if guard is not None:
                        logp, old_logp, adv = guard(step, old_logp, adv, depth[nodes] - 1)
                    if not accumulate_clipped(self, logp, old_logp, adv, kl, algo, group.global_terms, stats):
                        bad = True
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
                self._checked |= applied  # the policy has moved: later ratios need not be 1
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        out["nfe_train"] = int(self._reduce_sum([train_nfe])[0])
        if guard is not None:
            out.update(guard.metrics())
        return out

    # ---- the tree picture -------------------------------------------------------------------
    def _capture_picture(self, iteration, prompt, traj: TreeTrajectory, leaf_rewards, advantages, edges) -> None:
        self._picture = {"iteration": iteration, "prompt": prompt, "previews": traj.previews[0].cpu(),
                         "leaf_rewards": leaf_rewards.clone(), "advantages": advantages.clone(), "edges": edges.clone()}

    def after_training(self) -> None:
        if self._picture is not None and self.cfg.log.report and self.accelerator.is_main_process:
            self.write_tree_report()

    def write_tree_report(self) -> None:
        """Draw the captured tree into ``report/tree.png`` and append a section to ``report.md``."""
        pic, tree = self._picture, self.tree
        latents = pic["previews"].to(self.adapter.device)
        bs = self.nodes_per_forward
        images = torch.cat([self.adapter.decode(latents[s : s + bs]).float().cpu() for s in range(0, len(latents), bs)])
        path = self.run_dir / "report" / "tree.png"
        draw_tree(images, tree, pic["leaf_rewards"], path, trained=pic["edges"], advantages=pic["advantages"],
                  title=f"iteration {pic['iteration']}: \"{pic['prompt']}\" (x0 previews; solid = trained edges)")
        self.tracking.log_image("tree", path, pic["iteration"])
        r = pic["leaf_rewards"]
        lines = [
            "", "## BranchGRPO tree", "",
            f"One prompt's tree from iteration {pic['iteration']} (\"{pic['prompt']}\"): the x0 estimate at every node, "
            "rows by depth (root on top), each leaf's reward and depth-wise advantage under it; solid edges were training "
            "samples, dashed ones were not (ODE steps of Mix, pruned, or a tree with equal rewards).", "",
            f"{tree.describe()}.", "",
            f"Leaf rewards: mean {float(r[torch.isfinite(r)].mean()):.3f}, min {float(r.nan_to_num(float('inf')).min()):.3f}, "
            f"max {float(r.nan_to_num(float('-inf')).max()):.3f}; trained edges {int(pic['edges'].sum())} of {tree.num_nodes - 1}.", "",
            "![tree](report/tree.png)", "",
        ]
        report = self.run_dir / "report.md"
        text = report.read_text() if report.exists() else f"# diffalign run report: `{self.run_dir.name}`\n"
        runs.atomic_write_text(report, text.rstrip("\n") + "\n" + "\n".join(lines))


register_recipe("branch_grpo", BranchGRPOConfig, BranchGRPOTrainer)
