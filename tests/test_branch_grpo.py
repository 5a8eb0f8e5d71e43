"""BranchGRPO: tree topology, fusion, depth-wise advantages and pruning on hand-computed trees;
the tree sampler (exact NFE, shared prefixes = linear rollouts, on-policy ratio 1 on every edge);
the recipe end to end (metrics, report picture, Mix, pruning) and its bad-input errors."""

import math

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.algorithms.branch_grpo import (
    TreeStructure,
    active_pruned_depths,
    depthwise_advantages,
    fuse_rewards,
    training_edges,
    width_pruning_mask,
    zero_std_trees,
)
from diffalign.sampling import build_kernel, sample_linear
from diffalign.sampling.tree import expected_forwards, sample_tree
from tests.helpers.adapters import sd3  # noqa: F401 (fixture)
from tests.helpers.tiny_run import FAST, run_cli, train_records

SD3 = "configs/tiny/branch_grpo_sd3.yaml"
FLUX = "configs/tiny/branch_grpo_flux.yaml"
PX = 32

# The hand tree: 4 steps, splits at steps 0 and 2, k = 2.
#   depth 0: node 0 (root)
#   depth 1: 1 2          (split at step 0)
#   depth 2: 3 4
#   depth 3: 5 6 7 8      (split at step 2)
#   depth 4: 9 10 11 12   (leaves)
HAND = TreeStructure(4, (0, 2), 2)


# ---------------------------------------------------------------------------------- topology


