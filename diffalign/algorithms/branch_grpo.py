"""BranchGRPO: tree topology, reward fusion, depth-wise advantages and pruning of training edges.

Paper: Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
Models" (2025). Intuition: instead of G independent denoising chains per prompt, grow one tree
per prompt. All nodes share the root noise; at the *split steps* every node makes ``k`` children
with independent SDE noise, elsewhere one child. A tree with ``s`` split steps has ``k^s`` leaves
(final images) but shares the denoising prefixes, so it costs fewer model evaluations (NFE) per
image. Leaf rewards are fused up the tree into values of internal nodes; within each tree the
values of the nodes at one depth are z-scored into advantages, and every parent -> child edge is
a training sample (a Gaussian transition of the policy) with the child's advantage. Pruning
removes training edges (never rollout work): whole depths (depth pruning) or most of the
branches after the last split (width pruning).

Conventions (all functions are pure and work on plain tensors):

- A tree of ``N`` steps has depths ``0..N``; the node at depth ``d`` is the state after ``d``
  reverse steps (``x_{t_d}``); the edge into a node at depth ``d`` is step ``d - 1``.
- Nodes are numbered depth-major: depth 0 (the root) first, then depth 1, ...; within a depth,
  the children of node ``j`` at a split step are ``j * k + b`` for ``b < k``. So the leaves are
  the last ``k^s`` nodes, in the order the sampler decodes them.
- Per-node tensors are ``(P, num_nodes)`` for ``P`` trees (one per prompt); leaf tensors
  ``(P, num_leaves)``. An edge is identified by its child node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Optional, Sequence

import torch

FUSION_MODES = ("mean", "prob_weighted")
WIDTH_PRUNING_MODES = ("none", "top", "best_worst")


@dataclass(frozen=True)
class TreeStructure:
    """Topology of one rollout tree (the same for every prompt).

    ``num_steps``: N reverse steps; ``split_steps``: 0-based steps at which every node branches;
    ``branch_factor``: children per node at a split step (k).
    """

    num_steps: int
    split_steps: tuple[int, ...]
    branch_factor: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_steps", tuple(int(s) for s in self.split_steps))
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.branch_factor < 2:
            raise ValueError(f"branch_factor must be >= 2, got {self.branch_factor}")
        if len(set(self.split_steps)) != len(self.split_steps):
            raise ValueError(f"split_steps has duplicates: {list(self.split_steps)}")
        if list(self.split_steps) != sorted(self.split_steps):
            raise ValueError(f"split_steps must be increasing: {list(self.split_steps)}")
        bad = [s for s in self.split_steps if not 0 <= s < self.num_steps]
        if bad:
            raise ValueError(f"split_steps {bad} are outside the schedule's steps 0..{self.num_steps - 1}")

    # ---- sizes ------------------------------------------------------------------------------
    @cached_property
    def widths(self) -> tuple[int, ...]:
        """Nodes per depth, ``(N + 1,)``: ``widths[d + 1] = k * widths[d]`` if step ``d`` splits."""
        w = [1]
        splits = set(self.split_steps)
        for d in range(self.num_steps):
            w.append(w[-1] * (self.branch_factor if d in splits else 1))
        return tuple(w)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Index of the first node of each depth, ``(N + 2,)`` (the last entry is ``num_nodes``)."""
        out = [0]
        for w in self.widths:
            out.append(out[-1] + w)
        return tuple(out)

    @property
    def num_nodes(self) -> int:
        return self.offsets[-1]

    @property
    def num_leaves(self) -> int:
        return self.widths[-1]

    def depth_slice(self, depth: int) -> slice:
        return slice(self.offsets[depth], self.offsets[depth + 1])

    @property
    def leaf_slice(self) -> slice:
        return self.depth_slice(self.num_steps)

    @property
    def last_split(self) -> Optional[int]:
        return max(self.split_steps) if self.split_steps else None

    def is_split(self, step: int) -> bool:
        return step in self.split_steps

    # ---- per-node arrays --------------------------------------------------------------------
    @cached_property
    def depth(self) -> torch.Tensor:
        """(num_nodes,) long: depth of each node."""
        return torch.repeat_interleave(torch.arange(self.num_steps + 1), torch.tensor(self.widths))

    @cached_property
    def parent(self) -> torch.Tensor:
        """(num_nodes,) long: parent node of each node; -1 for the root."""
        out = torch.full((self.num_nodes,), -1, dtype=torch.long)
        for d in range(self.num_steps):
            k = self.widths[d + 1] // self.widths[d]
            local = torch.arange(self.widths[d + 1]) // k
            out[self.depth_slice(d + 1)] = self.offsets[d] + local
        return out

    @cached_property
    def edge_step(self) -> torch.Tensor:
        """(num_nodes,) long: the step of the edge into each node (``depth - 1``; -1 at the root)."""
        return self.depth - 1

    @cached_property
    def split_edge(self) -> torch.Tensor:
        """(num_nodes,) bool: the edge into the node is a split (branching) step."""
        splits = torch.tensor(self.split_steps, dtype=torch.long)
        return torch.isin(self.edge_step, splits) if len(splits) else torch.zeros(self.num_nodes, dtype=torch.bool)

    # ---- cost -------------------------------------------------------------------------------
    @property
    def nfe(self) -> int:
        """Model evaluations of one tree: each node at depths ``0..N-1`` is evaluated once
        (one CFG-guided prediction, cond and uncond in one batched forward, counts as one)."""
        return sum(self.widths[: self.num_steps])

    @property
    def nfe_per_leaf(self) -> float:
        """NFE per final image; a linear rollout costs ``num_steps``."""
        return self.nfe / self.num_leaves

    def describe(self) -> str:
        return (f"{self.num_steps} steps, split at {list(self.split_steps)} x{self.branch_factor} -> {self.num_leaves} leaves, "
                f"{self.num_nodes} nodes, NFE {self.nfe} per tree = {self.nfe_per_leaf:.2f} per image (linear: {self.num_steps})")


