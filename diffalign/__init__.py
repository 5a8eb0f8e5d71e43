"""diffalign: RL and preference alignment for diffusion and flow-matching image models."""

import importlib.util
from pathlib import Path

__version__ = "0.1.0"
__license__ = "Apache-2.0"  # SPDX id of pyproject.toml's license: the code and the shipped model's weights

# The two top-level packages diffalign installs beside itself (docs/architecture.md, "Packages"), each
# with a module only diffalign's has: another project's package of the same name must not stand in.
OWN_TOP_LEVEL = {"reward_models": "builtin.py", "schedulers": "flow_sde.py"}


def _check_own_top_level() -> None:
    """Raise ImportError naming the folder when ``import reward_models`` or ``import schedulers``
    would find another project's package (installed, or a folder of that name in the working
    folder), not diffalign's: what diffalign imports later would fail far from the cause."""
    for name, marker in OWN_TOP_LEVEL.items():
        spec = importlib.util.find_spec(name)
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        if not any((Path(place) / marker).is_file() for place in places):
            where = f"from {', '.join(places) or spec.origin}" if spec is not None else "nowhere (it is missing)"
            raise ImportError(
                f"diffalign needs its own top-level package {name!r}, but `import {name}` finds it {where}: another "
                f"project's package or folder of that name comes first on sys.path; rename or move it, run "
                f"diffalign from another folder, or install diffalign in a virtual environment of its own")


_check_own_top_level()
