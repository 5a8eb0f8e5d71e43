"""Evaluation of a base model and trained runs: per-family tables with intervals and paired differences.

Two entry points:

- :func:`evaluate_shapes` — the ShapesWorld evaluation. It samples a list built by
  :func:`diffalign.shapes.evaluation_prompts` (``images_per_family`` images per family, prompts
  repeated round-robin) with one fixed seed, scores every image with ShapesEval and returns an
  :class:`Evaluation`: the per-image records, every metric with its stratified bootstrap
  interval over prompts (:mod:`diffalign.stats`), and :meth:`Evaluation.compare` for the paired
  difference against another model evaluated on the same list and seed.
- :func:`evaluate_adapter` — any reward, mean and the reward's own summary, no intervals.

:func:`format_table` prints either kind of result as an aligned text table. :func:`read_run_source`,
:func:`eval_base` and :func:`eval_reward` decide what ``diffalign eval RUN ...`` compares: each
run's own base model and reward, and a refusal where a comparison would pair unrelated models.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

import reward_models
from diffalign import stats
from diffalign.adapters import DEFAULT_ALIASES, model_family
from diffalign.config import native_bf16
from diffalign.config_files import load_config
from diffalign.errors import DiffalignError, RunDirError
from diffalign.images import prompt_from_record, prompt_metadata
from diffalign.runs import read_final_metadata
from diffalign.sampling import sample_images
from diffalign.shapes import FAMILIES, IN_DISTRIBUTION_FAMILIES, evaluation_prompts, prompt_family
from diffalign.stats import Difference, Interval
from reward_models.shapes_eval import ShapesEval

#: bootstrap settings of every evaluation table (see diffalign.stats)
BOOTSTRAP = {"resamples": stats.DEFAULT_RESAMPLES, "seed": stats.DEFAULT_SEED, "level": stats.DEFAULT_LEVEL}

LEGEND = (f"value [lo, hi]: {100 * BOOTSTRAP['level']:g} % stratified bootstrap interval over prompts "
          f"({BOOTSTRAP['resamples']} resamples; prompts drawn within each family, each prompt's images kept together). "
          "Differences are paired (same prompts and seeds, the same resamples for both models); * = 0 lies outside "
          "the interval (outside noise). acc/overall = mean of the family accuracies (GenEval's overall), "
          "acc/images = per-image pass rate, partial = mean partial credit.")


def shapes_records(images: torch.Tensor, prompts: Sequence[str]) -> list[dict]:
    """Per-image ShapesEval records: ``prompt``, ``family``, ``passed`` (bool) and ``score``
    (partial credit, the fraction of the prompt's requirements met; 0 when a gate fails)."""
    return [{"prompt": r["prompt"], "family": r["family"], "passed": bool(r["passed"]), "score": float(r["score"])}
            for r in ShapesEval().evaluate(images, list(prompts))]


@dataclass
class Evaluation:
    """One model's evaluation: per-image records and every metric with its interval."""

    records: list[dict]
    intervals: dict[str, Interval]
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)  # how the images were made (steps, CFG, seed, ...)

    @classmethod
    def from_records(cls, records: Sequence[Mapping], *, seconds: float = 0.0, meta: dict | None = None,
                     **bootstrap) -> "Evaluation":
        records = [dict(r) for r in records]
        return cls(records, stats.bootstrap_intervals(records, **{**BOOTSTRAP, **bootstrap}), seconds, dict(meta or {}))

    @property
    def metrics(self) -> dict[str, float]:
        """Point estimates: ``acc/<family>``, ``acc/overall``, ``acc/images``, ``partial``."""
        return {k: v.value for k, v in self.intervals.items()}

    def compare(self, base: "Evaluation", **bootstrap) -> dict[str, Difference]:
        """``self - base`` for every metric, with the paired bootstrap interval (both must be
        evaluated on the same prompt list and seed)."""
        return stats.paired_difference(base.records, self.records, **{**BOOTSTRAP, **bootstrap})

    def to_json(self) -> dict:
        return {"meta": self.meta, "seconds": self.seconds, "records": self.records,
                "intervals": {k: v.to_dict() for k, v in self.intervals.items()}}


