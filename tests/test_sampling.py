"""Samplers: SDE windows, on-policy ratio == 1 on real (tiny) models, parity with stock pipelines."""

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.errors import ConfigError
from tests.helpers.adapters import sd3  # noqa: F401 (fixture)
from diffalign.sampling import Trajectory, build_kernel, sample_images, sample_linear, sde_window_mask

PROMPTS = ["a red cat", "a blue dog"]
PX = 32


@pytest.fixture(scope="module")
def sd15():
    return load_adapter("tiny:sd15")


def test_window_modes():
    assert sde_window_mask(5, 0).all()
    assert sde_window_mask(6, 2, start=1).tolist() == [False, True, True, False, False, False]
    # sliding (MixGRPO): moves `stride` steps every `slide_every` iterations, wraps at the end
    starts = [int(sde_window_mask(6, 2, mode="sliding", iteration=i, slide_every=2).nonzero()[0]) for i in range(12)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0]
    # random (Flow-GRPO-Fast): reproducible from the generator, always a full window inside the schedule
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [sde_window_mask(10, 3, mode="random", generator=g1) for _ in range(20)]
    b = [sde_window_mask(10, 3, mode="random", generator=g2) for _ in range(20)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(int(m.sum()) == 3 for m in a) and len({int(m.nonzero()[0]) for m in a}) > 1


def test_kernel_must_fit_the_prediction_type(sd3, sd15):
    with pytest.raises(ConfigError, match="sampling.kernel"):
        build_kernel(sd3, "ddim", 1.0)
    with pytest.raises(ConfigError, match="sampling.kernel"):
        build_kernel(sd15, "flow_grpo", 0.7)


def rescore(adapter, kernel, traj, embeds, g):
    """Training-path log-probs of every recorded transition with unchanged weights."""
    out = torch.zeros_like(traj.log_probs)
    for i in range(traj.log_probs.shape[1]):
        if not traj.sde_mask[i]:
            continue
        x = traj.latents[:, i]
        t = traj.timesteps[i].expand(len(x))
        t_next = traj.timesteps[i + 1].expand(len(x))
        with torch.no_grad():
            mo = adapter.predict(x, t, embeds, g)
        out[:, i] = kernel.step(mo, x, t, t_next, prev_sample=traj.latents[:, i + 1]).log_prob
    return out


@pytest.mark.parametrize("family, kernel, noise", [
    ("sd3", "flow_grpo", 0.7), ("sd3", "cps", 0.8), ("sd3", "dance", 0.3), ("flux", "flow_grpo", 0.7),
    ("sd15", "ddim", 1.0), ("shapes", "flow_grpo", 0.7),
])
def test_on_policy_ratio_is_one(family, kernel, noise):
    adapter = load_adapter(f"tiny:{family}")
    k = build_kernel(adapter, kernel, noise)
    g = 4.0
    embeds = adapter.encode_prompts(PROMPTS, with_uncond=True)
    px = 32
    schedule = adapter.make_schedule(4, px, px)
    mask = torch.tensor([True, True, False, True])  # an ODE step in the middle (mixed ODE/SDE)
    traj = sample_linear(adapter, k, embeds, schedule, mask, guidance_scale=g, height=px, width=px,
                         generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape[:2] == (2, 5) and traj.log_probs.shape == (2, 4)
    assert traj.images.min() >= 0 and traj.images.max() <= 1
    assert (traj.log_probs[:, 2] == 0).all()  # no log-prob on the ODE step
    new = rescore(adapter, k, traj, embeds, g)
    last_is_degenerate = kernel == "cps"  # CPS has zero noise when stepping to sigma = 0
    check = mask.clone()
    if last_is_degenerate:
        check[-1] = False
    ratio = torch.exp(new[:, check] - traj.log_probs[:, check])
    assert torch.equal(ratio, torch.ones_like(ratio))


@pytest.mark.parametrize("family, guidance", [("sd3", 4.0), ("flux", 1.0), ("shapes", 4.0)])
def test_an_update_can_train_on_a_rollout(family, guidance):
    """The rollout runs in inference mode; what it returns, and what it left in the caches it
    shares with an update (the CFG text batch, FLUX's rotary tables and constant inputs), must
    still go through an update's forward and backward."""
    adapter = load_adapter(f"tiny:{family}")
    k = build_kernel(adapter, "flow_grpo", 0.7)
    embeds = adapter.encode_prompts(PROMPTS, with_uncond=guidance > 1)
    schedule = adapter.make_schedule(2, PX, PX)
    traj = sample_linear(adapter, k, embeds, schedule, torch.ones(2, dtype=torch.bool), guidance_scale=guidance,
                         height=PX, width=PX, generator=torch.Generator().manual_seed(0))
    for tensor in (traj.latents, traj.log_probs, traj.images):
        assert not tensor.is_inference()
    weights = [p for p in adapter.denoiser.parameters() if p.is_floating_point()]
    for p in weights:
        p.requires_grad_(True)
    try:
        t = schedule[0].expand(2)
        v = adapter.predict(traj.latents[:, 0], t, embeds, guidance)
        logp = k.step(v, traj.latents[:, 0], t, schedule[1].expand(2), prev_sample=traj.latents[:, 1]).log_prob
        torch.testing.assert_close(logp, traj.log_probs[:, 0], rtol=0, atol=0)  # still on-policy
        logp.sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in weights)
    finally:
        for p in weights:
            p.requires_grad_(False)
            p.grad = None


def test_same_seed_same_trajectory_and_cat(sd3):
    k = build_kernel(sd3, "flow_grpo", 0.7)
    e = sd3.encode_prompts(PROMPTS, with_uncond=True)
    sched = sd3.make_schedule(3, PX, PX)
    mask = torch.ones(3, dtype=torch.bool)
    a = sample_linear(sd3, k, e, sched, mask, guidance_scale=3.0, height=PX, width=PX, generator=torch.Generator().manual_seed(1))
    b = sample_linear(sd3, k, e, sched, mask, guidance_scale=3.0, height=PX, width=PX, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    both = Trajectory.cat([a, b])
    assert len(both) == 4 and torch.equal(both.latents[2:], b.latents)


def test_zero_noise_sampler_matches_stock_sd3_pipeline(sd3):
    """sample_images (our ODE path) == StableDiffusion3Pipeline with the same initial latents."""
    steps, g = 3, 3.0
    gen_seed = 11
    ours = sample_images(sd3, PROMPTS, num_steps=steps, guidance_scale=g, resolution=PX, seed=gen_seed)
    x = torch.randn((2, *sd3.latent_shape(PX, PX)), generator=torch.Generator().manual_seed(gen_seed))
    with torch.no_grad():
        stock = sd3.pipeline(prompt=PROMPTS, latents=x, guidance_scale=g, height=PX, width=PX, num_inference_steps=steps,
                             max_sequence_length=sd3.max_sequence_length, output_type="pt").images
    torch.testing.assert_close(ours, stock.float().clamp(0, 1), rtol=1e-4, atol=1e-4)


def test_zero_noise_sampler_matches_stock_sd15_ddim(sd15):
    from diffusers import DDIMScheduler

    steps, g, seed = 3, 5.0, 5
    ours = sample_images(sd15, PROMPTS, num_steps=steps, guidance_scale=g, resolution=PX, seed=seed)
    x = torch.randn((2, *sd15.latent_shape(PX, PX)), generator=torch.Generator().manual_seed(seed))
    pipe = sd15.pipeline
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    with torch.no_grad():
        stock = pipe(prompt=PROMPTS, latents=x, guidance_scale=g, height=PX, width=PX, num_inference_steps=steps, eta=0.0,
                     output_type="pt").images
    torch.testing.assert_close(ours, stock.float().clamp(0, 1), rtol=1e-4, atol=1e-4)
