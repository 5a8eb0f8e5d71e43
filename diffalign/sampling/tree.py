"""Tree rollouts (BranchGRPO): shared denoising prefixes, batched by depth, with exact NFE counts.

The sampler axis, like :func:`diffalign.sampling.sample_linear`: it only calls
``adapter.predict`` (CFG in one batched forward) and a :class:`~diffalign.sampling.Kernel`.
Topology (which node is whose child) lives in
:class:`~diffalign.algorithms.branch_grpo.TreeStructure`.

At every step all nodes of the current depth, across all trees (prompts), go through the model
together, in chunks of at most ``max_nodes_per_forward`` nodes (each node is 2 rows of the
denoiser batch with CFG). A node at a split step gets ``k`` children from the same model output
with independent noise; elsewhere one child (SDE or, outside a Mix window, ODE).

Also here: the memory probe that turns a budget in MiB into ``max_nodes_per_forward``, and the
picture of one tree for the run report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.algorithms.branch_grpo import TreeStructure
from diffalign.sampling.linear import Kernel


@dataclass
class TreeTrajectory:
    """``P`` rollout trees of one :class:`TreeStructure` (one tree per prompt).

    ``latents``: (P, num_nodes, *latent) fp32 — every node's state, depth-major (see
    :mod:`diffalign.algorithms.branch_grpo`); the leaves are the last ``num_leaves`` nodes.
    ``log_probs``: (P, num_nodes) fp32 — ``log p(node | parent)`` under the sampling policy;
    0 at the root, on ODE edges and on zero-std steps.
    ``timesteps``: (N + 1,) — the schedule; the edge into a node at depth d goes t_{d-1} -> t_d.
    ``sde_mask``: (N,) bool — stochastic steps of this rollout (split steps always are).
    ``images``: (P, num_leaves, 3, H, W) fp32 in [0, 1] — the decoded leaves (None if not decoded).
    ``previews``: (len(preview_trees), num_nodes, *latent) — x0 estimates at every node of the
    requested trees (Tweedie from the node's own forward; the leaves' own states), or None.
    ``nfe``: node evaluations (one CFG-guided prediction each); ``forwards``: batched
    ``adapter.predict`` calls; ``denoiser_rows``: rows through the denoiser (2 x nfe with CFG).
    """

    tree: TreeStructure
    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sde_mask: torch.Tensor
    images: Optional[torch.Tensor] = None
    previews: Optional[torch.Tensor] = None
    nfe: int = 0
    forwards: int = 0
    denoiser_rows: int = 0
    forward_sizes: list[int] = field(default_factory=list)  # nodes per batched forward, in order

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def leaves(self) -> torch.Tensor:
        """(P, num_leaves, *latent) final states."""
        return self.latents[:, self.tree.leaf_slice]


def uses_cfg(embeds: PromptEmbeds, guidance_scale: float) -> bool:
    """Whether ``adapter.predict`` runs the uncond rows too (see ``guided_forward``)."""
    return guidance_scale > 1.0 and embeds.uncond is not None


def expected_forwards(tree: TreeStructure, num_trees: int, max_nodes_per_forward: int) -> int:
    """Batched forwards of :func:`sample_tree`: ``sum_d ceil(P * width_d / chunk)`` over depths 0..N-1."""
    return sum(math.ceil(num_trees * w / max_nodes_per_forward) for w in tree.widths[: tree.num_steps])


@torch.no_grad()
def sample_tree(
    adapter: ModelAdapter,
    kernel: Kernel,
    embeds: PromptEmbeds,
    schedule: torch.Tensor,
    tree: TreeStructure,
    sde_mask: torch.Tensor,
    *,
    guidance_scale: float,
    max_nodes_per_forward: int,
    height: int,
    width: int,
    root_noise: Optional[torch.Tensor] = None,
    edge_noise: Optional[Sequence[Optional[torch.Tensor]]] = None,
    generator: Optional[torch.Generator] = None,
    split_noise_scale: float = 1.0,
    preview_trees: Sequence[int] = (),
    decode: bool = True,
) -> TreeTrajectory:
    """Grow one tree per prompt of ``embeds`` along ``schedule``.

    Noise: ``root_noise`` (P, *latent) and ``edge_noise[i]`` (P, width_{i+1}, *latent) for every
    stochastic step ``i`` (None elsewhere) — then results do not depend on chunking or on how
    trees are split across processes — else drawn from ``generator``. Split edges use
    ``split_noise_scale * eps`` as their noise; their log-probability is the density under the
    kernel itself (the reference code's rule: with a scale other than 1 the split children are
    wider than the policy's samples, but re-scoring reproduces the stored log-probs exactly).
    """
    N = tree.num_steps
    if len(schedule) != N + 1:
        raise ValueError(f"schedule has {len(schedule) - 1} steps, the tree {N}")
    if sde_mask.shape != (N,):
        raise ValueError(f"sde_mask must have shape ({N},), got {tuple(sde_mask.shape)}")
    not_sde = [s for s in tree.split_steps if not bool(sde_mask[s])]
    if not_sde:
        raise ValueError(f"split steps {not_sde} must be stochastic (sde_mask)")
    if max_nodes_per_forward < 1:
        raise ValueError(f"max_nodes_per_forward must be >= 1, got {max_nodes_per_forward}")
    dev = adapter.device
    P = len(embeds)
    latent = tuple(adapter.latent_shape(height, width))
    if root_noise is None:
        gdev = generator.device if generator is not None else torch.device("cpu")
        root_noise = torch.randn((P, *latent), generator=generator, device=gdev)
    if tuple(root_noise.shape) != (P, *latent):
        raise ValueError(f"root_noise must have shape {(P, *latent)}, got {tuple(root_noise.shape)}")
    latents = torch.empty((P, tree.num_nodes, *latent), dtype=torch.float32, device=dev)
    latents[:, 0] = root_noise.to(dev, torch.float32)
    log_probs = torch.zeros((P, tree.num_nodes), dtype=torch.float32, device=dev)
    previews = None
    preview_trees = list(preview_trees)
    if preview_trees:
        previews = torch.empty((len(preview_trees), tree.num_nodes, *latent), dtype=torch.float32, device=dev)
    cfg_rows = 2 if uses_cfg(embeds, guidance_scale) else 1
    emb_device = next(iter(embeds.cond.values())).device
    out = TreeTrajectory(tree, latents, log_probs, schedule.clone(), sde_mask.clone().to(torch.bool))
    C = max_nodes_per_forward
    for i in range(N):
        w, w_next = tree.widths[i], tree.widths[i + 1]
        k = w_next // w
        sde = bool(sde_mask[i])
        split = tree.is_split(i)
        x_all = latents[:, tree.depth_slice(i)].reshape(P * w, *latent)
        prompt_of_row = torch.arange(P).repeat_interleave(w)  # node rows -> their tree / prompt
        if sde and edge_noise is not None:
            eps_all = edge_noise[i]
            if eps_all is None or tuple(eps_all.shape) != (P, w_next, *latent):
                raise ValueError(f"edge_noise[{i}] must have shape {(P, w_next, *latent)}")
            eps_all = eps_all.reshape(P * w, k, *latent)
        elif sde:
            gdev = generator.device if generator is not None else torch.device("cpu")
            eps_all = torch.randn((P * w, k, *latent), generator=generator, device=gdev)
        else:
            eps_all = None
        children = torch.empty((P * w, k, *latent), dtype=torch.float32, device=dev)
        child_lp = torch.zeros((P * w, k), dtype=torch.float32, device=dev)
        for start in range(0, P * w, C):
            rows = slice(start, min(start + C, P * w))
            n = rows.stop - rows.start
            x = x_all[rows]
            t = schedule[i].expand(n).to(dev)
            t_next = schedule[i + 1].expand(n).to(dev)
            emb = embeds.select(prompt_of_row[rows].to(emb_device))
            model_output = adapter.predict(x, t, emb, guidance_scale)
            out.forwards += 1
            out.nfe += n
            out.denoiser_rows += cfg_rows * n
            out.forward_sizes.append(n)
            if previews is not None:
                _store_previews(previews, preview_trees, adapter, model_output, x, t, prompt_of_row[rows], start, w, tree.offsets[i])
            for b in range(k):
                noise = None
                if eps_all is not None:
                    noise = eps_all[rows, b].to(dev, torch.float32)
                    if split:
                        noise = noise * split_noise_scale
                step = kernel.step(model_output, x, t, t_next, sde=sde, noise=noise)
                children[rows, b] = step.prev_sample.float()
                if step.log_prob is not None:
                    child_lp[rows, b] = step.log_prob.float()
        # node j's children are j * k + b: the (P * w, k) layout flattens to exactly that order
        latents[:, tree.depth_slice(i + 1)] = children.reshape(P, w_next, *latent)
        log_probs[:, tree.depth_slice(i + 1)] = child_lp.reshape(P, w_next)
    if previews is not None:
        previews[:, tree.leaf_slice] = latents[preview_trees][:, tree.leaf_slice]
    out.previews = previews
    if decode:
        leaves = out.leaves.reshape(P * tree.num_leaves, *latent)
        images = [adapter.decode(leaves[s : s + C]).float().clamp(0, 1) for s in range(0, len(leaves), C)]
        images = torch.cat(images)
        out.images = images.reshape(P, tree.num_leaves, *images.shape[1:])
    return out


def _store_previews(previews, preview_trees, adapter, model_output, x, t, prompts_of_rows, start, width, offset) -> None:
    """x0 estimates of the chunk's nodes that belong to the preview trees."""
    for slot, tree_idx in enumerate(preview_trees):
        sel = (prompts_of_rows == tree_idx).nonzero().flatten()
        if len(sel) == 0:
            continue
        x0 = adapter.to_x0(model_output[sel], x[sel], t[sel]).float()
        local = start + sel - tree_idx * width  # node index within this depth
        previews[slot, offset + local] = x0


# --------------------------------------------------------------------------------------------
# Memory budget -> nodes per forward
# --------------------------------------------------------------------------------------------


@dataclass
class ForwardMemory:
    """Estimated working memory of one rollout forward: ``fixed + nodes * per_node`` bytes."""

    fixed_bytes: float
    per_node_bytes: float
    method: str  # "cuda-allocator" (peak allocated) or "module-outputs" (sum of module outputs)

    def nodes_within(self, budget_bytes: float) -> int:
        return int((budget_bytes - self.fixed_bytes) // self.per_node_bytes) if self.per_node_bytes > 0 else 1 << 30


@torch.no_grad()
def measure_forward_memory(adapter: ModelAdapter, embeds: PromptEmbeds, t: float, guidance_scale: float,
                           height: int, width: int) -> ForwardMemory:
    """Measure a rollout forward of 1 and of 2 nodes (``embeds``: one prompt) and fit
    ``fixed + n * per_node``.

    On CUDA: the allocator's peak above the memory in use before the forward. Elsewhere (no
    allocator statistics): the bytes of every module output during the forward, summed — an
    upper bound of a no-grad forward's working set (most of those tensors are freed on the way),
    so the chunks it allows are conservative.
    """
    latent = tuple(adapter.latent_shape(height, width))
    dev = adapter.device
    denoiser = adapter.denoiser

    def run(n: int) -> float:
        x = torch.zeros((n, *latent), device=dev)
        tt = torch.full((n,), float(t), device=dev)
        emb = embeds.select(torch.zeros(n, dtype=torch.long, device=next(iter(embeds.cond.values())).device))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            adapter.predict(x, tt, emb, guidance_scale)
            torch.cuda.synchronize(dev)
            return float(torch.cuda.max_memory_allocated(dev) - base)
        total = [0.0]

        def hook(_module, _inputs, output):
            for o in output if isinstance(output, (tuple, list)) else [getattr(output, "sample", output)]:
                if torch.is_tensor(o):
                    total[0] += o.numel() * o.element_size()

        handles = [m.register_forward_hook(hook) for m in denoiser.modules()]
        try:
            adapter.predict(x, tt, emb, guidance_scale)
        finally:
            for h in handles:
                h.remove()
        return total[0]

    one, two = run(1), run(2)
    per_node = max(two - one, 1.0)
    return ForwardMemory(fixed_bytes=max(one - per_node, 0.0), per_node_bytes=per_node,
                         method="cuda-allocator" if dev.type == "cuda" else "module-outputs")


# --------------------------------------------------------------------------------------------
# The picture of one tree
# --------------------------------------------------------------------------------------------


def draw_tree(
    images: torch.Tensor,
    tree: TreeStructure,
    leaf_rewards: torch.Tensor,
    path: str | Path,
    *,
    title: str = "",
    trained: Optional[torch.Tensor] = None,
    advantages: Optional[torch.Tensor] = None,
) -> Path:
    """Save a picture of one tree: the x0 preview of every node (``images`` (num_nodes, 3, H, W)
    in [0, 1]) placed by depth (rows, root on top) above its leaves, parent -> child edges (solid
    where ``trained`` (num_nodes,) marks a training edge, dashed otherwise), and each leaf's reward
    (and advantage) under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, N = tree.num_leaves, tree.num_steps
    # x of a node = mean x of its leaf descendants (leaves at 0..L-1)
    xs = torch.zeros(tree.num_nodes)
    xs[tree.leaf_slice] = torch.arange(L, dtype=torch.float32)
    for d in range(N - 1, -1, -1):
        k = tree.widths[d + 1] // tree.widths[d]
        xs[tree.depth_slice(d)] = xs[tree.depth_slice(d + 1)].view(-1, k).mean(-1)
    ys = -tree.depth.float()
    size = 0.42  # half the side of a thumbnail, in leaf spacings
    fig_w = max(4.0, 0.95 * L + 1.0)
    fig_h = max(3.0, 0.95 * (N + 1) + 1.2)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    parent = tree.parent
    for c in range(1, tree.num_nodes):
        p = int(parent[c])
        solid = trained is None or bool(trained[c])
        ax.plot([xs[p], xs[c]], [ys[p], ys[c]], color="C0" if solid else "0.6", lw=1.2 if solid else 0.8,
                ls="-" if solid else "--", zorder=1)
    arr = images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    for n in range(tree.num_nodes):
        ax.imshow(arr[n], extent=(xs[n] - size, xs[n] + size, ys[n] - size, ys[n] + size), zorder=2, interpolation="nearest")
    leaves = range(tree.offsets[N], tree.num_nodes)
    for j, n in enumerate(leaves):
        label = f"{float(leaf_rewards[j]):.2f}"
        if advantages is not None:
            label += f"\nA {float(advantages[n]):+.2f}"
        ax.text(xs[n], ys[n] - size - 0.08, label, ha="center", va="top", fontsize=7)
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_ylim(-N - 1.3, 0.6)
    ax.set_yticks([-d for d in range(N + 1)])
    ax.set_yticklabels([f"depth {d}" + (" (split)" if d - 1 in tree.split_steps else "") for d in range(N + 1)], fontsize=7)
    ax.set_xticks([])
    for s in ("top", "right", "bottom"):
        ax.spines[s].set_visible(False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path
