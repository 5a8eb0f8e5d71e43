"""Every shipped GPU recipe plans offline (any network connection fails), within seconds per recipe."""

from __future__ import annotations

import socket
import time

from diffalign import shipped
from tests.helpers.tiny_run import run_cli

NOT_GPU = ("tiny", "shapes", "accelerate")


def test_every_shipped_gpu_recipe_plans_offline_in_seconds(capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("the planner must not reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    start = time.time()
    assert run_cli("plan", "--all") == 0
    out = capsys.readouterr().out
    names = [r.name for r in shipped.available() if r.name.split("/")[0] not in NOT_GPU]
    assert len(names) >= 20 and all(f"{name}:" in out for name in names)
    assert out.count("phase 'train' is the peak") + out.count("phase 'decode' is the peak") + out.count("phase 'rollout'") + \
        out.count("phase 'encode'") == len(names)
    assert time.time() - start < 60  # every recipe from cold caches (most of it importing diffusers), on a loaded 2-core machine
