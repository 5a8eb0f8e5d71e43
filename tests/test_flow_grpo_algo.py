"""Flow-GRPO's advantage estimator and loss on hand-computed numbers (no model)."""

import math

import pytest
import torch

from diffalign.algorithms.flow_grpo import gaussian_mean_kl, group_advantages, ppo_clip_loss, reference_code_kl, step_kl


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


def test_reference_code_kl_is_the_exact_kl_times_dt_by_hand():
    """Means 0.2 apart, sigma_t = 1: with |dt| = 0.25 the step's std is 0.5, the exact KL
    0.04 / (2 * 0.25) = 0.08 and the reference code's 0.04 / (2 * 1) = 0.02 = 0.08 * 0.25."""
    mean = torch.zeros(2, 3, 4, 4)
    ref = mean + 0.2
    abs_dt = torch.tensor([0.25, 0.04])
    std = (1.0 * abs_dt.sqrt()).view(2, 1, 1, 1)  # sigma_t * sqrt(|dt|)
    exact = step_kl(mean, ref, std, definition="exact")
    reference = step_kl(mean, ref, std, definition="reference", abs_dt=abs_dt)
    assert torch.allclose(exact, torch.tensor([0.08, 0.5]))
    assert torch.allclose(reference, torch.tensor([0.02, 0.02]))
    assert torch.allclose(reference, exact * abs_dt)
    assert torch.allclose(reference_code_kl(mean, ref, torch.tensor(0.5), 0.25), torch.tensor([0.02, 0.02]))
    with pytest.raises(ValueError, match="abs_dt|dt"):
        step_kl(mean, ref, std, definition="reference")
    with pytest.raises(ValueError, match="exact, reference"):
        step_kl(mean, ref, std, definition="approx")


@pytest.mark.parametrize("kernel", ["flow_grpo", "dance"])
def test_reference_code_kl_matches_the_authors_formula_on_real_steps(kernel):
    """Transcribed from Flow-GRPO's train_sd3.py / sd3_sde_with_logprob.py: ``std_dev_t`` is the SDE
    coefficient (``a * sqrt(s / (1 - s))`` for its SDE; DanceGRPO's ``eta``), the KL
    ``((mean - mean_ref)^2).mean(dims) / (2 * std_dev_t^2)``; the step's own std is
    ``std_dev_t * sqrt(-dt)``."""
    from diffalign.sampling.linear import Kernel

    torch.manual_seed(0)
    a = 0.7 if kernel == "flow_grpo" else 0.3
    k = Kernel(kernel, a)
    x = torch.randn(3, 2, 4, 4)
    v, v_ref = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    s = torch.tensor([0.9, 0.6, 0.3])
    s_next = torch.tensor([0.8, 0.45, 0.1])
    step = k.step(v, x, s, s_next, noise=torch.zeros_like(x))
    ref = k.step(v_ref, x, s, s_next, noise=torch.zeros_like(x))
    std_dev_t = (a * torch.sqrt(s / (1 - s)) if kernel == "flow_grpo" else torch.full_like(s, a)).view(3, 1, 1, 1)
    dt = (s_next - s).view(3, 1, 1, 1)
    assert torch.allclose(step.std.expand(3, 1, 1, 1), std_dev_t * torch.sqrt(-dt))
    authors = ((step.mean - ref.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    ours = reference_code_kl(step.mean, ref.mean, step.std, k.abs_dt(s, s_next))
    assert torch.allclose(ours, authors.flatten(), rtol=1e-5)
    assert torch.allclose(ours, gaussian_mean_kl(step.mean, ref.mean, step.std) * (s - s_next), rtol=1e-5)


@pytest.mark.parametrize("kernel", ["cps", "ddim"])
def test_kernels_without_dt_have_no_reference_kl(kernel):
    from diffalign.errors import ConfigError
    from diffalign.sampling.linear import Kernel

    with pytest.raises(ConfigError, match=f"{kernel} kernel"):
        Kernel(kernel, 0.5).abs_dt(torch.tensor(0.5), torch.tensor(0.4))
