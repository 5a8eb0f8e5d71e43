"""Every shipped GPU recipe plans offline (any network connection fails), within seconds per recipe."""

from __future__ import annotations

import re
import socket
import time

from diffalign import shipped
from tests.helpers.tiny_run import ROOT, run_cli

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


HEADER = re.compile(r"GPU memory per GPU \(`diffalign plan (\S+)((?: [^`]+)?)`, docs/memory.md\):\s+(\d+) GB at the peak")


def test_recipe_headers_quote_the_current_plan():
    """A header's figure is the planner's (rounded to a GB), so that it cannot go stale unseen."""
    from diffalign.config_files import load_config
    from diffalign.planner import GB, Settings, plan

    quoted = 0
    for path in sorted((ROOT / "configs").glob("*/*.yaml")):  # this checkout's files
        if path.parent.name in NOT_GPU:
            continue
        text = " ".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
        match = HEADER.search(text)
        if match is None:
            continue
        name, flags, figure = match.group(1), match.group(2).split(), int(match.group(3))
        gpus = int(flags[flags.index("--gpus") + 1]) if "--gpus" in flags else 1
        overrides = [f for f in flags if "=" in f]
        peak = plan(Settings.from_config(load_config(str(path), overrides), gpus)).peak / GB
        assert abs(peak - figure) <= 1, (name, peak, figure)
        quoted += 1
    assert quoted >= 15
