"""Load a script of the repository (a benchmark, a pretraining script) as a module, by its path."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str):
    """``ROOT / relative`` imported as module ``name``, registered in ``sys.modules`` (dataclasses look
    their module up there) with the repository root on ``sys.path`` (scripts import ``benchmarks.*``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
