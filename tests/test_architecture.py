"""The package's shape: layers that import downward only, no import cycles, one name per method.

The imports are read from the source with ``ast`` (module-level and function-level alike; those
under ``if TYPE_CHECKING:`` are not imports at run time and are skipped). docs/architecture.md
draws the same layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.tiny_run import ROOT
PACKAGES = ("diffalign", "reward_models", "schedulers")

# Bottom to top. A module may import modules of its own layer or of a layer below, never above;
# its layer is that of the longest prefix listed here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("diffalign", "diffalign.errors", "diffalign.faults", "diffalign.state_files", "diffalign.stats",
                     "diffalign.images", "diffalign.progress", "diffalign.shipped", "diffalign.runs",
                     "diffalign.trends")),
    ("kernels: step kernels and method math on tensors", ("schedulers", "diffalign.algorithms")),
    ("the embedded world and model", ("diffalign.shapes",)),
    ("models and sampling", ("diffalign.adapters", "diffalign.forward_process", "diffalign.sampling", "diffalign.sol_rl")),
    ("rewards and judges", ("reward_models", "diffalign.drm.model", "diffalign.spm.model", "diffalign.spm.sampling",
                            "diffalign.pairs")),
    ("config", ("diffalign.config", "diffalign.config_files", "diffalign.prompts", "diffalign.distributed",
                "diffalign.recipes")),  # the package init only: the registry of recipe names
    ("evaluation, reports and export", ("diffalign.evaluation", "diffalign.best_scale", "diffalign.report", "diffalign.hub", "diffalign.export",
                                        "diffalign.geneval")),
    ("training parts", ("diffalign.training", "diffalign.planner")),
    ("the trainer", ("diffalign.trainer",)),
    ("methods: configs beside their recipes, judges' training", (
        "diffalign.recipes.", "diffalign.drm.train", "diffalign.drm.sampling", "diffalign.spm.train")),
    ("command line", ("diffalign.cli", "diffalign.__main__")),
]

# Function-level first-party imports are allowed only here, each with its reason; everywhere else
# imports sit at the top of the module.
LAZY = {
    "diffalign.cli": "`diffalign --help` and bad-input errors answer without importing torch",
    "diffalign.__main__": "as diffalign.cli",
    "reward_models": "the registry imports a reward's module (and its optional dependencies) when the reward is named",
    "reward_models.drm": "the DRM's network is built when the reward is, not when the registry is read",
    "reward_models.spm": "the step-aware preference model is built when the reward is",
    "diffalign.adapters": "each family's module (and its diffusers classes) loads when the family is used",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = all_modules()


def resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported first-party module, line, inside a function) for every import of ``module``."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: list[tuple[str, int, bool]] = []

    def add(target: str, line: int, lazy: bool) -> None:
        resolved = resolve(target)
        if resolved and resolved != module:
            out.append((resolved, line, lazy))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, lazy)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:  # `from pkg import submodule` imports the submodule
                    full = f"{base}.{alias.name}"
                    add(full if full in MODULES else base, child.lineno, lazy)
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return out


def layer(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module.startswith(prefix) if prefix.endswith(".") else (module == prefix or module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_imports_run_downward():
    upward = [f"{m}:{line} imports {t} ({LAYERS[layer(t)][0]}) from {LAYERS[layer(m)][0]}"
              for m, edges in GRAPH.items() for t, line, _ in edges if layer(t) > layer(m)]
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = {m: sorted({t for t, _, _ in e}) for m, e in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            dfs(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_level_imports_only_where_a_reason_is_given():
    lazy = [f"{m}:{line} imports {t} inside a function" for m, e in GRAPH.items() if m not in LAZY
            for t, line, inner in e if inner]
    assert not lazy, "first-party imports belong at the top of the module (or in LAZY with a reason):\n" + "\n".join(lazy)
    for module in LAZY:
        assert module in MODULES, f"LAZY names {module}, which does not exist"


def test_the_checker_sees_an_upward_import_and_a_cycle():
    """The tests above would fail on a new upward import or cycle (checked on a made-up graph)."""
    assert layer("diffalign.algorithms.flow_grpo") < layer("diffalign.config") < layer("diffalign.recipes.flow_grpo")
    assert layer("diffalign.recipes") < layer("diffalign.trainer") < layer("diffalign.recipes.spo")
    assert resolve("diffalign.recipes.flow_grpo.FlowGRPOConfig") == "diffalign.recipes.flow_grpo"


# ---- one name per method ----------------------------------------------------------------------

def camel(name: str) -> str:
    special = {"grpo": "GRPO", "dpo": "DPO", "nft": "NFT", "drm": "DRM", "spo": "SPO", "awm": "AWM", "rl": "RL", "opd": "OPD", "dgpo": "DGPO"}
    return "".join(special.get(part, part.capitalize()) for part in name.split("_"))


def recipe_names() -> list[str]:
    from diffalign import recipes

    return recipes.available()


@pytest.mark.parametrize("name", recipe_names())
def test_a_method_has_one_name(name):
    from diffalign import recipes

    assert recipes.recipe_module(name) == f"diffalign.recipes.{name}"
    assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    source = (ROOT / "diffalign" / "recipes" / f"{name}.py").read_text()
    assert re.search(rf"^class {camel(name)}Config\b", source, re.M), f"recipes/{name}.py defines no {camel(name)}Config"
    assert re.search(rf"^class {camel(name)}Trainer\b", source, re.M), f"recipes/{name}.py defines no {camel(name)}Trainer"
    math = ROOT / "diffalign" / "algorithms" / f"{name}.py"
    assert math.is_file(), f"the method math of {name} belongs in diffalign/algorithms/{name}.py"


def test_module_names_are_method_or_shared_names():
    names = set(recipe_names())
    shared = {"continuation", "grpo_guard"}  # math used by several methods
    for path in (ROOT / "diffalign" / "algorithms").glob("*.py"):
        assert path.stem in names | shared | {"__init__"}, f"algorithms/{path.name} names no method"
    for path in (ROOT / "diffalign" / "recipes").glob("*.py"):
        assert path.stem in names or path.stem.startswith("_"), f"recipes/{path.name} names no method"


def test_config_files_name_their_method():
    from diffalign.config_files import read_yaml

    names = recipe_names()
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        if path.parent.name == "accelerate":
            continue
        data = read_yaml(path)
        algorithm = (data.get("algorithm") or {}).get("name", "flow_grpo") if isinstance(data, dict) else None
        if algorithm is None or "model" not in data:
            continue
        assert algorithm in names, f"{path.relative_to(ROOT)}: unknown algorithm {algorithm}"
        assert path.stem.startswith(algorithm), f"{path.relative_to(ROOT)} runs {algorithm}; its name must start with it"


def test_adapter_modules_are_family_names():
    from diffalign.adapters import FAMILIES

    for family in FAMILIES:
        assert (ROOT / "diffalign" / "adapters" / f"{family}.py").is_file(), f"adapters/{family}.py is missing"
