"""Sol-RL: selection modes and rank measures on hand-computed numbers, seeded sampling, the two stages end to end."""

import json

import pytest
import torch

from diffalign.algorithms.sol_rl import kendall_tau, select_indices, topk_hit_rate
from diffalign.config_files import load_config
from diffalign.trainer import build_trainer
from diffalign.recipes.sol_rl import SolRLConfig, SolRLGRPOTrainer, SolRLTrainer
from diffalign.sampling.seeded import sample_seeded, seed_noise
from tests.helpers.adapters import sd3  # noqa: F401 (fixture)
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/sol_rl_sd3.yaml"


# ---- selection, by hand --------------------------------------------------------------------
R = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3, 0.9])
KEYS = torch.tensor([0.6, 0.1, 0.9, 0.3, 0.5, 0.2])  # "random" = the smallest keys: 1, 5, 3, 4, 0, 2


def test_best_worst():
    # descending, ties by position: 1 (0.9), 5 (0.9), 3 (0.7), 0 (0.5), 4 (0.3), 2 (0.1)
    assert select_indices(R, 4, "best_worst").tolist() == [1, 5, 2, 4]  # best 2, then worst 2 (lowest first)
    assert select_indices(R, 3, "best_worst").tolist() == [1, 2, 4]  # k // 2 = 1 best, 2 worst
    assert select_indices(R, 6, "best_worst").tolist() == [1, 5, 3, 2, 4, 0]  # everything, once
    # ties everywhere: best and worst never share a seed (the reference's topk can pick one twice)
    same = select_indices(torch.ones(4), 4, "best_worst")
    assert sorted(same.tolist()) == [0, 1, 2, 3]


def test_mean_deviation_random_extremes():
    # mean 3.4 / 6 = 0.5667; |r - mean| = [.067, .333, .467, .133, .267, .333]
    assert select_indices(R, 2, "mean_deviation").tolist() == [2, 1]
    assert select_indices(R, 3, "mean_deviation").tolist() == [2, 1, 5]
    assert select_indices(R, 3, "random", random_keys=KEYS).tolist() == [1, 5, 3]
    # extremes: argmax 1 (first 0.9), argmin 2; then the smallest keys among 0, 3, 4, 5: 5 (0.2), 3 (0.3)
    assert select_indices(R, 4, "extremes_random", random_keys=KEYS).tolist() == [1, 2, 5, 3]
    assert select_indices(R, 1, "extremes_random", random_keys=KEYS).tolist() == [1]
    assert select_indices(torch.ones(3), 2, "extremes_random", random_keys=torch.tensor([0.9, 0.1, 0.5])).tolist() == [0, 1]


def test_selection_bad_input():
    with pytest.raises(ValueError, match="cannot select 7 seeds from a pool of 6"):
        select_indices(R, 7, "best_worst")
    with pytest.raises(ValueError, match="cannot select 0"):
        select_indices(R, 0, "best_worst")
    with pytest.raises(ValueError, match="unknown selection mode"):
        select_indices(R, 2, "top")
    with pytest.raises(ValueError, match="random_keys"):
        select_indices(R, 2, "random")
    with pytest.raises(ValueError, match="finite"):
        select_indices(torch.tensor([0.1, float("nan"), 0.3]), 2, "best_worst")