def test_tree_structure_by_hand():
    assert HAND.widths == (1, 2, 2, 4, 4)
    assert HAND.offsets == (0, 1, 3, 5, 9, 13)
    assert HAND.num_nodes == 13 and HAND.num_leaves == 4
    assert HAND.parent.tolist() == [-1, 0, 0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8]
    assert HAND.depth.tolist() == [0, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert HAND.split_edge.tolist() == [False, True, True, False, False, True, True, True, True, False, False, False, False]
    assert HAND.nfe == 1 + 2 + 2 + 4 and HAND.nfe_per_leaf == 9 / 4
    # the paper's default: 20 steps, splits 0, 3, 6, 9 -> 16 leaves
    paper = TreeStructure(20, (0, 3, 6, 9), 2)
    assert paper.num_leaves == 16 and paper.nfe == 1 + 3 * 2 + 3 * 4 + 3 * 8 + 10 * 16
    for bad in [dict(split_steps=(4,)), dict(split_steps=(2, 0)), dict(split_steps=(1, 1)), dict(branch_factor=1)]:
        with pytest.raises(ValueError):
            TreeStructure(**{"num_steps": 4, "split_steps": (0,), "branch_factor": 2, **bad})


# ---------------------------------------------------------------------------------- credit


def test_mean_fusion_and_depthwise_advantages_by_hand():
    r = torch.tensor([[1.0, 3.0, 2.0, 6.0]])
    v = fuse_rewards(r, HAND, mode="mean")
    assert v[0].tolist() == [3, 2, 4, 2, 4, 1, 3, 2, 6, 1, 3, 2, 6]
    a = depthwise_advantages(v, HAND, unbiased=True, eps=0.0)
    s2, s14 = 1 / math.sqrt(2), math.sqrt(14 / 3)  # stds of {2, 4} and {1, 3, 2, 6} (Bessel)
    leaf = [(-2) / s14, 0.0, (-1) / s14, 3 / s14]
    expected = [0.0, -s2, s2, -s2, s2, *leaf, *leaf]
    torch.testing.assert_close(a[0], torch.tensor(expected))
    b = depthwise_advantages(v, HAND, unbiased=False, eps=0.0)
    s = math.sqrt(14 / 4)
    torch.testing.assert_close(b[0, 1:3], torch.tensor([-1.0, 1.0]))
    torch.testing.assert_close(b[0, 9:], torch.tensor([-2 / s, 0.0, -1 / s, 3 / s]))
    # clip, equal rewards (std < 1e-6) and a single node per depth give 0 / the clip bound
    c = depthwise_advantages(v, HAND, unbiased=False, eps=0.0, clip=1.2)
    assert c.max() == 1.2 and c.min() >= -1.2
    flat = fuse_rewards(torch.full((1, 4), 0.7), HAND)
    assert depthwise_advantages(flat, HAND).abs().max() == 0
    assert zero_std_trees(torch.tensor([[0.7, 0.7, 0.7, 0.7], [1.0, 3.0, 2.0, 6.0]])).tolist() == [True, False]


def test_fusion_skips_nonfinite_leaves():
    r = torch.tensor([[1.0, float("nan"), 2.0, 6.0]])
    v = fuse_rewards(r, HAND)
    assert v[0, 0] == 3.0 and v[0, 3] == 1.0 and v[0, 4] == 4.0  # root = mean(1, 2, 6); node 3 has one finite leaf
    assert math.isnan(v[0, 6]) and math.isnan(v[0, 10])
    a = depthwise_advantages(v, HAND, eps=0.0)
    s = math.sqrt(14 / 2)  # {1, 2, 6}: mean 3, Bessel std sqrt(7)
    torch.testing.assert_close(a[0, 9:], torch.tensor([-2 / s, 0.0, -1 / s, 3 / s]))
    all_nan = fuse_rewards(torch.full((1, 4), float("nan")), HAND)
    assert torch.isnan(all_nan).all()


def test_prob_weighted_fusion_by_hand():
    r = torch.tensor([[1.0, 3.0, 2.0, 6.0]])
    logp = torch.randn(1, 13) * 3  # edges into single children must not matter
    logp[0, 1], logp[0, 2] = 0.0, math.log(3.0)  # root's children: weights 1/4, 3/4
    logp[0, 5], logp[0, 6] = 0.5, 0.5  # node 3's children: 1/2, 1/2
    logp[0, 7], logp[0, 8] = 0.0, math.log(3.0)  # node 4's children: 1/4, 3/4
    v = fuse_rewards(r, HAND, mode="prob_weighted", edge_log_probs=logp)
    torch.testing.assert_close(v[0], torch.tensor([0.25 * 2 + 0.75 * 5, 2, 5, 2, 5, 1, 3, 2, 6, 1, 3, 2, 6]))
    hot = fuse_rewards(r, HAND, mode="prob_weighted", edge_log_probs=logp, temperature=2.0)  # softmax(2 * [0, ln 3]) = [.1, .9]
    torch.testing.assert_close(hot[0, [0, 4]], torch.tensor([0.1 * 2 + 0.9 * 5.6, 5.6]))
    with pytest.raises(ValueError):
        fuse_rewards(r, HAND, mode="prob_weighted")


# ---------------------------------------------------------------------------------- pruning


def test_depth_pruning_window_slides_to_the_last_split():
    assert active_pruned_depths([8, 7], 5) == [7, 8]
    got = [active_pruned_depths([7, 8, 9, 10], it, slide=True, slide_every=2, stop_depth=4) for it in (0, 1, 2, 6, 10)]
    assert got == [[7, 8, 9, 10], [7, 8, 9, 10], [6, 7, 8, 9], [4, 5, 6, 7], [4, 5, 6, 7]]


def test_width_pruning_and_training_edges_by_hand():
    tree = TreeStructure(5, (0, 1), 2)  # widths 1 2 4 4 4 4; branches = the 4 nodes of depth 2 (3..6)
    adv = torch.zeros(1, tree.num_nodes)
    adv[0, 3:7] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    after = [tree.depth_slice(d) for d in (3, 4, 5)]  # edges after the last split
    top = width_pruning_mask(adv, tree, mode="top", ratio=0.5)
    bw = width_pruning_mask(adv, tree, mode="best_worst", ratio=0.5)
    for sl in after:
        assert top[0, sl].tolist() == [True, False, True, False]  # branches 2 (A 2.0) and 0 (A 0.5)
        assert bw[0, sl].tolist() == [False, True, True, False]  # best 2, worst 1
    assert top[0, :7].all() and bw[0, :7].all()  # up to and including the split edges: untouched
    assert width_pruning_mask(adv, tree, mode="none").all()
    # trainable steps (Mix: step 1 is ODE) x depth pruning x width pruning
    mask = training_edges(tree, adv, trainable_steps=torch.tensor([True, False, True, True, True]), pruned_depths=[5],
                          width_mode="top", width_ratio=0.5)
    per_depth = [int(mask[0, tree.depth_slice(d)].sum()) for d in range(6)]
    assert per_depth == [0, 2, 0, 2, 2, 0]


# ---------------------------------------------------------------------------------- the sampler


def _noise(adapter, tree, P, sde_mask, seed):
    g = torch.Generator().manual_seed(seed)
    latent = adapter.latent_shape(PX, PX)
    root = torch.randn((P, *latent), generator=g)
    edges = [torch.randn((P, tree.widths[i + 1], *latent), generator=g) if sde_mask[i] else None for i in range(tree.num_steps)]
    return root, edges


def test_tree_sampler_counts_nfe_and_batches_depths(sd3):
    k = build_kernel(sd3, "flow_grpo", 0.7)
    P, chunk = 3, 4
    embeds = sd3.encode_prompts(["a red cat", "a dog", "a car"], with_uncond=True)
    rows = []
    handle = sd3.denoiser.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]),
                                                    with_kwargs=True)
    try:
        traj = sample_tree(sd3, k, embeds, sd3.make_schedule(4, PX, PX), HAND, torch.ones(4, dtype=torch.bool), guidance_scale=4.0,
                           max_nodes_per_forward=chunk, height=PX, width=PX, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    # depths 0..3 hold 3, 6, 6, 12 nodes -> forwards of at most 4 nodes: 1 + 2 + 2 + 3
    assert traj.forward_sizes == [3, 4, 2, 4, 2, 4, 4, 4]
    assert traj.forwards == expected_forwards(HAND, P, chunk) == 8 == len(rows)
    assert traj.nfe == P * HAND.nfe == 27
    assert traj.denoiser_rows == sum(rows) == 2 * 27  # CFG: cond and uncond rows in the same forward
    assert rows == [2 * n for n in traj.forward_sizes]
    assert traj.images.shape == (P, 4, 3, PX, PX) and traj.log_probs[:, 0].eq(0).all()


def test_tree_is_linear_rollouts_sharing_prefixes_and_chunking_does_not_matter(sd3):
    k = build_kernel(sd3, "flow_grpo", 0.7)
    P, g = 2, 4.0
    sched = sd3.make_schedule(4, PX, PX)
    mask = torch.ones(4, dtype=torch.bool)
    embeds = sd3.encode_prompts(["a red cat", "a dog"], with_uncond=True)
    root, edges = _noise(sd3, HAND, P, mask, seed=3)
    a = sample_tree(sd3, k, embeds, sched, HAND, mask, guidance_scale=g, max_nodes_per_forward=1, height=PX, width=PX,
                    root_noise=root, edge_noise=edges, preview_trees=[1])
    b = sample_tree(sd3, k, embeds, sched, HAND, mask, guidance_scale=g, max_nodes_per_forward=64, height=PX, width=PX,
                    root_noise=root, edge_noise=edges)
    torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-5)
    # every root-to-leaf path is the linear rollout with that path's noise
    for p in range(P):
        for leaf in range(HAND.num_leaves):
            node, path = HAND.offsets[4] + leaf, []
            while node > 0:
                path.append(node)
                node = int(HAND.parent[node])
            path = path[::-1]  # nodes at depths 1..4
            step_noise = torch.stack([edges[i][p, path[i] - HAND.offsets[i + 1]] for i in range(4)])[None]
            lin = sample_linear(sd3, k, embeds.select([p]), sched, mask, guidance_scale=g, height=PX, width=PX,
                                noise=root[p : p + 1], step_noise=step_noise)
            torch.testing.assert_close(lin.latents[0, 1:], b.latents[p, path], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lin.log_probs[0], b.log_probs[p, path], rtol=1e-5, atol=1e-5)
    # previews: the leaves' own states; the root's x0 estimate from its forward
    assert torch.equal(a.previews[0, 9:], a.latents[1, 9:])
    with torch.no_grad():
        t0 = sched[0].expand(1)
        x0 = sd3.to_x0(sd3.predict(root[1:2], t0, embeds.select([1]), g), root[1:2], t0)
    torch.testing.assert_close(a.previews[0, 0], x0[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, kernel, noise, mask", [
    ("sd3", "flow_grpo", 0.7, [True, True, True, True]),
    ("sd3", "flow_grpo", 0.7, [True, False, True, False]),  # Mix: ODE outside the splits
    ("sd3", "dance", 0.3, [True, True, True, True]),
    ("sd15", "ddim", 1.0, [True, True, True, True]),  # the last DDIM step has std 0: no density, not trained
])
def test_on_policy_ratio_is_one_on_every_trained_edge(family, kernel, noise, mask):
    adapter = load_adapter(f"tiny:{family}")
    k = build_kernel(adapter, kernel, noise)
    g, P = 4.0, 1 if family == "sd15" else 2  # the tiny SD1.5 UNet is the slowest: one tree
    mask = torch.tensor(mask)
    sched = adapter.make_schedule(4, PX, PX)
    embeds = adapter.encode_prompts(["a red cat", "a dog"][:P], with_uncond=True)
    traj = sample_tree(adapter, k, embeds, sched, HAND, mask, guidance_scale=g, max_nodes_per_forward=5, height=PX, width=PX,
                       generator=torch.Generator().manual_seed(1))
    # every edge of every tree, re-scored in one batch with the training path's arguments
    nodes = torch.arange(1, HAND.num_nodes).repeat(P)
    trees = torch.arange(P).repeat_interleave(HAND.num_nodes - 1)
    steps = HAND.depth[nodes] - 1
    x, x_next = traj.latents[trees, HAND.parent[nodes]], traj.latents[trees, nodes]
    t, t_next = sched[steps], sched[steps + 1]
    with torch.no_grad():
        out = adapter.predict(x, t, embeds.select(trees), g)
    new = k.step(out, x, t, t_next, sde=True, prev_sample=x_next)
    old = traj.log_probs[trees, nodes]
    has_density = mask[steps] & (new.std.flatten() > 0)
    assert has_density.sum() > 0
    assert (old[~has_density] == 0).all()  # ODE / zero-std edges carry no log-prob
    ratio = torch.exp(new.log_prob[has_density] - old[has_density])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------------- the recipe


