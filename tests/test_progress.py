"""Progress of long phases: bars on a terminal, one line per phase elsewhere, nothing under --quiet."""

from __future__ import annotations

import io
import sys
import time

import pytest

from diffalign import progress


@pytest.fixture(autouse=True)
def _not_quiet():
    progress.set_quiet(False)
    yield
    progress.set_quiet(False)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_phase_prints_one_line(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in progress.bar(range(50), desc="eval: 50 images"):
        pass
    assert err.getvalue() == "eval: 50 images ...\n"


def test_quiet_prints_nothing(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    progress.set_quiet(True)
    for _ in progress.bar(range(5), desc="eval"):
        pass
    progress.phase("a phase")
    assert err.getvalue() == ""


def test_a_bar_on_a_terminal_keeps_redrawing_between_updates(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "REFRESH_S", 0.05)
    monkeypatch.setattr(progress, "_HEARTBEAT", None)
    bar = progress.bar(total=2, desc="loading")
    time.sleep(0.3)  # one slow step, no update: the heartbeat redraws the bar
    bar.close()
    assert err.getvalue().count("loading") >= 3


def test_sample_images_advances_the_bar_every_step(monkeypatch):
    from diffalign.adapters import load_adapter
    from diffalign.sampling import sample_images

    made = []

    class Recorder:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed = kwargs, 0, False
            made.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(progress, "bar", lambda **kwargs: Recorder(**kwargs))
    adapter = load_adapter("tiny:sd3")
    sample_images(adapter, ["a", "b", "c"], num_steps=3, guidance_scale=1.0, resolution=32, seed=0, batch_size=2,
                  progress="sampling")
    (bar,) = made
    assert bar.kwargs["total"] == bar.n == 6 and bar.closed  # 2 batches x 3 denoising steps, one update each
