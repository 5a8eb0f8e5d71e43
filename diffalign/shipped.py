"""The recipes shipped with diffalign, found by name: run configs and accelerate launch configs.

A recipe's name is its path under the checkout's ``configs/`` without ``.yaml``: ``shapes/flow_grpo``,
``tiny/flow_grpo_sd3``, ``accelerate/ddp``. A wheel installs that same folder as the package
``diffalign._configs`` (pyproject.toml maps it), and an editable install points that package at
``configs/`` itself, so one copy of each file serves a checkout and a pip install alike.

:func:`config_file` is how every command that reads a run config turns its argument into a file: a
path that exists wins; otherwise the argument is taken as a recipe name (``shapes/flow_grpo``,
``shapes/flow_grpo.yaml`` and ``configs/shapes/flow_grpo.yaml`` name the same recipe).
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from diffalign.errors import ConfigError

CONFIGS_PACKAGE = "diffalign._configs"  # the checkout's configs/ (pyproject.toml: package-dir)
SUFFIX = ".yaml"
MAX_SUGGESTIONS = 4  # close matches named in an error
COMMAND_PREFIXES = ("accelerate ", "diffalign ")  # a leading comment line that shows how to run the file
# recipes that were renamed: old name -> current name (each still loads, with a one-line notice)
RENAMED = {
    "sd15/ddpo_aesthetic": "sd15/flow_grpo_ddim_aesthetic",
    "sdxl/ddpo_pickscore": "sdxl/flow_grpo_ddim_pickscore",
    "tiny/ddpo_sd15": "tiny/flow_grpo_ddim_sd15",
    "tiny/ddpo_sdxl": "tiny/flow_grpo_ddim_sdxl",
}


@dataclass(frozen=True)
class Recipe:
    """One shipped YAML file. ``name``: its path under ``configs/`` without ``.yaml``."""

    name: str
    path: Path

    @property
    def description(self) -> str:
        """The first sentence of the file's opening comment, joined across its lines: a leading line
        that shows the launch command is skipped, and the paragraph ends at a blank or indented
        comment line (a list or table follows); empty when the file opens without a comment."""
        words: list[str] = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            text = line[1:].strip()
            if not line.startswith("#") or (words and (not text or line.startswith("#  "))):
                break
            if text and (words or not text.startswith(COMMAND_PREFIXES)):
                words.append(text)
        return first_sentence(" ".join(words))


ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "et al.")  # a full stop that ends no sentence


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (up to a full stop, ! or ? followed by a space, not one of
    :data:`ABBREVIATIONS`); a trailing colon, which introduced what followed it, becomes a full stop."""
    for match in re.finditer(r"[.!?](?=\s)", text):
        if not text[: match.end()].endswith(ABBREVIATIONS):
            text = text[: match.end()]
            break
    return text[:-1] + "." if text.endswith(":") else text


def root() -> Path:
    """The folder that holds the shipped recipes (``configs/`` in a checkout)."""
    # pip installs wheels unzipped, so the package's files are plain files on disk
    return Path(str(importlib.resources.files(CONFIGS_PACKAGE)))


def available() -> list[Recipe]:
    """Every shipped recipe, sorted by name."""
    base = root()
    return [Recipe(p.relative_to(base).with_suffix("").as_posix(), p) for p in sorted(base.rglob(f"*{SUFFIX}"))]


def normalise(name: str) -> str:
    """``configs/shapes/flow_grpo.yaml`` -> ``shapes/flow_grpo``: the spellings of a recipe's name."""
    name = str(name).replace("\\", "/").strip()
    name = name.removeprefix("./").removeprefix("configs/")
    return name.removesuffix(SUFFIX)


def close_matches(name: str, names: list[str]) -> list[str]:
    """Names a mistyped ``name`` probably meant: same file name in another folder first, then the
    names most alike by :func:`difflib.get_close_matches`."""
    wanted = normalise(name)
    leaf = wanted.rsplit("/", 1)[-1]
    same_leaf = [n for n in names if n.rsplit("/", 1)[-1] == leaf]
    alike = difflib.get_close_matches(wanted, names, n=MAX_SUGGESTIONS, cutoff=0.6)
    alike_leaf = difflib.get_close_matches(leaf, [n.rsplit("/", 1)[-1] for n in names], n=MAX_SUGGESTIONS, cutoff=0.75)
    by_leaf = [n for n in names if n.rsplit("/", 1)[-1] in alike_leaf]
    return list(dict.fromkeys(same_leaf + alike + by_leaf))[:MAX_SUGGESTIONS]


def _hint(name: str, names: list[str]) -> str:
    matches = close_matches(name, names)
    close = f"close matches: {', '.join(matches)}; " if matches else ""
    return f"{close}`diffalign recipes` lists them all"


def current_name(name: str) -> str:
    """``name`` normalised, and under its current name (with a notice on stderr) when it was renamed."""
    wanted = normalise(name)
    if wanted in RENAMED:
        print(f"warning: the recipe {wanted!r} is now called {RENAMED[wanted]!r}; the old name is deprecated",
              file=sys.stderr)
        return RENAMED[wanted]
    return wanted


def find(name: str) -> Recipe:
    """The shipped recipe called ``name`` (any spelling :func:`normalise` accepts).

    Raises:
        ConfigError: no recipe has that name; the message names the close matches.
    """
    recipes = {r.name: r for r in available()}
    recipe = recipes.get(current_name(name))
    if recipe is None:
        raise ConfigError(f"unknown recipe {name!r}; {_hint(name, list(recipes))}")
    return recipe


def config_file(path_or_name: str | Path) -> Path:
    """The YAML file a command should read for its CONFIG argument: the path itself when it exists
    (a folder too, so that the reader can say it is one), else the shipped recipe of that name.

    Raises:
        ConfigError: neither a path that exists nor a recipe; the message names the close matches.
    """
    path = Path(path_or_name)
    if path.exists():
        return path
    if path.is_absolute():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    recipes = {r.name: r for r in available()}
    recipe = recipes.get(current_name(str(path_or_name)))
    if recipe is not None:
        return recipe.path
    raise ConfigError(f"config file {str(path_or_name)!r} does not exist and names no shipped recipe; "
                      f"{_hint(str(path_or_name), list(recipes))}")


def data_file(path: str | Path) -> Path:
    """A data file a shipped recipe names (a prompt file, say ``configs/tiny/edit/prompts.jsonl``):
    the path itself when it exists, so a checkout or the user's own file wins; else a relative path
    under ``configs/`` names the file shipped there, which a pip install has too. Any other path is
    returned as given (the reader says it does not exist)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    parts = p.as_posix().removeprefix("./").split("/", 1)
    if parts[0] == "configs" and len(parts) == 2 and (root() / parts[1]).exists():
        return root() / parts[1]
    return p