def interval_record(intervals: Mapping[str, Interval], prefix: str = "eval/") -> dict[str, float]:
    """Flat metrics-log keys: ``{prefix}{metric}`` (the point estimate) and ``{prefix}{metric}_lo`` /
    ``_hi`` (the interval)."""
    out: dict[str, float] = {}
    for k, iv in intervals.items():
        out[f"{prefix}{k}"] = iv.value
        out[f"{prefix}{k}_lo"], out[f"{prefix}{k}_hi"] = iv.lo, iv.hi
    return out


def is_bound_key(key: str) -> bool:
    """Whether a metrics-log key is an interval bound written by :func:`interval_record`."""
    return key.endswith(("_lo", "_hi"))


def eval_autocast_dtype(mixed_precision: str, device_type: str = "cpu") -> torch.dtype | None:
    """The denoiser's autocast dtype for evaluation: ``auto`` is bf16 where ``device_type`` computes
    it natively (as a run with ``train.mixed_precision: auto`` evaluates, so the numbers match its
    report), ``bf16`` always, ``no`` is fp32 throughout. Step kernels and scoring stay fp32 either way."""
    if mixed_precision not in ("auto", "bf16", "no"):
        raise DiffalignError(f"--mixed-precision must be auto, bf16 or no, got {mixed_precision!r}")
    use_bf16 = mixed_precision == "bf16" or (mixed_precision == "auto" and native_bf16(device_type))
    return torch.bfloat16 if use_bf16 else None


def maybe_autocast(dtype: torch.dtype | None, device_type: str):
    """``torch.autocast`` to ``dtype`` on ``device_type``, or a no-op context when ``dtype`` is None."""
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def evaluate_shapes(
    adapter,
    prompts: Sequence[str],
    *,
    images_per_family: int | None = 96,
    num_steps: int = 20,
    guidance_scale: float = 4.0,
    resolution: int | None = None,
    seed: int = 1234,
    batch_size: int = 64,
    limit: int = 0,
    autocast_dtype: torch.dtype | None = None,
    show_progress: bool = True,
    **bootstrap,
) -> Evaluation:
    """Sample ShapesWorld prompts with a fixed seed, score each image with ShapesEval and bootstrap.

    ``prompts``: distinct prompts (e.g. ``split_prompts().evaluation()`` for the headline
    evaluation, ``split_prompts().probe`` for the generalisation probe), expanded by
    :func:`~diffalign.shapes.evaluation_prompts` to ``images_per_family`` images per family; with
    ``images_per_family=None`` the list is sampled as given (one image per entry). ``limit`` > 0
    keeps ``limit`` images spread over the families (:func:`shapes_eval_list`; a quick check, not a
    comparable evaluation). Two
    models evaluated with the same arguments see the same noise image by image, so
    :meth:`Evaluation.compare` can pair them. ``autocast_dtype`` (e.g. ``torch.bfloat16``): the
    denoiser's forwards under autocast, as a run with ``train.mixed_precision`` evaluates (step
    kernels and scoring stay fp32). ``show_progress``: a progress bar (a line off a terminal) while
    sampling. ``bootstrap``: ``resamples``, ``seed``, ``level`` of :mod:`diffalign.stats`."""
    items = shapes_eval_list(prompts, images_per_family, limit)
    if not items:
        raise ValueError("no prompts to evaluate")
    resolution = resolution or adapter.default_resolution
    t0 = time.perf_counter()
    with maybe_autocast(autocast_dtype, torch.device(adapter.device).type):
        images = sample_images(adapter, items, num_steps=num_steps, guidance_scale=guidance_scale, resolution=resolution,
                               seed=seed, batch_size=batch_size, progress=f"sampling {len(items)} images" if show_progress else None)
    records = shapes_records(images, items)
    meta = {"num_images": len(items), "images_per_family": images_per_family,
            "images_by_family": dict(Counter(r["family"] for r in records)), "num_steps": num_steps,
            "guidance_scale": guidance_scale, "resolution": resolution, "seed": seed, "batch_size": batch_size,
            "precision": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else "float32"}
    return Evaluation.from_records(records, seconds=time.perf_counter() - t0, meta=meta, **bootstrap)


