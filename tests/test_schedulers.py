"""Tests of the step kernels in ``schedulers/``: parity with diffusers' stock schedulers at zero
noise, on-policy ratio exactly 1 (fp32 and bf16), empirical moments, log-density parity with
``torch.distributions.Normal``, per-sample sigmas and argument checks. Tiny tensors, CPU only."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from schedulers import (
    StepOutput,
    cps_sde_step,
    dance_sde_step,
    ddim_step_with_logprob,
    flow_grpo_sde_step,
    gaussian_log_prob,
    ode_step,
    shifted_sigmas,
)

SHAPE = (3, 2, 4, 4)  # (B, C, H, W)
N_MC = 20_000  # samples for the empirical-moment test: mean error ~ std / sqrt(N_MC) < 1 %

# Flow kernels with their noise knob; all share the (model_output, sample, sigma, sigma_next) call.
FLOW_KERNELS = {
    "flow_grpo": flow_grpo_sde_step,
    "cps": cps_sde_step,
    "cps_stepwise": partial(cps_sde_step, std_schedule="stepwise"),
    "dance": dance_sde_step,
}

# A small DDPM schedule, as DDIMScheduler builds it (linear betas, 1000 train steps).
_DDIM = DDIMScheduler(clip_sample=False, set_alpha_to_one=False)
ALPHAS_CUMPROD = _DDIM.alphas_cumprod
FINAL_ALPHA_CUMPROD = _DDIM.final_alpha_cumprod


def _ddim(model_output, sample, t, t_prev, **kw):
    return ddim_step_with_logprob(
        model_output, sample, t, t_prev, alphas_cumprod=ALPHAS_CUMPROD, final_alpha_cumprod=FINAL_ALPHA_CUMPROD, **kw
    )


# Every stochastic kernel as f(model_output, sample, a, b, **kw) with a (s, s') / (t, t') pair
# that is mid-schedule, plus a per-sample (B,) version of that pair.
STOCHASTIC = {name: (k, 0.7, 0.5) for name, k in FLOW_KERNELS.items()}
STOCHASTIC["ddim"] = (_ddim, 600, 400)
PER_SAMPLE = {name: (torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9, 0.45, 0.1])) for name in FLOW_KERNELS}
# the stepwise rule has std = 0 at s = 1 (a point mass, tested separately): start below 1
PER_SAMPLE["cps_stepwise"] = (torch.tensor([0.9, 0.7, 0.3]), torch.tensor([0.8, 0.45, 0.1]))
PER_SAMPLE["ddim"] = (torch.tensor([999, 600, 100]), torch.tensor([800, 400, -1]))


def _randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ----------------------------------------------------------------------------- zero noise == stock


@pytest.mark.parametrize(
    "step",
    [
        ode_step,
        partial(flow_grpo_sde_step, noise_level=0.0),
        partial(cps_sde_step, noise_level=0.0),
        partial(cps_sde_step, noise_level=0.0, std_schedule="stepwise"),
        partial(dance_sde_step, noise_level=0.0),
    ],
    ids=["ode", "flow_grpo", "cps", "cps_stepwise", "dance"],
)
def test_zero_noise_equals_stock_flow_match_euler(step):
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(5)
    x_stock = x_ours = _randn(*SHAPE, seed=1)
    for i, t in enumerate(sched.timesteps[:4]):
        v = _randn(*SHAPE, seed=10 + i)  # fixed random "model output"
        x_stock = sched.step(v, t, x_stock).prev_sample
        out = step(v, x_ours, float(sched.sigmas[i]), sched.sigmas[i + 1])
        assert out.log_prob is None and torch.all(out.std == 0)
        x_ours = out.prev_sample
        assert torch.equal(x_ours, x_stock)


@pytest.mark.parametrize("name", list(FLOW_KERNELS))
def test_small_noise_limit_is_euler(name):
    # std -> 0 in the formulas (not the noise_level == 0 shortcut) approaches the Euler step.
    x, v, eps = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2), _randn(*SHAPE, seed=3)
    for s, s_next in [(1.0, 0.9), (0.6, 0.4)]:
        out = FLOW_KERNELS[name](v, x, s, s_next, noise_level=1e-4, noise=eps)
        torch.testing.assert_close(out.prev_sample, ode_step(v, x, s, s_next).prev_sample, atol=1e-3, rtol=0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_equals_stock_ddim(eta, prediction_type):
    sched = DDIMScheduler(clip_sample=False, prediction_type=prediction_type)  # set_alpha_to_one=True
    sched.set_timesteps(5)
    stride = sched.config.num_train_timesteps // sched.num_inference_steps
    x_stock = x_ours = _randn(*SHAPE, seed=1)
    for i, t in enumerate(sched.timesteps):  # includes the last step, t' < 0 -> final_alpha_cumprod
        out_model, eps = _randn(*SHAPE, seed=10 + i), _randn(*SHAPE, seed=20 + i)
        x_stock = sched.step(out_model, t, x_stock, eta=eta, variance_noise=eps).prev_sample
        out = ddim_step_with_logprob(
            out_model, x_ours, t, int(t) - stride, alphas_cumprod=sched.alphas_cumprod,
            final_alpha_cumprod=sched.final_alpha_cumprod, eta=eta, prediction_type=prediction_type, noise=eps,
        )
        assert (out.log_prob is None) == (eta == 0)
        x_ours = out.prev_sample
        torch.testing.assert_close(x_ours, x_stock, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- on-policy ratio == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_rescoring_gives_ratio_exactly_one(name, dtype):
    kernel, _, _ = STOCHASTIC[name]
    a, b = PER_SAMPLE[name]
    x, v = _randn(*SHAPE, seed=1, dtype=dtype), _randn(*SHAPE, seed=2, dtype=dtype)
    sampled = kernel(v, x, a, b, generator=torch.Generator().manual_seed(0))
    assert sampled.prev_sample.dtype == torch.float32 and sampled.log_prob.dtype == torch.float32
    assert sampled.log_prob.shape == (SHAPE[0],) and torch.isfinite(sampled.log_prob).all()
    rescored = kernel(v, x, a, b, prev_sample=sampled.prev_sample)
    assert torch.equal(rescored.log_prob, sampled.log_prob)
    assert torch.equal(torch.exp(rescored.log_prob - sampled.log_prob), torch.ones(SHAPE[0]))
    # a bf16 copy of the stored sample is still scored, in fp32
    assert torch.isfinite(kernel(v, x, a, b, prev_sample=sampled.prev_sample.to(dtype)).log_prob).all()


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_log_prob_is_differentiable_in_model_output(name):
    kernel, a, b = STOCHASTIC[name]
    x = _randn(*SHAPE, seed=1)
    v = _randn(*SHAPE, seed=2, dtype=torch.bfloat16).requires_grad_()
    prev = kernel(v.detach(), x, a, b, generator=torch.Generator().manual_seed(0)).prev_sample
    kernel(v, x, a, b, prev_sample=prev).log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad.float()).all() and v.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- distribution checks


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_empirical_moments_match_mean_and_std(name):
    kernel, a, b = STOCHASTIC[name]
    x = _randn(1, 8, seed=1).expand(N_MC, 8)  # one state, N_MC independent draws
    v = _randn(1, 8, seed=2).expand(N_MC, 8)
    out = kernel(v, x, a, b, generator=torch.Generator().manual_seed(0))
    std = out.std[0, 0]
    assert std > 0
    torch.testing.assert_close(out.prev_sample.mean(0), out.mean[0], atol=5 * std.item() / math.sqrt(N_MC), rtol=0)
    torch.testing.assert_close(out.prev_sample.std(0), std.expand(8), atol=0, rtol=0.03)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_log_prob_matches_torch_normal(name, reduction):
    kernel, _, _ = STOCHASTIC[name]
    a, b = PER_SAMPLE[name]
    x, v = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    out = kernel(v, x, a, b, generator=torch.Generator().manual_seed(0), reduction=reduction)
    ref = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.prev_sample)
    ref = ref.mean(dim=(1, 2, 3)) if reduction == "mean" else ref.sum(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, ref)


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_per_sample_sigmas_equal_scalar_loop(name):
    kernel, _, _ = STOCHASTIC[name]
    a, b = PER_SAMPLE[name]
    x, v, eps = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2), _randn(*SHAPE, seed=3)
    batched = kernel(v, x, a, b, noise=eps)
    for i in range(SHAPE[0]):
        row = slice(i, i + 1)
        single = kernel(v[row], x[row], a[i].item(), b[i], noise=eps[row])
        torch.testing.assert_close(single.prev_sample, batched.prev_sample[row], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(single.log_prob, batched.log_prob[row], rtol=1e-6, atol=1e-6)


def test_kernel_means_match_reference_formulas():
    # Formulas from docs/algorithms.md "SDE kernels", written out independently.
    x, v = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    s, s2 = 0.8, 0.6
    dt = s2 - s
    a = 0.7  # Flow-GRPO: also the s == 1 branch with sigma_1 in the denominator
    std_t = a * math.sqrt(s / (1 - s))
    out = flow_grpo_sde_step(v, x, s, s2, noise_level=a)
    torch.testing.assert_close(out.mean, x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt)
    torch.testing.assert_close(out.std.flatten(), torch.full((3,), std_t * math.sqrt(-dt)))
    out1 = flow_grpo_sde_step(v, x, 1.0, 0.9, noise_level=a, sigma_max=0.95)
    torch.testing.assert_close(out1.std.flatten(), torch.full((3,), a * math.sqrt(1 / 0.05) * math.sqrt(0.1)))
    assert torch.equal(flow_grpo_sde_step(v, x, 1.0, 0.9).std, flow_grpo_sde_step(v, x, 1.0, 0.9, sigma_max=0.9).std)

    x0, x1 = x - s * v, x + (1 - s) * v
    a = 0.8  # CPS
    std = s2 * math.sin(a * math.pi / 2)
    out = cps_sde_step(v, x, s, s2, noise_level=a)
    torch.testing.assert_close(out.mean, (1 - s2) * x0 + math.sqrt(s2**2 - std**2) * x1)
    torch.testing.assert_close(out.std.flatten(), torch.full((3,), std))
    std = a * s2 * math.sqrt(1 - s)  # Stepwise rule (unverified in the doc)
    out = cps_sde_step(v, x, s, s2, noise_level=a, std_schedule="stepwise")
    torch.testing.assert_close(out.std.flatten(), torch.full((3,), std))

    eta = 0.3  # DanceGRPO
    score = -(x - (1 - s) * x0) / s**2
    out = dance_sde_step(v, x, s, s2, noise_level=eta)
    torch.testing.assert_close(out.mean, x + dt * v - 0.5 * eta**2 * score * dt)
    torch.testing.assert_close(out.std.flatten(), torch.full((3,), eta * math.sqrt(s - s2)))


# ----------------------------------------------------------------------------- noise, edge cases, errors


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_noise_and_generator_are_used(name):
    kernel, a, b = STOCHASTIC[name]
    x, v, eps = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2), _randn(*SHAPE, seed=3)
    out = kernel(v, x, a, b, noise=eps)
    torch.testing.assert_close(out.prev_sample, out.mean + out.std * eps)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(kernel(v, x, a, b, generator=g1).prev_sample, kernel(v, x, a, b, generator=g2).prev_sample)
    via_gen = kernel(v, x, a, b, generator=torch.Generator().manual_seed(7))
    assert torch.equal(via_gen.prev_sample, kernel(v, x, a, b, noise=_randn(*SHAPE, seed=7)).prev_sample)


def test_zero_noise_rescoring_keeps_given_sample():
    x, v, prev = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2), _randn(*SHAPE, seed=3)
    for kernel in FLOW_KERNELS.values():
        out = kernel(v, x, 0.5, 0.3, noise_level=0.0, prev_sample=prev)
        assert out.log_prob is None and torch.equal(out.prev_sample, prev)
        assert torch.equal(out.mean, ode_step(v, x, 0.5, 0.3).mean)
    out = _ddim(v, x, 500, 300, eta=0.0, prev_sample=prev)
    assert out.log_prob is None and torch.equal(out.prev_sample, prev)


def test_zero_std_rows_are_point_masses_with_log_prob_zero():
    # CPS at s' = 0 has std 0: that row is deterministic, log_prob 0; the others are untouched.
    x, v = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    s, s2 = torch.tensor([0.5, 0.5, 0.2]), torch.tensor([0.3, 0.3, 0.0])
    out = cps_sde_step(v, x, s, s2, generator=torch.Generator().manual_seed(0))
    assert out.log_prob[2] == 0 and torch.equal(out.prev_sample[2], out.mean[2])
    assert torch.isfinite(out.log_prob).all() and (out.log_prob[:2] != 0).all()


def test_gaussian_log_prob():
    x, mean = _randn(2, 5, seed=1), _randn(2, 5, seed=2)
    std = torch.tensor([[0.5], [2.0]])
    ref = torch.distributions.Normal(mean, std.expand(2, 5)).log_prob(x)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), ref.mean(1))
    torch.testing.assert_close(gaussian_log_prob(x.bfloat16(), mean, std, reduction="sum"),
                               torch.distributions.Normal(mean, std.expand(2, 5)).log_prob(x.bfloat16().float()).sum(1))
    assert gaussian_log_prob(x, mean, 1.0).dtype == torch.float32


def test_shifted_sigmas():
    sig = shifted_sigmas(4, shift=3.0)
    t = torch.linspace(1, 0, 5)
    torch.testing.assert_close(sig, 3 * t / (1 + 2 * t))
    assert sig[0] == 1 and sig[-1] == 0 and (sig[1:] < sig[:-1]).all()
    torch.testing.assert_close(shifted_sigmas(4, shift=1.0), t)


def test_bad_arguments_raise():
    x, v = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    with pytest.raises(ValueError, match="reduction"):
        flow_grpo_sde_step(v, x, 0.5, 0.3, reduction="max")
    with pytest.raises(ValueError, match="sigma"):
        flow_grpo_sde_step(v, x, torch.tensor([0.5, 0.4]), 0.3)
    with pytest.raises(ValueError, match="noise_level"):
        cps_sde_step(v, x, 0.5, 0.3, noise_level=1.5)
    with pytest.raises(ValueError, match="noise_level"):
        dance_sde_step(v, x, 0.5, 0.3, noise_level=-0.1)
    with pytest.raises(ValueError, match="std_schedule"):
        cps_sde_step(v, x, 0.5, 0.3, std_schedule="ddim")
    with pytest.raises(ValueError, match="prev_sample"):
        flow_grpo_sde_step(v, x, 0.5, 0.3, prev_sample=x[:1])
    with pytest.raises(ValueError, match="noise"):
        dance_sde_step(v, x, 0.5, 0.3, noise=x[:1])
    with pytest.raises(ValueError, match="timestep"):
        _ddim(v, x, torch.tensor(500.5), 300)
    with pytest.raises(ValueError, match="prediction_type"):
        _ddim(v, x, 500, 300, prediction_type="flow")
    assert isinstance(_ddim(v, x, torch.tensor(500.0), 300), StepOutput)
    # the checks every kernel shares (one implementation): shapes, reduction, its noise level
    kernels = [
        (lambda out, **kw: flow_grpo_sde_step(out, x, 0.5, 0.3, **kw), "noise_level"),
        (lambda out, **kw: cps_sde_step(out, x, 0.5, 0.3, **kw), "noise_level"),
        (lambda out, **kw: dance_sde_step(out, x, 0.5, 0.3, **kw), "noise_level"),
        (lambda out, **kw: _ddim(out, x, 500, 300, **kw), "eta"),
    ]
    for step, noise in kernels:
        with pytest.raises(ValueError, match="model_output shape"):
            step(v[:, :1])
        with pytest.raises(ValueError, match="reduction"):
            step(v, reduction="median")
        with pytest.raises(ValueError, match=f"{noise} must be"):
            step(v, **{noise: -1.0})


# ----------------------------------------------------------------------------- coarse (pooled) noise


def _blocks(y, f):
    """Block coordinates by hand: each f x f block's sum over f (the orthonormal block basis)."""
    b, c, h, w = y.shape
    return y.reshape(b, c, h // f, f, w // f, f).sum(dim=(3, 5)) / f


def test_pooled_noise_is_block_constant_and_rescores_with_ratio_one():
    x, v = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    a, b = PER_SAMPLE["flow_grpo"]
    out = flow_grpo_sde_step(v, x, a, b, noise_pool=2, generator=torch.Generator().manual_seed(0))
    step = (out.prev_sample - out.mean) / out.std
    blocks = step.reshape(3, 2, 2, 2, 2, 2)
    assert torch.allclose(blocks, blocks[:, :, :, :1, :, :1].expand_as(blocks), atol=1e-6)  # constant per 2x2 block
    rescored = flow_grpo_sde_step(v, x, a, b, noise_pool=2, prev_sample=out.prev_sample)
    assert torch.equal(rescored.log_prob, out.log_prob)
    # the density is over the block coordinates only
    ref = torch.distributions.Normal(_blocks(out.mean, 2), out.std).log_prob(_blocks(out.prev_sample, 2)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, ref)
    # zero noise: the stock Euler step, whatever the pooling
    torch.testing.assert_close(flow_grpo_sde_step(v, x, a, b, noise_level=0.0, noise_pool=2).prev_sample, ode_step(v, x, a, b).prev_sample)


def test_pooled_score_correction_acts_on_the_coarse_part_only():
    a, b = 0.7, 0.5
    coarse_x = _randn(3, 2, 2, 2, seed=1).repeat_interleave(2, -1).repeat_interleave(2, -2)  # block-constant
    coarse_v = _randn(3, 2, 2, 2, seed=2).repeat_interleave(2, -1).repeat_interleave(2, -2)
    full = flow_grpo_sde_step(coarse_v, coarse_x, a, b, generator=torch.Generator().manual_seed(0))
    pooled = flow_grpo_sde_step(coarse_v, coarse_x, a, b, noise_pool=2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pooled.mean, full.mean)  # on block-constant inputs the projection is the identity
    fine = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]).repeat(2, 2).expand(*SHAPE)  # zero mean in every block
    out = flow_grpo_sde_step(2 * fine, fine, a, b, noise_pool=2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, ode_step(2 * fine, fine, a, b).mean)  # no correction on the fine part