# --------------------------------------------------------------------------------------------
# Credit: reward fusion and depth-wise advantages
# --------------------------------------------------------------------------------------------


def fuse_rewards(
    leaf_rewards: torch.Tensor,
    tree: TreeStructure,
    *,
    mode: str = "mean",
    edge_log_probs: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Values of all nodes from the leaf rewards, bottom-up. Returns ``(P, num_nodes)`` fp32.

    ``mode="mean"`` (the reference code's default): a node's value is the mean reward of its
    leaf descendants. ``mode="prob_weighted"`` (the paper): a node's value is
    ``sum_c softmax_c(alpha * logp_c) * value_c`` over its children ``c``, where ``logp_c`` is the
    log-probability of the edge into ``c`` (``edge_log_probs``, ``(P, num_nodes)``) and ``alpha``
    the ``temperature``; a single child passes its value up unchanged.

    Non-finite leaf rewards (``reward.nonfinite=skip``) are left out of every average; a node
    without a finite leaf below it gets NaN.
    """
    if mode not in FUSION_MODES:
        raise ValueError(f"mode must be one of {FUSION_MODES}, got {mode!r}")
    if leaf_rewards.ndim != 2 or leaf_rewards.shape[1] != tree.num_leaves:
        raise ValueError(f"leaf_rewards must have shape (P, {tree.num_leaves}), got {tuple(leaf_rewards.shape)}")
    P = leaf_rewards.shape[0]
    r = leaf_rewards.float()
    values = torch.full((P, tree.num_nodes), float("nan"), dtype=torch.float32, device=r.device)
    values[:, tree.leaf_slice] = r
    if mode == "mean":
        finite = torch.isfinite(r)
        total = torch.where(finite, r, torch.zeros_like(r))  # per node: sum of finite leaf rewards below
        count = finite.float()  # ... and their number
        for d in range(tree.num_steps - 1, -1, -1):
            k = tree.widths[d + 1] // tree.widths[d]
            total = total.view(P, tree.widths[d], k).sum(-1)
            count = count.view(P, tree.widths[d], k).sum(-1)
            values[:, tree.depth_slice(d)] = torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))
        return values
    if edge_log_probs is None:
        raise ValueError("mode='prob_weighted' needs edge_log_probs (P, num_nodes)")
    logp = edge_log_probs.float().to(r.device)
    child = r
    for d in range(tree.num_steps - 1, -1, -1):
        k = tree.widths[d + 1] // tree.widths[d]
        v = child.view(P, tree.widths[d], k)
        if k == 1:
            parent_values = v[..., 0]
        else:
            finite = torch.isfinite(v)
            logits = (temperature * logp[:, tree.depth_slice(d + 1)]).view(P, tree.widths[d], k)
            logits = torch.where(finite, logits, torch.full_like(logits, float("-inf")))
            any_finite = finite.any(-1)
            weights = torch.softmax(torch.where(any_finite[..., None], logits, torch.zeros_like(logits)), dim=-1)
            weighted = (weights * torch.where(finite, v, torch.zeros_like(v))).sum(-1)
            parent_values = torch.where(any_finite, weighted, torch.full_like(weighted, float("nan")))
        values[:, tree.depth_slice(d)] = parent_values
        child = parent_values
    return values


def depthwise_advantages(
    values: torch.Tensor,
    tree: TreeStructure,
    *,
    unbiased: bool = True,
    eps: float = 1e-8,
    min_std: float = 1e-6,
    clip: float = 5.0,
) -> torch.Tensor:
    """Advantage of every node: the z-score of its value among the nodes of the same depth in the
    same tree, ``A = (v - mean_d) / (std_d + eps)``, clipped to ``+-clip``. ``(P, num_nodes)``.

    ``A = 0`` where a depth has a single (finite) node, where ``std_d < min_std`` (all values
    equal) and for non-finite values. ``unbiased``: Bessel-corrected std (``torch.std``, as the
    reference code computes it) or the population std.
    """
    v = values.float()
    adv = torch.zeros_like(v)
    for d in range(tree.num_steps + 1):
        x = v[:, tree.depth_slice(d)]
        finite = torch.isfinite(x)
        n = finite.sum(-1, keepdim=True).float()
        x0 = torch.where(finite, x, torch.zeros_like(x))
        mean = x0.sum(-1, keepdim=True) / n.clamp_min(1)
        sq = torch.where(finite, (x - mean) ** 2, torch.zeros_like(x)).sum(-1, keepdim=True)
        denom = (n - 1).clamp_min(1) if unbiased else n.clamp_min(1)
        std = torch.sqrt(sq / denom)
        ok = (n > 1) & (std >= min_std)
        z = (x - mean) / (std + eps)
        adv[:, tree.depth_slice(d)] = torch.where(ok & finite, z, torch.zeros_like(z))
    return adv.clamp(-clip, clip)


def zero_std_trees(leaf_rewards: torch.Tensor, *, tol: float = 1e-6) -> torch.Tensor:
    """(P,) bool: trees whose finite leaf rewards are all equal (every advantage is 0)."""
    r = leaf_rewards.float()
    finite = torch.isfinite(r)
    hi = torch.where(finite, r, torch.full_like(r, float("-inf"))).max(-1).values
    lo = torch.where(finite, r, torch.full_like(r, float("inf"))).min(-1).values
    return ~(finite.sum(-1) > 1) | ((hi - lo) <= tol)


# --------------------------------------------------------------------------------------------
# Pruning of training edges (the rollout is unchanged)
# --------------------------------------------------------------------------------------------


def active_pruned_depths(
    depths: Sequence[int],
    iteration: int,
    *,
    slide: bool = False,
    slide_every: int = 1,
    stop_depth: int = 0,
) -> list[int]:
    """Child depths whose edges are pruned at ``iteration``.

    Without sliding: ``depths``. With sliding (the reference's ``depth_pruning_slide``): the
    window moves one depth towards the root every ``slide_every`` iterations,
    ``shift = iteration // slide_every``, until its shallowest depth reaches ``stop_depth``
    (by default the last split step, so the split edges are never pruned).
    """
    base = sorted(int(d) for d in depths)
    if not base or not slide:
        return base
    shift = min(iteration // max(1, slide_every), max(0, base[0] - stop_depth))
    return [d - shift for d in base]


def width_pruning_mask(
    advantages: torch.Tensor,
    tree: TreeStructure,
    *,
    mode: str = "none",
    ratio: float = 0.5,
) -> torch.Tensor:
    """(P, num_nodes) bool: edges kept by width pruning.

    Only edges *after the last split* (parent depth > last split step) are pruned; there every
    branch (a child of the last split and its chain down to a leaf) carries one value, so the
    unit ranked is the branch, by the advantage of its first node, within each tree:

    - ``"top"``: keep the best ``max(1, int(ratio * branches))`` branches;
    - ``"best_worst"``: keep ``max(2, int(ratio * branches))`` branches, half of them the best
      and the rest the worst (the reference code's mode 2).

    Ties are broken by node order. ``"none"`` keeps everything.
    """
    if mode not in WIDTH_PRUNING_MODES:
        raise ValueError(f"mode must be one of {WIDTH_PRUNING_MODES}, got {mode!r}")
    P = advantages.shape[0]
    keep = torch.ones(P, tree.num_nodes, dtype=torch.bool, device=advantages.device)
    last = tree.last_split
    if mode == "none" or last is None or last + 2 > tree.num_steps:
        return keep  # no edges after the last split
    n_branch = tree.widths[last + 1]
    a = advantages[:, tree.depth_slice(last + 1)].float()  # (P, n_branch) branch advantages
    order = torch.argsort(-a, dim=-1, stable=True)  # best first
    if mode == "top":
        n_keep = max(1, int(ratio * n_branch + 1e-9))
        chosen = order[:, :n_keep]
    else:
        n_keep = min(n_branch, max(2, int(ratio * n_branch + 1e-9)))
        best = n_keep // 2
        chosen = torch.cat([order[:, :best], order[:, n_branch - (n_keep - best):]], dim=-1)
    branch_kept = torch.zeros(P, n_branch, dtype=torch.bool, device=advantages.device)
    branch_kept.scatter_(1, chosen, True)
    for d in range(last + 2, tree.num_steps + 1):  # width is n_branch below the last split: node j is branch j
        keep[:, tree.depth_slice(d)] = branch_kept
    return keep


def training_edges(
    tree: TreeStructure,
    advantages: torch.Tensor,
    *,
    trainable_steps: torch.Tensor,
    finite: Optional[torch.Tensor] = None,
    pruned_depths: Iterable[int] = (),
    width_mode: str = "none",
    width_ratio: float = 0.5,
) -> torch.Tensor:
    """(P, num_nodes) bool: the edges (by child node) that become training samples.

    An edge is trained when its step is stochastic with a density (``trainable_steps`` (N,):
    SDE with std > 0 — ODE edges of BranchGRPO-Mix have no log-probability), its child's value is
    finite (``finite`` (P, num_nodes)), its child's depth is not pruned, and width pruning keeps it.
    The root has no incoming edge.
    """
    P = advantages.shape[0]
    steps = tree.edge_step
    mask = torch.zeros(P, tree.num_nodes, dtype=torch.bool, device=advantages.device)
    step_ok = torch.zeros(tree.num_nodes, dtype=torch.bool)
    step_ok[1:] = trainable_steps.to(torch.bool).cpu()[steps[1:]]
    pruned = torch.isin(tree.depth, torch.tensor(sorted(set(int(d) for d in pruned_depths)), dtype=torch.long))
    mask[:] = (step_ok & ~pruned).to(mask.device)
    if finite is not None:
        mask &= finite.to(mask.device)
    return mask & width_pruning_mask(advantages, tree, mode=width_mode, ratio=width_ratio)
