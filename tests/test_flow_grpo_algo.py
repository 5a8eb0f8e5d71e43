"""Flow-GRPO's advantage estimator and loss on hand-computed numbers (no model)."""

import math

import pytest
import torch

from diffalign.algorithms.flow_grpo import gaussian_mean_kl, group_advantages, ppo_clip_loss


def test_group_advantages_global_std_by_hand():
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])
    g = torch.tensor([0, 0, 1, 1])
    out = group_advantages(r, g, std_mode="global", eps=0.0, clip=100)
    std = torch.tensor([1.0, 3.0, 0.0, 4.0]).std(unbiased=False)  # global std = 1.5811
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0]) / std
    assert torch.allclose(out.advantages, expected)
    assert out.keep.all() and out.zero_std_fraction == 0.0


def test_group_advantages_group_std_by_hand():
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])
    g = torch.tensor([0, 0, 1, 1])
    out = group_advantages(r, g, std_mode="group", eps=0.0, clip=100)
    assert torch.allclose(out.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_group_advantages_unbiased_std_by_hand():
    r, g = torch.tensor([1.0, 3.0, 0.0, 4.0]), torch.tensor([0, 0, 1, 1])
    # group 0: mean 2, Bessel's std sqrt(2); group 1: mean 2, sqrt(8); batch: mean 2, sqrt(10 / 3)
    out = group_advantages(r, g, std_mode="group", unbiased=True, eps=0.0, clip=100)
    assert torch.allclose(out.advantages, torch.tensor([-1, 1, -2, 2]) / torch.tensor([2.0, 2.0, 8.0, 8.0]).sqrt())
    out = group_advantages(r, g, std_mode="global", unbiased=True, eps=0.0, clip=100)
    assert torch.allclose(out.advantages, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (10 / 3) ** 0.5)


def test_zero_std_groups_filtered_and_counted():
    r = torch.tensor([1.0, 1.0, 0.0, 2.0])
    g = torch.tensor([0, 0, 1, 1])
    out = group_advantages(r, g, std_mode="group", eps=1e-4)
    assert out.zero_std_fraction == 0.5
    assert out.keep.tolist() == [False, False, True, True]
    assert out.advantages[:2].abs().sum() == 0
    kept = group_advantages(r, g, std_mode="group", filter_zero_std=False)
    assert kept.keep.all() and kept.advantages[:2].abs().sum() == 0


def test_clip_and_nonfinite():
    r = torch.tensor([0.0, 0.0, 0.0, 100.0, float("nan")])
    g = torch.zeros(5, dtype=torch.long)
    out = group_advantages(r, g, std_mode="group", clip=1.5)
    assert out.advantages.max() == 1.5
    assert not out.keep[4] and out.advantages[4] == 0
    assert torch.isfinite(out.advantages).all()


def test_ppo_loss_by_hand():
    logp_old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, 1.0, -2.0])
    out = ppo_clip_loss(logp, logp_old, adv, clip_range=0.2)
    # sample 0: max(-1*1.5, -1*1.2) = -1.2 ; sample 1: max(-0.5, -0.8) = -0.5 ; sample 2: max(2, 2) = 2
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 2.0) / 3, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(2 / 3)
    assert out.ratio_mean.item() == pytest.approx(1.0)


def test_ppo_loss_gradient_on_policy_is_minus_advantage():
    logp = torch.zeros(4, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    out = ppo_clip_loss(logp, logp.detach(), adv, clip_range=1e-4)
    out.loss.backward()
    assert torch.allclose(logp.grad, -adv / 4)


def test_kl_term_added_with_beta():
    logp = torch.zeros(2)
    kl = torch.tensor([0.5, 1.5])
    out = ppo_clip_loss(logp, logp, torch.zeros(2), clip_range=0.1, kl=kl, beta=0.1)
    assert out.loss.item() == pytest.approx(0.1)
    assert out.kl.item() == pytest.approx(1.0)


def test_gaussian_mean_kl_matches_closed_form():
    mean = torch.randn(3, 2, 4, 4)
    ref = mean + 0.1
    std = torch.tensor(0.5)
    kl = gaussian_mean_kl(mean, ref, std)
    assert torch.allclose(kl, torch.full((3,), 0.01 / (2 * 0.25)))
    # per-sample std (B,1,1,1) as the kernels return it
    std_b = torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1, 1)
    kl_b = gaussian_mean_kl(mean, ref, std_b)
    assert torch.allclose(kl_b, 0.01 / (2 * torch.tensor([0.25, 1.0, 4.0])))
    # and it is the average of the per-dimension Normal KLs
    p = torch.distributions.Normal(mean, 0.5)
    q = torch.distributions.Normal(ref, 0.5)
    assert torch.allclose(kl, torch.distributions.kl_divergence(p, q).mean(dim=(1, 2, 3)), atol=1e-6)