def test_kendall_tau_by_hand_and_against_scipy():
    # pairs (0,1) and (0,2) concordant, (1,2) discordant: (2 - 1) / 3
    assert kendall_tau(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0])) == pytest.approx(1 / 3)
    # a tie in x: S = 2, n0 = 3, n1 = 1, n2 = 0 -> 2 / sqrt(2 * 3)
    assert kendall_tau(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(2 / 6**0.5)
    assert kendall_tau(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    assert kendall_tau(torch.ones(4), torch.arange(4.0)) != kendall_tau(torch.ones(4), torch.arange(4.0))  # NaN: undefined
    scipy_stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randint(0, 4, (12,), generator=gen).float()  # discrete scores: many ties
        y = x + torch.randint(0, 3, (12,), generator=gen).float()
        assert kendall_tau(x, y) == pytest.approx(scipy_stats.kendalltau(x.numpy(), y.numpy()).statistic)


def test_topk_hit_rate_by_hand():
    proxy = torch.tensor([0.9, 0.8, 0.1, 0.5])
    target = torch.tensor([0.2, 0.9, 0.8, 0.1])
    # proxy's top 2 = {0, 1}; target's 2nd best = 0.8: item 1 (0.9) hits, item 0 (0.2) misses
    assert topk_hit_rate(proxy, target, 2) == 0.5
    assert topk_hit_rate(proxy, target, 4) == 1.0
    assert topk_hit_rate(target, target, 2) == 1.0
    # pass/fail targets: everything tied with the k-th best counts
    assert topk_hit_rate(torch.tensor([0.1, 0.2, 0.9, 0.3]), torch.tensor([1.0, 1.0, 1.0, 0.0]), 2) == 0.5
    with pytest.raises(ValueError, match="k must be"):
        topk_hit_rate(proxy, target, 5)


# ---- seed-driven sampling --------------------------------------------------------------------


def test_a_seed_fixes_the_image(sd3):
    a = sd3
    embeds = a.encode_prompts(["a cat"] * 3, with_uncond=True)
    kw = dict(num_steps=3, guidance_scale=3.0, resolution=32)
    first = sample_seeded(a, embeds, [11, 22, 33], batch_size=3, **kw)
    again = sample_seeded(a, embeds, [11, 22, 33], batch_size=3, **kw)
    assert torch.equal(first.images, again.images)
    # seed 22 alone, and at another position among other seeds and another chunking: the same image
    alone = sample_seeded(a, embeds.select([0]), [22], batch_size=1, **kw)
    moved = sample_seeded(a, embeds, [44, 22, 11], batch_size=2, **kw)
    torch.testing.assert_close(alone.images[0], first.images[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(moved.images[1], first.images[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(moved.images[2], first.images[0], atol=1e-5, rtol=0)
    assert (first.images[0] - first.images[1]).abs().max() > 1e-3  # different seeds, different images
    # the noise of a seed is the same whatever its neighbours
    n1, _ = seed_noise([5, 6], (2, 3))
    n2, _ = seed_noise([6], (2, 3))
    assert torch.equal(n1[1], n2[0])


def test_seeded_sde_trajectory_is_fixed_by_the_seed(sd3):
    from diffalign.sampling import build_kernel

    a = sd3
    embeds = a.encode_prompts(["a dog"] * 2, with_uncond=False)
    kernel = build_kernel(a, "flow_grpo", 0.7)
    mask = torch.tensor([True, True, False])
    kw = dict(num_steps=3, guidance_scale=1.0, resolution=32, kernel=kernel, sde_mask=mask, keep_latents=True)
    t1 = sample_seeded(a, embeds, [3, 4], batch_size=2, **kw)
    t2 = sample_seeded(a, embeds.select([1]), [4], batch_size=1, **kw)
    torch.testing.assert_close(t2.latents[0], t1.latents[1], atol=1e-5, rtol=0)
    assert (t1.log_probs[:, :2] != 0).all() and (t1.log_probs[:, 2] == 0).all()
    ode = sample_seeded(a, embeds, [3, 4], num_steps=3, guidance_scale=1.0, resolution=32, batch_size=2)
    assert (ode.images - t1.images).abs().max() > 1e-4  # the SDE noise did something


def test_zero_steps_and_bad_seeds_fail_before_any_forward(sd3, monkeypatch):
    a = sd3
    calls = []
    monkeypatch.setattr(a, "predict", lambda *args, **kw: calls.append(1))
    embeds = a.encode_prompts(["a cat"], with_uncond=False)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        sample_seeded(a, embeds, [1], num_steps=0, guidance_scale=1.0, resolution=32)
    with pytest.raises(ValueError, match="one seed per sample"):
        sample_seeded(a, embeds, [1, 2], num_steps=2, guidance_scale=1.0, resolution=32)
    assert calls == []


# ---- the two stages --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("sol") / "run"
    cfg = load_config(ROOT / CONFIG, [f"output_dir={out}", *FAST])
    tr = build_trainer(cfg)
    assert isinstance(tr, SolRLTrainer)
    tr.setup()
    return tr


def test_stage_two_regenerates_exactly_the_selected_seeds_at_full_precision(trainer):
    from diffalign.recipes.diffusion_nft import OLD_ADAPTER

    tr = trainer
    n, k = tr.sol.pool_size, tr.cfg.rollout.group_size
    s = tr.cfg.sampling
    gen_state = tr.generator.get_state()
    sampler_state = tr.prompt_sampler.state_dict()
    samples = tr.rollout(0)
    p = tr.cfg.rollout.prompts_per_iteration
    # the update sees only stage-2 samples: K per prompt
    assert samples.x0.shape[0] == len(samples.rewards) == len(samples.seeds) == p * k
    # replay stage 1 independently with the copy: the selected seeds are the best k/2 and worst k/2
    tr.generator.set_state(gen_state)
    tr.prompt_sampler.load_state_dict(sampler_state)
    prompts = tr.prompt_sampler.next(p)
    pool = torch.randint(0, 2**31 - 1, (p, n), generator=tr.generator)
    embeds = tr.adapter.encode_prompts(prompts, with_uncond=False).repeat_interleave(n)
    with tr.lowp.swapped_into(tr.adapter):
        stage1 = sample_seeded(tr.adapter, embeds, pool.flatten(), num_steps=tr.sol.stage1_steps, guidance_scale=s.guidance_scale,
                               resolution=tr.resolution, batch_size=64)
    r1 = tr.reward_fn(stage1.images, [x for x in prompts for _ in range(n)], None).reshape(p, n)
    for i in range(p):
        order = torch.sort(r1[i], descending=True, stable=True).indices
        expect = set(pool[i, order[: k // 2]].tolist()) | set(pool[i, order[n - (k - k // 2):]].tolist())
        assert set(samples.seeds[i * k:(i + 1) * k].tolist()) == expect
    # stage 2: those seeds at full precision, sampling_policy (old adapter), full steps; rewards of these images
    with tr.adapter_active(OLD_ADAPTER):
        full = sample_seeded(tr.adapter, samples.embeds, samples.seeds, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                             resolution=tr.resolution, batch_size=64)
    torch.testing.assert_close(full.latents[:, -1], samples.x0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tr.reward_fn(full.images, samples.prompts, None), samples.rewards, atol=1e-5, rtol=1e-5)
    for key in ("time/sync", "time/stage1", "time/stage2", "sol/kendall_tau", "sol/topk_hit_rate", "quant/velocity_rel_err"):
        assert key in samples.info, key
    assert 0 < samples.info["quant/velocity_rel_err"] < 0.05  # int8 on the tiny model


def test_full_precision_copy_with_full_steps_ranks_perfectly(trainer):
    """Sanity of the whole pipeline: an unquantised copy with stage 2's step count is stage 2."""
    from diffalign.sol_rl.policy_copy import LowPrecisionCopy
    from diffalign.sol_rl.quantize import QuantConfig

    tr = trainer
    saved_copy, saved_steps = tr.lowp, tr.sol.stage1_steps
    try:
        tr.lowp = LowPrecisionCopy(tr.adapter.denoiser, QuantConfig(format="full"), adapter_name=tr.sampling_adapter)
        tr.sol.stage1_steps = tr.cfg.sampling.num_steps
        samples = tr.rollout(1)
        assert samples.info["sol/kendall_tau"] == pytest.approx(1.0)
        assert samples.info["sol/topk_hit_rate"] == 1.0
        assert samples.info["quant/velocity_rel_err"] < 1e-5
    finally:
        tr.lowp, tr.sol.stage1_steps = saved_copy, saved_steps


METRIC_KEYS = ("time/sync", "time/stage1", "time/stage2", "time/update", "sol/kendall_tau", "sol/topk_hit_rate",
               "sol/audit_kendall_tau", "sol/audit_topk_hit_rate", "quant/velocity_rel_err", "reward_mean", "loss", "grad_norm")


def test_train_end_to_end_with_the_flow_grpo_optimiser(tmp_path):
    out = tmp_path / "run"
    code = run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "algorithm.optimizer=flow_grpo",
                   "algorithm.audit_every=1", *FAST)
    assert code == 0
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval": true' not in line][0]
    for key in METRIC_KEYS:
        assert key in rec, key
    assert rec["optimizer_steps"] == 1
    assert rec["ratio_mean"] == pytest.approx(1.0)  # on-policy: the SDE regeneration is re-scored exactly
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'x'}", "algorithm.optimizer=flow_grpo"])
    assert isinstance(build_trainer(cfg), SolRLGRPOTrainer)


def test_bad_input_is_refused_before_any_sampling(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "rollout.group_size=16", *FAST) == 2
    err = capsys.readouterr().err
    assert "rollout.group_size" in err and "algorithm.pool_size" in err and not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={out}", "algorithm.stage1_steps=0", *FAST) == 2
    assert "algorithm.stage1_steps" in capsys.readouterr().err and not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={out}", "sampling.num_steps=0", *FAST) == 2
    assert "sampling.num_steps" in capsys.readouterr().err and not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={out}", "algorithm.selection=top", *FAST) == 2
    assert "algorithm.selection" in capsys.readouterr().err and not out.exists()
    if not torch.cuda.is_available():  # NVFP4 cannot run on this machine: error as configured, or fall back
        assert run_cli("train", CONFIG, f"output_dir={out}", "algorithm.quant.format=nvfp4",
                       "algorithm.quant.on_unsupported=error", *FAST) == 2
        err = capsys.readouterr().err
        assert "algorithm.quant.format" in err and "Blackwell" in err and not out.exists()
        cfg = load_config(ROOT / CONFIG, [f"output_dir={out}", "algorithm.quant.format=nvfp4",
                                          "algorithm.quant.on_unsupported=fallback", "algorithm.quant.fallback_formats=[fp8, bf16]"])
        tr = build_trainer(cfg)
        assert (tr.quant_format.used, tr.quant_format.mode) == ("bf16", "fallback")


def test_published_recipes_validate():
    for path in sorted(ROOT.glob("configs/*/sol_rl*.yaml")) + sorted(ROOT.glob("configs/*/diffusion_nft*.yaml")):
        cfg = load_config(path)
        if cfg.algorithm.name == "sol_rl":
            assert isinstance(cfg.algorithm, SolRLConfig)
            assert cfg.rollout.group_size <= cfg.algorithm.pool_size
            assert cfg.algorithm.stage1_steps < cfg.sampling.num_steps
    sd3 = load_config(ROOT / "configs/sd3/sol_rl_pickscore.yaml")
    assert (sd3.algorithm.pool_size, sd3.rollout.group_size, sd3.algorithm.stage1_steps, sd3.sampling.num_steps) == (96, 24, 6, 10)
    assert sd3.algorithm.quant.format == "nvfp4" and sd3.algorithm.quant.min_dim == 2432


def test_resume_matches_uninterrupted_run(tmp_path):
    """DiffusionNFT optimiser end to end. Old adapter, its decay step, the generator (seeds, selection
    keys, noise seeds) and the copy rebuilt from the resumed weights: an interrupted run ends with the
    same weights as an uninterrupted one."""
    from safetensors.torch import load_file

    common = ["max_iterations=2", "checkpoint.every=1", "algorithm.audit_every=2", *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli("train", CONFIG, f"output_dir={full}", *common) == 0
    assert run_cli("train", CONFIG, f"output_dir={part}", *common, "max_iterations=1") == 0
    assert run_cli("resume", str(part), "max_iterations=2") == 0
    a = load_file(str(full / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(part / "final" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines() if '"eval": true' not in x]
    rb = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines() if '"eval": true' not in x]
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]
    assert [r["sol/selected_stage1_reward_mean"] for r in ra] == [r["sol/selected_stage1_reward_mean"] for r in rb]
    for key in METRIC_KEYS:
        assert key in ra[1], key
    assert ra[0]["time/sync"] == 0.0 and ra[1]["time/sync"] > 0  # re-synced after the first update
    assert ra[1]["old_decay"] == pytest.approx(0.002)  # min(0.001 x 2 optimizer steps, 0.5)
