"""GDPO's advantages (algorithm.advantage_aggregation: gdpo) on hand-computed numbers, the
trainer's hand-over of each component's reward, and one Flow-GRPO iteration with two rewards."""

import math

import pytest
import torch

from diffalign.algorithms.flow_grpo import gdpo_advantages, group_advantages
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.trainer import build_trainer
from tests.helpers.tiny_run import FAST, ROOT, run_cli

# Three groups of two; component 1 in the hundreds, component 2 in hundredths; weights (1, 0.5).
#   group 0: r1 = [100, 0]   -> A1 = [1, -1]  (population std 50);  r2 = [0, 0.01] -> A2 = [-1, 1]
#            A_sum = [1 - 0.5, -1 + 0.5] = [0.5, -0.5]
#   group 1: r1 = [50, 50]   -> A1 = [0, 0];  r2 = [0.02, 0] -> A2 = [1, -1]; A_sum = [0.5, -0.5]
#   group 2: r1 = [7, 7], r2 = [0.3, 0.3]: both constant -> A_sum = [0, 0], a zero-std group
# Batch: A_sum = [0.5, -0.5, 0.5, -0.5, 0, 0], mean 0, population std sqrt(4 x 0.25 / 6) = sqrt(1/6)
#   -> A = +-0.5 sqrt(6) = +-1.2247 for groups 0 and 1, 0 (and not kept) for group 2.
REWARDS = torch.tensor([[100.0, 0.0], [0.0, 0.01], [50.0, 0.02], [50.0, 0.0], [7.0, 0.3], [7.0, 0.3]])
WEIGHTS = torch.tensor([1.0, 0.5])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])
A = 0.5 * math.sqrt(6)


def test_gdpo_advantages_hand_computed():
    out = gdpo_advantages(REWARDS, WEIGHTS, GROUPS, eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([A, -A, A, -A, 0.0, 0.0]))
    assert out.keep.tolist() == [True, True, True, True, False, False]
    assert out.zero_std_fraction == pytest.approx(1 / 3)
    kept_all = gdpo_advantages(REWARDS, WEIGHTS, GROUPS, eps=0.0, filter_zero_std=False)
    assert kept_all.keep.all() and kept_all.advantages[4:].abs().max() == 0  # (0 - 0) / std


def test_the_small_reward_is_not_drowned():
    # Summed first (Flow-GRPO's default: global std), the 1e-2 reward's differences in group 1 are
    # 0.01 against a batch std of about 34: |A| ~ 3e-4. GDPO gives group 1 the same |A| as group 0.
    summed = group_advantages(REWARDS @ WEIGHTS, GROUPS, std_mode="global", eps=0.0)
    assert float(summed.advantages[2].abs()) < 1e-3 and float(summed.advantages[0]) > 1.0
    gdpo = gdpo_advantages(REWARDS, WEIGHTS, GROUPS, eps=0.0)
    assert float(gdpo.advantages[2]) == pytest.approx(float(gdpo.advantages[0]))


def test_gdpo_unbiased_clip_and_nonfinite():
    # Bessel's std: per component the two-sample z-scores are +-1/sqrt(2), A_sum = +-0.5/sqrt(2) in
    # groups 0 and 1; batch std (n - 1 = 5) sqrt(4 x 0.125 / 5) = sqrt(0.1) -> A = 0.3536 / 0.3162 = sqrt(1.25)
    out = gdpo_advantages(REWARDS, WEIGHTS, GROUPS, eps=0.0, unbiased=True)
    torch.testing.assert_close(out.advantages[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]) * math.sqrt(1.25))
    assert float(gdpo_advantages(REWARDS, WEIGHTS, GROUPS, eps=0.0, clip=1.0).advantages.abs().max()) == 1.0
    # a non-finite component: that sample is out of every statistic, A = 0, not kept; its group partner
    # is alone in group 0 (A_k = 0), so only group 1 varies: A_sum = [0, 0.5, -0.5, 0, 0] over the finite rows
    bad = REWARDS.clone()
    bad[0, 1] = float("nan")
    out = gdpo_advantages(bad, WEIGHTS, GROUPS, eps=0.0)
    std = math.sqrt(0.5 / 5)
    torch.testing.assert_close(out.advantages, torch.tensor([0.0, 0.0, 0.5 / std, -0.5 / std, 0.0, 0.0]))
    assert out.keep.tolist() == [False, False, True, True, False, False]
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        gdpo_advantages(REWARDS[:, 0], WEIGHTS, GROUPS)


# ---- end to end ----------------------------------------------------------------------------

CONFIG = "configs/tiny/flow_grpo_sd3.yaml"
TWO_REWARDS = ["reward.name=weighted",
               "reward.kwargs={components: [{name: jpeg_compressibility, weight: 1.0}, {name: brightness, weight: 0.5}]}"]


def test_one_iteration_with_two_rewards(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", "algorithm.advantage_aggregation=gdpo",
                                      *TWO_REWARDS, *FAST])
    tr = build_trainer(cfg)
    tr.setup()
    torch.testing.assert_close(tr.reward_weights, WEIGHTS)
    images = torch.rand(3, 3, 32, 32)
    components, _ = tr.score_components(images, ["a cat"] * 3)
    total, _ = tr.score(images, ["a cat"] * 3)
    assert components.shape == (3, 2)
    torch.testing.assert_close(components @ WEIGHTS, total)
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    assert rec["optimizer_steps"] == 1 and math.isfinite(rec["loss"]) and math.isfinite(rec["reward_mean"])
    assert "reward/jpeg_compressibility" in rec and "reward/brightness" in rec
    assert sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before)) > 0


def test_gdpo_needs_a_weighted_reward(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "algorithm.advantage_aggregation=gdpo", *FAST])
    with pytest.raises(ConfigError, match="advantage_aggregation"):
        build_trainer(cfg).setup()
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'bad'}", "algorithm.advantage_aggregation=mean", *FAST) == 2
    with pytest.raises(ConfigError, match="algorithm.diffusion_nft.advantage_aggregation"):  # Sol-RL ranks on one reward
        load_config(ROOT / "configs/tiny/sol_rl_sd3.yaml", ["algorithm.diffusion_nft.advantage_aggregation=gdpo"])