def shapes_eval_list(prompts: Sequence[str], images_per_family: int | None = 96, limit: int = 0) -> list[str]:
    """The prompt of every image :func:`evaluate_shapes` samples, in order (see its arguments).
    ``limit`` > 0 keeps that many entries spread over the families: the first of each family in
    turn (each family's first, then each one's second, ...), in the order of the whole list."""
    items = evaluation_prompts(prompts, images_per_family) if images_per_family is not None else list(prompts)
    if not limit or limit >= len(items):
        return items
    by_family: dict[str, list[int]] = {}
    for i, p in enumerate(items):
        by_family.setdefault(prompt_family(p), []).append(i)
    taken = [i for rank in zip_longest(*by_family.values()) for i in rank if i is not None][:limit]
    return [items[i] for i in sorted(taken)]


def describe_families(items: Sequence[str], images_per_family: int | None = 96) -> str:
    """The images per family a ShapesEval list holds, as sampled: ``2 per family x 6 families``
    for a whole list, else each family's count (``single_object 2 of 96``: a list cut short by a
    limit, or ``images_per_family=None``: the list as given)."""
    counts = Counter(prompt_family(p) for p in items)
    if images_per_family is not None and set(counts.values()) == {images_per_family}:
        return f"{images_per_family} per family x {len(counts)} {'family' if len(counts) == 1 else 'families'}"
    of = f" of {images_per_family}" if images_per_family is not None else ""
    return ", ".join(f"{family} {counts[family]}{of}" for family in (*FAMILIES, *sorted(set(counts) - set(FAMILIES)))
                     if counts[family])


