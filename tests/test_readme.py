"""The README is a front page: small, and every path, link and recipe it names exists."""

from __future__ import annotations

import itertools
import re

from tests.helpers.tiny_run import ROOT

README = ROOT / "README.md"
RECIPE_DIRS = tuple(sorted(d.name for d in (ROOT / "configs").iterdir() if d.is_dir() and not d.name.startswith("_")))


def _braces(text: str) -> list[str]:
    """Shell brace expansion of ``a/{b,c}_d`` (one level, several groups)."""
    parts = re.split(r"\{([^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_readme_is_under_12_kb():
    assert README.stat().st_size < 12 * 1024, f"README.md is {README.stat().st_size} bytes"


def test_readme_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README links to {target!r}, which does not exist"


def test_readme_paths_and_recipes_exist():
    checked = 0
    for span in _code_spans(README.read_text()):
        for word in span.split():
            word = word.strip("\"'(),;")
            if "/" not in word or word.startswith(("-", "http", "USER", "data/", "runs/")) or "=" in word:
                continue
            for name in _braces(word.replace("seedS", "seed0")):
                name = name.rstrip("/")
                if name.split("/")[0] in RECIPE_DIRS and not name.startswith("configs/"):
                    candidates = [ROOT / "configs" / name, ROOT / "configs" / f"{name}.yaml"]
                    if name.endswith("_*"):  # a recipe family: sd3/flow_grpo_*
                        candidates = list((ROOT / "configs").glob(name + ".yaml"))
                else:
                    candidates = [ROOT / name]
                assert any(c.exists() for c in candidates), f"README names {name!r} (in `{span}`), which does not exist"
                checked += 1
    assert checked >= 20  # the parser found the README's paths (it cannot pass on an empty match)


def test_hub_commands_in_the_docs_exist_in_the_installed_hub_client():
    """Every ``hf ...`` command the README and docs show parses in the huggingface_hub the setup
    installs (run as a user would, with --help); its retired ``huggingface-cli`` is named nowhere."""
    import subprocess
    import sys
    from pathlib import Path

    hf = Path(sys.executable).parent / "hf"
    docs = [README, ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = set()
    for doc in docs:
        text = doc.read_text()
        assert "huggingface-cli" not in text, f"{doc.name} names huggingface-cli; the command is hf"
        commands |= set(re.findall(r"(?:^|[`(\s])hf ((?:auth|repo|cache) [a-z-]+|[a-z-]+)", text, re.M))
    assert {"auth login", "download"} <= commands  # the parser found them
    for command in sorted(commands):
        done = subprocess.run([str(hf), *command.split(), "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"`hf {command}` is not a command of the installed huggingface_hub: {done.stderr[-500:]}"
