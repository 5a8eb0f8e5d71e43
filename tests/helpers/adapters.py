"""What the adapter test modules share: the image size, two prompts, one-thread torch, a
parametrised fixture of tiny adapters, two valid times from an adapter's schedule, the zero-noise
rollout the stock-pipeline parity tests compare, and the check that a pipeline saved and loaded
back is the same model."""

from __future__ import annotations

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.sampling import build_kernel, sample_linear

PX = 32  # image / frame size of every adapter test
PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are dominated by per-op overhead; one thread is fastest on a shared machine.
    Import it into a test module to apply it there."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_adapters(families: list[str]):
    """A module-scoped fixture giving each family's tiny random build (``tiny:<family>``, seed 0)."""

    @pytest.fixture(scope="module", params=families)
    def adapter(request):
        return load_adapter(f"tiny:{request.param}", seed=0)

    return adapter


@pytest.fixture(scope="module")
def sd3():
    """The tiny SD3 adapter (random weights), one per test module."""
    return load_adapter("tiny:sd3")


def times(adapter, num_steps: int = 4) -> torch.Tensor:
    """Two different, valid, non-final times from the adapter's own schedule."""
    return adapter.make_schedule(num_steps, PX, PX)[[0, 2]]


def assert_loaded_equals(loaded, adapter) -> None:
    """``loaded`` (``adapter``'s pipeline after ``save_pretrained`` / ``from_pretrained``) predicts
    with CFG, schedules and decodes exactly as ``adapter`` does."""
    x = adapter.prepare_noise(2, PX, PX, generator=torch.Generator().manual_seed(5))
    t = times(adapter)
    with torch.no_grad():
        ours = adapter.predict(x, t, adapter.encode_prompts(PROMPTS, with_uncond=True), 3.0)
        theirs = loaded.predict(x, t, loaded.encode_prompts(PROMPTS, with_uncond=True), 3.0)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    torch.testing.assert_close(loaded.make_schedule(6, PX, PX), adapter.make_schedule(6, PX, PX), rtol=0, atol=0)
    torch.testing.assert_close(loaded.decode(x), adapter.decode(x), rtol=0, atol=1e-6)


def ode_rollout(adapter, noise: torch.Tensor, guidance_scale: float, steps: int, *, schedule=None, with_uncond: bool = True):
    """The training rollout of :data:`PROMPTS` from ``noise`` with the SDE's noise at zero (the ODE a
    stock pipeline runs), over ``steps`` steps of ``schedule`` (default: the adapter's own): its
    trajectory, every step untrained."""
    schedule = adapter.make_schedule(steps, PX, PX) if schedule is None else schedule
    return sample_linear(adapter, build_kernel(adapter, "flow_grpo", 0.0), adapter.encode_prompts(PROMPTS, with_uncond=with_uncond),
                         schedule, torch.zeros(steps, dtype=torch.bool), guidance_scale=guidance_scale,
                         height=PX, width=PX, noise=noise)