def test_pooled_noise_block_coordinates_are_standard_normal():
    x = _randn(1, 1, 4, 4, seed=1).expand(N_MC, 1, 4, 4)
    v = _randn(1, 1, 4, 4, seed=2).expand(N_MC, 1, 4, 4)
    out = flow_grpo_sde_step(v, x, 0.7, 0.5, noise_pool=2, generator=torch.Generator().manual_seed(0))
    z = _blocks((out.prev_sample - out.mean) / out.std, 2).reshape(N_MC, -1)
    torch.testing.assert_close(z.mean(0), torch.zeros(4), atol=5 / math.sqrt(N_MC), rtol=0)
    torch.testing.assert_close(z.std(0), torch.ones(4), atol=0, rtol=0.03)


def test_pooled_noise_needs_divisible_image_shapes():
    x = _randn(*SHAPE, seed=1)
    with pytest.raises(ValueError, match="noise_pool 3"):
        flow_grpo_sde_step(x, x, 0.7, 0.5, noise_pool=3)
    with pytest.raises(ValueError, match="noise_pool 2"):
        flow_grpo_sde_step(x[:, 0], x[:, 0], 0.7, 0.5, noise_pool=2)
    with pytest.raises(ValueError, match="noise_pool must be >= 1"):
        flow_grpo_sde_step(x, x, 0.7, 0.5, noise_pool=0)