def test_recipe_end_to_end_metrics_and_tree_picture(repo_root, tmp_path):
    out = tmp_path / "r"
    code = run_cli("train", SD3, f"output_dir={out}", "max_iterations=2", *FAST, "log.report=true",
                   "algorithm.forward_memory_mb=64")
    assert code == 0
    recs = train_records(out)
    tree = TreeStructure(6, (0, 2), 2)  # 2 prompts x 17 NFE
    for r in recs:
        assert r["nfe_rollout"] == 2 * tree.nfe == 34 and r["nfe_per_image"] == 34 / 8 and r["nfe_per_image_linear"] == 6
        assert r["denoiser_rows"] == 2 * 34  # CFG 4.5
        assert r["edges_trainable"] == 2 * (tree.num_nodes - 1) == 40
        assert r["nfe_train"] == r["edges_trained"]  # one training forward per trained edge (beta = 0)
        assert r["rollout_forwards"] >= 6 and math.isfinite(r["loss"]) and r["ratio_mean"] > 0
    report = (out / "report.md").read_text()
    assert "## BranchGRPO tree" in report and "![tree](report/tree.png)" in report and "![reward curves]" in report
    assert (out / "report" / "tree.png").stat().st_size > 1000


def test_mix_window_and_pruning_choose_the_trained_edges(repo_root, tmp_path, monkeypatch):
    # Mix on tiny SD3 (6 steps, splits 0 and 2): window of 1 step sliding each iteration, plus the splits
    import diffalign.recipes.branch_grpo as recipe

    roots = []

    def spy(*args, **kwargs):
        roots.append(kwargs["root_noise"].clone())
        return sample_tree(*args, **kwargs)

    monkeypatch.setattr(recipe, "sample_tree", spy)
    out = tmp_path / "mix"
    assert run_cli("train", SD3, f"output_dir={out}", "max_iterations=2", *FAST, "sampling.window_size=1",
                   "sampling.window_mode=sliding", "algorithm.filter_zero_std_groups=false", "algorithm.shared_root_noise=true") == 0
    assert len(roots) == 2 and all(torch.equal(r[0], r[1]) for r in roots)  # both prompts' trees start from one noise
    assert not torch.equal(roots[0], roots[1])  # ... drawn afresh every iteration
    recs = train_records(out)
    assert [r["sde_steps"] for r in recs] == [2, 3]  # {0} | {0, 2}; {1} | {0, 2}
    assert [r["edges_trainable"] for r in recs] == [2 * (2 + 4), 2 * (2 + 2 + 4)]
    assert [r["nfe_train"] for r in recs] == [r["edges_trained"] for r in recs] == [12, 16]
    # depth pruning of depths 5, 6 and width pruning (top half of 4 branches) on FLUX (no CFG)
    out = tmp_path / "pruned"
    assert run_cli("train", FLUX, f"output_dir={out}", "max_iterations=1", *FAST, "algorithm.depth_pruning=[5,6]",
                   "algorithm.width_pruning=top", "algorithm.filter_zero_std_groups=false") == 0
    (r,) = train_records(out)
    # per tree 20 edges; depths 5 and 6 (4 + 4) pruned; at depth 4, 2 of 4 branches pruned -> 10
    assert r["edges_trainable"] == 40 and r["edges_trained"] == 20 and r["pruned_frac"] == 0.5
    assert r["pruned_depths"] == [5, 6] and r["denoiser_rows"] == r["nfe_rollout"] == 34


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.split_steps=[0,6]"], "algorithm.split_steps"),  # 6 steps: 0..5
    (["rollout.group_size=8"], "rollout.group_size"),
    (["algorithm.forward_memory_mb=0.000001"], "too small for one node"),
    (["sampling.kernel=cps", "sampling.noise_level=0.8", "algorithm.split_steps=[0,5]"], "adds no noise"),
    (["algorithm.depth_pruning=[9]"], "algorithm.depth_pruning"),
])
def test_bad_input_fails_before_sampling(repo_root, tmp_path, capsys, monkeypatch, overrides, needle):
    import diffalign.recipes.branch_grpo as recipe

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled despite bad input")

    monkeypatch.setattr(recipe, "sample_tree", no_sampling)
    out = tmp_path / "r"
    assert run_cli("train", SD3, f"output_dir={out}", *FAST, *overrides) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()  # nothing on disk either


def test_rollout_benchmark_smallest_run(repo_root, tmp_path, capsys):
    """benchmarks/branch_rollout.py at its smallest: both sides' counted NFE equal the formulas."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("benchmarks_branch_rollout", repo_root / "benchmarks" / "branch_rollout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        result = module.main(["--model", "sd3-tiny", "--steps", "4", "--splits", "0,2", "--prompts", "2", "--chunk", "4",
                              "--repeats", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert result["sides"]["tree"]["nfe"] == 2 * HAND.nfe and result["sides"]["linear"]["nfe"] == 8 * 4
    assert result["nfe_ratio"] == HAND.nfe / (4 * 4)
    assert (tmp_path / "branch_rollout.png").is_file() and "ratio" in capsys.readouterr().out
