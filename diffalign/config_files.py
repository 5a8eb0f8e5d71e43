"""Reading a run config: YAML files, ``dotted.key=value`` overrides, type coercion, dumping.

:func:`load_config` is the one way a run's :class:`~diffalign.config.RunConfig` is made: the YAML
file, then the overrides, then every value coerced to its field's type and validated, with errors
that name the key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import sys
import types
import typing
from typing import Any, Literal, Union

import yaml

from diffalign import recipes
from diffalign.config import AlgorithmConfig, RunConfig
from diffalign.errors import ConfigError
from diffalign.shipped import config_file


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check / convert ``value`` to the annotated type ``tp``; errors name ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"config key '{key}' has an invalid value {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and ("no" if not value else "yes") in args:
            value = "no" if not value else "yes"  # YAML 1.1 reads a bare no / yes as a boolean
        if value not in args:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list; got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping; got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer; got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads "1e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"config key '{key}' must be a number; got {value!r}")
        if not math.isfinite(number):  # nan / inf would pass every range check below and poison the run
            raise ConfigError(f"config key '{key}' must be a finite number; got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string; got {value!r}")
    return value


def from_dict(cls, data: Any, prefix: str = ""):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys (named in the error)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix or '<root>'}' must be a mapping; got {data!r}")
    if cls is AlgorithmConfig or (prefix == "algorithm" and issubclass(cls, AlgorithmConfig)):
        cls = recipes.config_class(data.get("name", recipes.DEFAULT))
    if isinstance(cls, type) and issubclass(cls, AlgorithmConfig) and cls.renamed_keys:
        data = _renamed(data, cls.renamed_keys, prefix)
    hints = typing.get_type_hints(cls)
    names = {yaml_key(f) for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            full = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"unknown config key '{full}' (known in this section: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = yaml_key(f)
        if key in data:
            full = f"{prefix}.{key}" if prefix else key
            kwargs[f.name] = _coerce(data[key], hints[f.name], full)
    return cls(**kwargs)


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and overrides: its name, or ``metadata["key"]`` where the name cannot be
    the key (``reward.async`` is the field ``async_``: ``async`` is a Python keyword)."""
    return f.metadata.get("key", f.name)


# keys that moved to another section: old dotted key -> new dotted key (load with a one-line notice)
MOVED_KEYS = {"rollout.overlap_rewards": "reward.async"}


def _moved(data: dict, warn: bool = True) -> dict:
    """``data`` (a run config mapping) with each key of :data:`MOVED_KEYS` at its new place
    (``warn``: with the one-line notice a user's config gets; a run's own saved config, written by
    an older version, is upgraded without one)."""
    for old, new in MOVED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = data.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = data.get(new_section)
        if target is None:
            target = data[new_section] = {}
        if not isinstance(target, dict):
            continue  # from_dict names the malformed section
        if new_key in target:
            raise ConfigError(f"config key '{old}' is the old name of '{new}'; give only '{new}'")
        if warn:
            print(f"warning: config key '{old}' is deprecated; it is now called '{new}'", file=sys.stderr)
        data[old_section] = {k: v for k, v in section.items() if k != old_key}
        data[new_section] = {**target, new_key: section[old_key]}
    return data


def upgraded(saved: dict) -> dict:
    """A copy of a saved run config mapping (a checkpoint's, a run's config.yaml) with the keys an
    older version wrote under their current names, silently: comparing it with today's config shows
    only real changes."""
    return _moved({k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}, warn=False)


def _renamed(data: dict, renamed: dict[str, str], prefix: str) -> dict:
    """``data`` with each old key of ``renamed`` under its current name, and a one-line notice."""
    data = dict(data)
    for old, new in renamed.items():
        if old in data:
            full = f"{prefix}.{old}" if prefix else old
            if new in data:
                raise ConfigError(f"config key '{full}' is the old name of '{new}'; give only '{new}'")
            print(f"warning: config key '{full}' is deprecated; it is now called '{new}'", file=sys.stderr)
            data[new] = data.pop(old)
    return data


def to_dict(cfg) -> dict:
    """The config as plain data, under the keys YAML uses (:func:`yaml_key`); loads back with :func:`from_dict`."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {yaml_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return copy.deepcopy(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


_INDEXED = re.compile(r"^(.+)\[(\d+)\]$")  # "teachers[1]": an entry of a list of sections


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``dotted.key=value``; a key part ``name[i]`` reaches into entry i of a list of
    sections (``algorithm.teachers[1].model=...``)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for n, part in enumerate(path):
            last = n == len(path) - 1
            indexed = _INDEXED.match(part)
            if indexed:
                name, i = indexed.group(1), int(indexed.group(2))
                entries = node.get(name)
                if not isinstance(entries, list) or i >= len(entries):
                    raise ConfigError(f"override {text!r}: '{name}' has no entry {i}")
                if last:
                    entries[i] = value
                    break
                if not isinstance(entries[i], dict):
                    raise ConfigError(f"override {text!r}: '{part}' is not a section")
                node = entries[i]
                continue
            if last:
                node[part] = value
                break
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            node = node[part]
    return data


# keys every accelerate launcher config has (`accelerate config` writes them; configs/accelerate/ ships some)
# and no training recipe has
LAUNCHER_KEYS = frozenset({"compute_environment", "distributed_type"})


def read_yaml(path: str | os.PathLike) -> dict:
    """The mapping in a config file; ``path`` may also name a shipped recipe (``shapes/flow_grpo``,
    see :func:`diffalign.shipped.config_file`: a file that exists wins)."""
    p = config_file(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not a text (UTF-8) file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {problem}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    if data is None:
        raise ConfigError(f"config file {str(p)!r} is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    if LAUNCHER_KEYS & set(data):
        raise ConfigError(f"config file {str(p)!r} is a launcher config, not a training recipe: use it with accelerate "
                          f"launch --config_file {p} -m diffalign.cli train CONFIG (docs/distributed.md)")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """YAML file or shipped recipe name (optional) + ``key=value`` overrides -> validated :class:`RunConfig`."""
    data = dict(base or {})
    if path is not None:
        data.update(read_yaml(path))
    data = _moved(apply_overrides(data, list(overrides)))
    cfg = from_dict(RunConfig, data)
    cfg.validate()
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
