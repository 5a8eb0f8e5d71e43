"""What the adapter test modules share: the image size, two prompts, one-thread torch, a
parametrised fixture of tiny adapters and two valid times from an adapter's schedule."""

from __future__ import annotations

import pytest
import torch

from diffalign.adapters import load_adapter

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
