import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Benchmarks called in-process set torch's thread count; later tests must not inherit it
    (results of fixed-seed training runs depend on the reduction order)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_logging_disable():
    """``--quiet`` called in-process (``cli.main([..., "--quiet"])``) disables logging below ERROR for
    the whole process (:func:`diffalign.progress.silence_libraries`); later tests that read log records
    must not inherit it."""
    import logging

    level = logging.root.manager.disable
    yield
    logging.disable(level)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(args, nproc=1)``: the run directory and result of ``launch([*args, output_dir=...])``,
    made once per test session for the same ``args`` and ``nproc``. The multi-process tests compare
    against the same reference runs (one process; two processes without ZeRO or FSDP), each of which
    costs a subprocess's imports; tests read these runs and never write into them."""
    from tests.helpers.launch import launch

    runs = {}

    def run(args, nproc=1):
        key = (tuple(args), nproc)
        if key not in runs:
            out = tmp_path_factory.mktemp("shared_run") / "run"
            runs[key] = out, launch([*args, f"output_dir={out}"], ROOT, nproc=nproc)
        return runs[key]

    return run


@pytest.fixture(scope="session")
def flow_grpo_reference(tmp_path_factory, shared_run):
    """The initial weights and the one-process run of tests/helpers/compare.py's FLOW_GRPO (two prompts
    per iteration) that the Flow-GRPO comparisons of several processes, nodes or FSDP compare against."""
    from tests.helpers.compare import FLOW_GRPO
    from tests.helpers.launch import start_run

    start = tmp_path_factory.mktemp("flow_grpo") / "start"
    start_run(["-m", "diffalign.cli", "train", *FLOW_GRPO], start)
    one, _ = shared_run(["-m", "diffalign.cli", "train", *FLOW_GRPO, "rollout.prompts_per_iteration=2"])
    return start, one
