"""Training and evaluation prompts: which prompts a run uses, and the order it visits them in.

:func:`resolve_prompts` turns ``cfg.prompts`` (ShapesWorld's split, an inline list or prompt files)
into (train, eval) lists; :func:`read_prompt_file` reads plain text, ``.jsonl``, ``.csv``,
``.parquet`` and ``datasets`` folders; :class:`PromptSampler` cycles through the train prompts in a fresh
random order every epoch, deterministic per seed, with ``state_dict`` for exact resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from diffalign import shipped
from diffalign.config import RunConfig
from diffalign.errors import ConfigError
from diffalign.images import ImagePrompt, load_rgb
from diffalign.shapes import prompt_family, split_prompts, validation_split


class PromptSampler:
    """Cycles through the prompts in a fresh random order every epoch; deterministic per seed."""

    def __init__(self, prompts: Sequence[str], seed: int):
        if not prompts:
            raise ConfigError("config key 'prompts' yields no training prompts")
        self.prompts = list(prompts)
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(self.prompts))
        self.pos = 0
        self.epoch = 0

    def next(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.pos == len(self.order):
                self.order = self.rng.permutation(len(self.prompts))
                self.pos = 0
                self.epoch += 1
            out.append(self.prompts[self.order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])
        self.pos = state["pos"]
        self.epoch = state["epoch"]


def resolve_prompts(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts) from ``cfg.prompts``."""
    p = cfg.prompts
    if p.source == "shapes":
        split = split_prompts()
        train, heldout = validation_split(split) if p.evaluate_on == "validation" else (split.train, split.evaluation())
        families = {prompt_family(x) for x in train}
        if p.families:
            unknown = sorted(set(p.families) - {prompt_family(x) for x in train + heldout})
            if unknown:
                raise ConfigError(f"config key 'prompts.families' has unknown families: {', '.join(unknown)}")
            train = [x for x in train if prompt_family(x) in p.families]
            heldout = [x for x in heldout if prompt_family(x) in p.families]
        if p.balance_families:
            # Repeat each family's prompts up to the largest family's count (times its weight), so
            # that an epoch of the prompt sampler visits every family about equally often (or in
            # proportion to prompts.family_weights).
            by_family: dict[str, list[str]] = {}
            for x in train:
                by_family.setdefault(prompt_family(x), []).append(x)
            unknown = sorted(set(p.family_weights) - families)  # weights of families left out by prompts.families go unused
            if unknown:
                raise ConfigError(f"config key 'prompts.family_weights' names families without training prompts: "
                                  f"{', '.join(unknown)} (known: {', '.join(sorted(families))})")
            largest = max(len(v) for v in by_family.values())
            train = [v[i % len(v)] for f, v in by_family.items()
                     for i in range(max(1, round(largest * p.family_weights.get(f, 1))))]
        return train, heldout
    if p.source == "list":
        return list(p.train), list(p.eval or p.train)
    columns = dict(column=p.column, image_column=p.image_column)
    train = read_prompt_file(p.file, split=p.split, key="prompts.file", **columns)
    if p.eval_file:
        return train, read_prompt_file(p.eval_file, split=p.split, key="prompts.eval_file", **columns)
    if p.eval_split:
        if not shipped.data_file(p.file).is_dir():
            raise ConfigError("config key 'prompts.eval_split' applies to a datasets folder in prompts.file (use prompts.eval_file)")
        return train, read_prompt_file(p.file, split=p.eval_split, key="prompts.eval_split", **columns)
    if p.eval_fraction:
        return split_eval_fraction(train, p.eval_fraction)
    return train, train