def evaluate_adapter(
    adapter,
    prompts: Sequence[str],
    *,
    reward: str = "shapes_eval",
    reward_kwargs: dict | None = None,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    resolution: int | None = None,
    seed: int = 1234,
    samples_per_prompt: int = 1,
    batch_size: int = 32,
    extra_rewards: Mapping[str, tuple[str, dict]] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Sample every prompt ``samples_per_prompt`` times with a fixed seed and score it (any reward;
    no intervals: :func:`evaluate_shapes` is the ShapesWorld evaluation with them).

    Returns ``{"reward_mean": ..., **reward.last_info}`` (for ShapesEval: ``acc/<family>``
    and ``acc/overall``), plus ``{label: mean}`` for every ``label: (reward, kwargs)`` of
    ``extra_rewards``, scored on the same images (e.g. ShapesEval with partial credit)."""
    fn = reward_models.build(reward, device=str(adapter.device), **(reward_kwargs or {}))
    extra = {label: (name, reward_models.build(name, device=str(adapter.device), **(kw or {})))
             for label, (name, kw) in (extra_rewards or {}).items()}
    all_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    with maybe_autocast(autocast_dtype, torch.device(adapter.device).type):
        images = sample_images(adapter, all_prompts, num_steps=num_steps, guidance_scale=guidance_scale,
                               resolution=resolution or adapter.default_resolution, seed=seed, batch_size=batch_size,
                               progress=f"sampling {len(all_prompts)} images")
    metadata = prompt_metadata(all_prompts)
    scores = reward_models.check_reward_output(reward, reward_models.call_reward(fn, images, all_prompts, metadata), len(all_prompts))
    out = {"reward_mean": float(scores[torch.isfinite(scores)].mean())}
    out.update({k: float(v) for k, v in (getattr(fn, "last_info", None) or {}).items()})
    for label, (name, extra_fn) in extra.items():
        s = reward_models.check_reward_output(name, reward_models.call_reward(extra_fn, images, all_prompts, metadata), len(all_prompts))
        out[label] = float(s[torch.isfinite(s)].mean())
    return out


# --------------------------------------------------------------------------------------------
# What `diffalign eval RUN ...` compares
# --------------------------------------------------------------------------------------------

SHAPES_FAMILY = "shapes"  # the model family ShapesEval can score (ShapesWorld images)


@dataclass(frozen=True)
class RunSource:
    """What a finished run directory was trained from, read from its files (no model loads)."""

    name: str  # the run directory's name: its column in the tables
    path: Path
    base: str  # model.id: the base model its final/ weights apply to
    family: Optional[str]  # the base's model family; None: a hub id whose family was not recorded
    reward: str  # reward.name
    reward_kwargs: dict
    eval_prompts: list[str]  # the eval prompts as resolved when the run started (prompts.json); [] if absent


def read_run_source(run_dir: str | Path) -> RunSource:
    """A run directory's :class:`RunSource`, from ``config.yaml``, ``final/diffalign.json`` and
    ``prompts.json``; a RunDirError when it does not exist or has no final weights."""
    path = Path(run_dir)
    if not path.exists():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    meta = read_final_metadata(path)
    cfg = load_config(path / "config.yaml")
    family = meta.get("family") or model_family(cfg.model.id, cfg.model.family)
    prompts_file = path / "prompts.json"
    records = json.loads(prompts_file.read_text()).get("eval", []) if prompts_file.is_file() else []
    eval_prompts = [p for p in map(prompt_from_record, records) if p is not None]  # editing prompts keep their images
    return RunSource(path.name, path, cfg.model.id, family, cfg.reward.name, dict(cfg.reward.kwargs), eval_prompts)


def same_model(a: str, b: str) -> bool:
    """Whether two model ids name the same model: equal ids, the two names of the shipped model,
    or two paths to one folder."""
    def key(model_id: str) -> str:
        if model_id in DEFAULT_ALIASES:
            return DEFAULT_ALIASES[0]
        path = Path(model_id).expanduser()
        return str(path.resolve()) if path.exists() else model_id

    return key(a) == key(b)


def eval_base(runs: Sequence[RunSource], base: str | None) -> str:
    """The model of the base column: ``base`` when given, else the base the runs were trained
    from (the shipped shapes model without runs). A run trained from another base is refused: its
    paired difference against the base column would compare unrelated models."""
    if base is None:
        if any(not same_model(r.base, runs[0].base) for r in runs):
            listing = ", ".join(f"{r.name!r} ({r.base})" for r in runs)
            raise DiffalignError(f"the runs have different base models: {listing}; evaluate each base's runs "
                                 "separately, or give --no-base")
        return runs[0].base if runs else DEFAULT_BASE
    for r in runs:
        if not same_model(r.base, base):
            raise DiffalignError(f"run {r.name!r} was trained from {r.base!r}, not from --base {base!r}: its difference "
                                 f"against the base would compare unrelated models; give --base {r.base} or --no-base")
    return base


DEFAULT_BASE = "shapes"  # the base column without runs: the shipped model
DEFAULT_REWARD = "shapes_eval"  # the reward without runs: ShapesEval with intervals and paired differences


def eval_reward(runs: Sequence[RunSource], reward: str | None) -> tuple[str, dict]:
    """``(reward, kwargs)`` to score with: ``reward`` when given, else the reward the runs were
    trained on (ShapesEval without runs); kwargs are the runs' when they all trained on that reward
    with the same ones. Runs trained on different rewards need an explicit ``reward``."""
    trained = {(r.reward, json.dumps(r.reward_kwargs, sort_keys=True, default=str)) for r in runs}
    if reward is None:
        if not runs:
            return DEFAULT_REWARD, {}
        if len(trained) > 1:
            listing = ", ".join(f"{r.name!r} ({r.reward})" for r in runs)
            raise DiffalignError(f"the runs were trained on different rewards: {listing}; give --reward NAME to score them all with one")
        return runs[0].reward, dict(runs[0].reward_kwargs)
    return reward, dict(runs[0].reward_kwargs) if len(trained) == 1 and runs[0].reward == reward else {}


def check_shapes_eval(base: str | None, base_family: str | None, runs: Sequence[RunSource]) -> None:
    """ShapesEval scores ShapesWorld images only: refuse a base column (``base``, None without
    one) or a run whose model is not a ShapesWorld model, naming it and its base (a run first)."""
    for r in runs:
        if r.family != SHAPES_FAMILY:
            raise DiffalignError(f"ShapesEval scores ShapesWorld images, and run {r.name!r} is based on {r.base!r}, a "
                                 f"{r.family or 'hub'} model: give --reward NAME (it was trained on {r.reward})")
    if base is not None and base_family != SHAPES_FAMILY:
        raise DiffalignError(f"ShapesEval scores ShapesWorld images, and the base {base!r} is a {base_family or 'hub'} "
                             "model: give --reward NAME")


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

_LAST = ("acc/images", "partial", "reward_mean", "acc/overall")


def metric_order(keys: Sequence[str]) -> list[str]:
    """Rows of a table: family accuracies in :data:`~diffalign.shapes.FAMILIES` order, other keys
    alphabetically, then ``acc/images``, ``partial``, ``reward_mean`` and ``acc/overall`` last."""
    fams = [f"acc/{f}" for f in FAMILIES]
    return ([k for k in fams if k in keys] + sorted(k for k in keys if k not in fams and k not in _LAST)
            + [k for k in _LAST if k in keys])


def metric_label(key: str) -> str:
    """The row label of a metric: families of :data:`~diffalign.shapes.IN_DISTRIBUTION_FAMILIES`
    (every prompt of them trains; evaluated on fresh seeds) are marked ``(in-distribution)``."""
    if key.startswith("acc/") and key[4:] in IN_DISTRIBUTION_FAMILIES:
        return f"{key} (in-distribution)"
    return key


def format_cell(value) -> str:
    """``0.500`` (a number), ``0.198 [0.158, 0.243]`` (an Interval), ``+0.030 [+0.003, +0.061] *``
    (a paired Difference outside noise), ``-`` (missing)."""
    if value is None:
        return "-"
    if isinstance(value, Interval):
        return value.format()
    return f"{float(value):.3f}"


def format_table(columns: Mapping[str, Mapping[str, float | Interval]]) -> str:
    """Rows = metrics (union of keys, :func:`metric_order`), columns = models (or paired
    differences), in the given order. Cells: see :func:`format_cell`. Plain text, aligned."""
    keys: list[str] = []
    for col in columns.values():
        keys += [k for k in col if k not in keys]
    keys = metric_order(keys)
    names = list(columns)
    cells = {n: [format_cell(columns[n].get(k)) for k in keys] for n in names}
    labels = [metric_label(k) for k in keys]
    width = max([len(x) for x in labels] + [6])
    colw = [max([len(n), 8] + [len(c) for c in cells[n]]) for n in names]
    lines = [" " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, colw))]
    for i, label in enumerate(labels):
        lines.append(label.ljust(width) + "  " + "  ".join(cells[n][i].rjust(w) for n, w in zip(names, colw)))
    return "\n".join(lines)


def comparison_columns(evaluations: Mapping[str, Evaluation], base: str | None = None) -> dict[str, dict]:
    """Table columns for :func:`format_table`: each evaluation's intervals, and after every
    non-base one its paired difference against ``base`` (column ``"<name> - <base>"``)."""
    columns: dict[str, dict] = {}
    for name, ev in evaluations.items():
        columns[name] = ev.intervals
        if base is not None and name != base:
            columns[f"{name} - {base}"] = ev.compare(evaluations[base])
    return columns