def split_eval_fraction(prompts: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, eval): a fixed random ``fraction`` of the distinct prompts (at least one, seed 0, the
    same whatever the run's seed) is held out for evaluation; the rest, in file order, trains."""
    distinct = list(dict.fromkeys(prompts))
    if len(distinct) < 2:
        raise ConfigError("config key 'prompts.eval_fraction' needs at least two distinct prompts in prompts.file")
    n_eval = min(len(distinct) - 1, max(1, round(fraction * len(distinct))))
    held = {distinct[i] for i in np.random.default_rng(0).permutation(len(distinct))[:n_eval]}
    return [x for x in prompts if x not in held], [x for x in distinct if x in held]


#: prompt file suffixes with a text column (a folder is a Hugging Face datasets folder; anything
#: else is read as plain text, one prompt per line)
TABLE_SUFFIXES = (".jsonl", ".csv", ".parquet")


def read_prompt_file(path: str, *, column: str = "prompt", split: str = "train", key: str = "prompts.file",
                     image_column: str | None = None) -> list[str]:
    """The prompts of ``path``, in order: plain text (one per line, blank lines skipped), ``.jsonl``
    (one JSON object per line), ``.csv`` (with a header row), ``.parquet``, or a folder written by
    ``datasets``' ``save_to_disk`` (a ``DatasetDict`` is read at ``split``); for all but plain text
    the values of ``column``. With ``image_column`` (tables only) each prompt is an
    :class:`~diffalign.images.ImagePrompt` whose source image is that column's path, relative to
    the file's folder (a datasets folder: to itself), and every image is read here. Errors are
    one-line ``ConfigError`` naming ``key`` and the file (and the row, for a bad image)."""
    f = shipped.data_file(path)
    where = f"config key '{key}': {path!r}"
    if not f.exists():
        raise ConfigError(f"{where} does not exist")
    if not f.is_dir() and f.suffix.lower() not in TABLE_SUFFIXES:
        if image_column is not None:
            raise ConfigError(f"config key 'prompts.image_column': {path!r} is plain text (one prompt per line); "
                              "source images need a .jsonl, .csv, .parquet or datasets file")
        lines = [line.strip() for line in f.read_text().splitlines() if line.strip()]
        if not lines:
            raise ConfigError(f"{where}: the prompt file is empty")
        return lines

    def read(name: str, field_key: str) -> tuple[list, list[str] | None]:
        if f.is_dir():
            return _read_datasets_folder(f, name, split, key, where)
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            return _read_jsonl(f, name, where, field_key)
        return _read_csv(f, name) if suffix == ".csv" else _read_parquet(f, name, where)

    values, columns = read(column, "prompts.column")
    images = None
    for field_key, name in [("prompts.column", column)] + ([("prompts.image_column", image_column)] if image_column else []):
        if columns is not None and name not in columns:
            raise ConfigError(f"config key '{field_key}': column {name!r} is not in {path!r} "
                              f"(columns: {', '.join(map(str, columns)) or 'none'})")
    if image_column is not None:
        images, _ = read(image_column, "prompts.image_column")
    prompts = []
    for row, value in enumerate(values, start=1):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: row {row} of column {column!r} is not text ({type(value).__name__}: {value!r:.60})")
        if value.strip():
            text = value.strip()
            prompts.append(text if images is None else ImagePrompt(text, _source_image(f, images[row - 1], row, where)))
    if not prompts:
        raise ConfigError(f"{where}: no prompts (the file is empty or column {column!r} holds only empty text)")
    return prompts


def _source_image(f: Path, value, row: int, where: str) -> Path:
    """The absolute path of row ``row``'s source image ``value`` (relative to the prompt file's
    folder, or to a datasets folder itself), after reading the image whole."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: row {row} has no source image path in prompts.image_column (got {value!r:.60})")
    image = Path(value.strip()).expanduser()
    if not image.is_absolute():
        image = (f if f.is_dir() else f.parent) / image
    if not image.is_file():
        raise ConfigError(f"{where}: row {row}: source image {value!r} does not exist ({str(image)!r})")
    try:
        load_rgb(image)
    except Exception as exc:  # PIL raises several error types for unreadable or damaged files
        raise ConfigError(f"{where}: row {row}: source image {value!r} cannot be read ({type(exc).__name__}: {exc})") from None
    return image.resolve()


def jsonl_objects(f: Path, where: str, error: type[Exception] = ConfigError) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every non-empty line of a JSON-lines file; a line that is not
    a JSON object raises ``error`` with a one-line message starting with ``where``."""
    import json

    for n, line in enumerate(f.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise error(f"{where}: line {n} is not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: line {n} is not a JSON object")
        yield n, obj


def _read_jsonl(f: Path, column: str, where: str, field_key: str = "prompts.column") -> tuple[list, None]:
    """Values of ``column``, line by line (each line is checked for the key: no column list);
    ``field_key`` is the config key a missing key is reported under."""
    values = []
    for n, obj in jsonl_objects(f, where):
        if column not in obj:
            raise ConfigError(f"config key '{field_key}': line {n} of {str(f)!r} has no {column!r} "
                              f"(keys: {', '.join(obj) or 'none'})")
        values.append(obj[column])
    return values, None


def _read_csv(f: Path, column: str) -> tuple[list, list[str]]:
    import csv

    with f.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        if column not in columns:
            return [], columns
        return [row[column] for row in reader], columns


def _read_parquet(f: Path, column: str, where: str) -> tuple[list, list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{where}: reading .parquet needs pyarrow (pip install pyarrow, or pip install -e '.[data]')") from None
    try:
        table = pq.read_table(f)
    except Exception as exc:  # pyarrow raises its own error types for a damaged file
        raise ConfigError(f"{where}: cannot read the parquet file ({type(exc).__name__}: {exc})") from None
    columns = table.column_names
    return (table.column(column).to_pylist() if column in columns else []), columns


def _read_datasets_folder(f: Path, column: str, split: str, key: str, where: str) -> tuple[list, list[str]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{where} is a folder: reading a datasets folder needs the datasets package "
                          "(pip install datasets, or pip install -e '.[data]')") from None
    try:
        data = datasets.load_from_disk(str(f))
    except FileNotFoundError as exc:
        raise ConfigError(f"{where} is a folder but not one written by datasets' save_to_disk ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(f"config key '{'prompts.eval_split' if key == 'prompts.eval_split' else 'prompts.split'}': "
                              f"split {split!r} is not in {str(f)!r} (splits: {', '.join(data)})")
        data = data[split]
    elif key == "prompts.eval_split":
        raise ConfigError(f"config key 'prompts.eval_split': {str(f)!r} holds one dataset, not a DatasetDict with splits")
    columns = list(data.column_names)
    return (data[column] if column in columns else []), columns


def resolve_probe_prompts(cfg: RunConfig) -> list[str]:
    """The generalisation probe's prompts (``split_prompts().probe``, restricted to
    ``prompts.families`` when set) for ``prompts.source: shapes`` with ``eval.probe``; else [] (also
    when tuning on validation prompts: the probe informs no choice)."""
    if cfg.prompts.source != "shapes" or not cfg.eval.probe or cfg.prompts.evaluate_on == "validation":
        return []

    probe = split_prompts().probe
    return [x for x in probe if prompt_family(x) in cfg.prompts.families] if cfg.prompts.families else list(probe)
