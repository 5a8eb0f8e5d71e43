"""Each model at its validation-best classifier-free guidance scale, and two such models compared.

CFG itself sharpens a ShapesWorld model: the shipped one passes more validation images at CFG 1.5-2
than at the recipes' CFG 4, by about as much as RL gains at CFG 4. A trained model therefore
counts against its base only when each is sampled at its own best scale, chosen on prompts that
the final number never sees:

1. :func:`evaluate_best_scale` evaluates ShapesEval on the validation prompts
   (``prompt_set("validation")``, carved from the training split) at every scale of a grid, every
   scale with the same seed (image ``i`` starts from the same noise everywhere);
2. :func:`choose_scale` picks the scale with the highest per-image pass rate (``acc/images``;
   ties: the lower scale, the milder intervention);
3. the held-out prompts are evaluated at the chosen scale: that is the model's number.

:func:`compare_best_scales` pairs two results (trained at its chosen scale, base at its own) image
by image with :meth:`~diffalign.evaluation.Evaluation.compare`: the paired 95 % bootstrap interval
over prompts, and the verdict "outside noise" when it excludes 0, else "within noise". Both
held-out evaluations sample the same list with the same seed, so the pairing holds even when the
chosen scales differ (the same noise, another guidance).

Every evaluation may be stored in a folder (:func:`cached_evaluation`): one JSON per prompt set
and scale, written atomically, read back instead of sampling again (an interrupted sweep resumes),
and refused in one line when it was stored with other settings (model, steps, seed, precision,
scale or image list).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence

import torch

from diffalign.config import BEST_SCALE_GRID, BEST_SCALE_VALIDATION_IMAGES, scale_grid_problem
from diffalign.errors import DiffalignError
from diffalign.evaluation import Evaluation, evaluate_shapes, shapes_eval_list
from diffalign.runs import atomic_write_text
from diffalign.stats import Difference

HEADLINE = "acc/images"  # the metric the scale is chosen on and the comparison states: the per-image pass rate
DEFAULT_SCALES = BEST_SCALE_GRID  # the grid (diffalign.config: why these)
DEFAULT_VALIDATION_IMAGES_PER_FAMILY = BEST_SCALE_VALIDATION_IMAGES  # at each scale (diffalign.config: why 48)


def scale_text(scale: float) -> str:
    """``1.5``, ``2``: a scale as tables, file names and JSON keys write it."""
    return f"{float(scale):g}"


def check_scales(scales: Sequence[Any], name: str) -> list[float]:
    """The grid sorted, as floats; a DiffalignError naming ``name`` (the flag or config key) unless
    it holds at least two distinct finite scales, each >= 1 (:func:`diffalign.config.scale_grid_problem`)."""
    try:
        values = [float(s) for s in scales]
    except (TypeError, ValueError):
        raise DiffalignError(f"{name} must be CFG scales (numbers), got {list(scales)!r}") from None
    problem = "must hold finite CFG scales" if not all(map(math.isfinite, values)) else scale_grid_problem(values)
    if problem:
        raise DiffalignError(f"{name} {problem}")
    return sorted(values)


def parse_scales(text: str, name: str = "--scales") -> list[float]:
    """``"1,1.5,2"`` -> ``[1.0, 1.5, 2.0]``, checked by :func:`check_scales`."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DiffalignError(f"{name} must be comma-separated CFG scales, e.g. 1,1.5,2,3,4; got {text!r}") from None
    return check_scales(values, name)


def choose_scale(rates: Mapping[Any, float]):
    """The key of ``rates`` (a scale, or its text) with the highest rate; ties go to the lower scale."""
    if not rates:
        raise ValueError("no scales to choose from")
    return max(rates, key=lambda k: (rates[k], -float(k)))


# --------------------------------------------------------------------------------------------
# Stored evaluations
# --------------------------------------------------------------------------------------------


def _first_difference(stored: Mapping, expected: Mapping) -> str | None:
    for key, value in expected.items():
        if stored.get(key) != value:
            return f"{key}: stored {stored.get(key)!r}, now {value!r}"
    return None


def _list_difference(stored: Sequence[str], now: Sequence[str]) -> str | None:
    for i, (a, b) in enumerate(zip(stored, now)):
        if a != b:
            return f"prompt of image {i}: stored {a!r}, now {b!r}"
    return None if len(stored) == len(now) else f"images: stored {len(stored)}, now {len(now)}"


def cached_evaluation(path: Optional[Path], compute: Callable[[], Evaluation], *, expect: Mapping | None = None,
                      prompts: Sequence[str] | None = None) -> Evaluation:
    """The :class:`Evaluation` stored at ``path``, or ``compute()`` stored there (a temporary file
    renamed into place, so an interruption never leaves half a file); ``path`` None: always computed.

    A stored evaluation must agree with ``expect`` on every key of its ``meta`` and, when
    ``prompts`` is given, have sampled exactly that image list; otherwise a DiffalignError names the
    file and the first difference (delete it, or store elsewhere)."""
    if path is not None and path.is_file():
        try:
            stored = json.loads(path.read_text())
            evaluation = Evaluation.from_records(stored["records"], seconds=stored.get("seconds", 0.0), meta=stored["meta"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DiffalignError(f"{path} is not a stored evaluation ({exc}); delete it to evaluate again") from None
        diff = _first_difference(evaluation.meta, expect or {})
        if diff is None and prompts is not None:
            diff = _list_difference([r["prompt"] for r in evaluation.records], list(prompts))
        if diff:
            raise DiffalignError(f"{path} was evaluated with other settings ({diff}); use another cache folder or delete it")
        return evaluation
    evaluation = compute()
    if path is not None:
        atomic_write_text(path, json.dumps(evaluation.to_json()))
    return evaluation


# --------------------------------------------------------------------------------------------
# One model at its best scale
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BestScaleSpec:
    """How every evaluation of a best-scale comparison samples (the same for every model compared)."""

    scales: tuple[float, ...]  # the grid, sorted (check_scales)
    validation_prompts: tuple[str, ...]  # distinct prompts the scale is chosen on
    heldout_prompts: tuple[str, ...]  # distinct prompts of the number reported at the chosen scale
    validation_images_per_family: int = DEFAULT_VALIDATION_IMAGES_PER_FAMILY
    images_per_family: int = 96  # held-out images per family
    heldout_limit: int = 0  # > 0: only the first N held-out images (a quick check, as eval.num_prompts)
    num_steps: int = 20  # ODE steps
    seed: int = 1234  # one seed for every model, scale and prompt set
    batch_size: int = 64  # images per batch (the noise does not depend on it)
    resolution: Optional[int] = None  # None: the model's default
    autocast_dtype: Optional[torch.dtype] = None  # the denoiser's forwards (evaluation.eval_autocast_dtype)
    progress: bool = True  # a progress bar (a line off a terminal) while sampling

    @property
    def precision(self) -> str:
        return str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else "float32"

    def items(self, split: str) -> list[str]:
        """The image list of ``split`` (``validation`` or ``heldout``), as sampled."""
        if split == "validation":
            return shapes_eval_list(self.validation_prompts, self.validation_images_per_family)
        return shapes_eval_list(self.heldout_prompts, self.images_per_family, self.heldout_limit)

    def expected_meta(self, split: str, scale: float) -> dict:
        """What a stored evaluation's meta must hold to be reused for ``split`` at ``scale``."""
        per_family = self.validation_images_per_family if split == "validation" else self.images_per_family
        meta = {"split": split, "guidance_scale": float(scale), "num_steps": self.num_steps, "seed": self.seed,
                "images_per_family": per_family, "precision": self.precision}
        if self.resolution is not None:
            meta["resolution"] = self.resolution
        return meta

    def evaluate(self, adapter, split: str, scale: float) -> Evaluation:
        """ShapesEval of ``adapter`` on ``split`` at ``scale``."""
        prompts = self.validation_prompts if split == "validation" else self.heldout_prompts
        per_family = self.validation_images_per_family if split == "validation" else self.images_per_family
        limit = 0 if split == "validation" else self.heldout_limit
        return evaluate_shapes(adapter, list(prompts), images_per_family=per_family, num_steps=self.num_steps,
                               guidance_scale=float(scale), resolution=self.resolution, seed=self.seed,
                               batch_size=self.batch_size, limit=limit, autocast_dtype=self.autocast_dtype,
                               show_progress=self.progress)


@dataclass
class BestScale:
    """One model's validation pass rate at every scale, the scale chosen and its held-out evaluation there."""

    scale: float  # the chosen scale
    validation: dict[float, Evaluation]  # scale -> validation evaluation
    heldout: Evaluation  # at ``scale``
    model: str = ""  # what was evaluated (a model id, a run's final weights)

    @property
    def validation_rates(self) -> dict[float, float]:
        """Scale -> validation per-image pass rate."""
        return {s: ev.metrics[HEADLINE] for s, ev in self.validation.items()}

    def to_json(self) -> dict:
        """A summary without per-image records: the rates, the chosen scale, the held-out intervals."""
        return {"model": self.model, "scale": self.scale,
                "validation": {scale_text(s): r for s, r in self.validation_rates.items()},
                "validation_images": next(iter(self.validation.values())).meta.get("num_images"),
                "heldout": {k: v.to_dict() for k, v in self.heldout.intervals.items()},
                "heldout_images": self.heldout.meta.get("num_images", len(self.heldout.records))}


def evaluate_best_scale(load: Callable[[], Any], spec: BestScaleSpec, *, model: str = "", cache: Path | None = None,
                        weights: Callable[[], ContextManager] | None = None,
                        log: Callable[[str], None] | None = None) -> BestScale:
    """``load()``'s model at its validation-best scale of ``spec.scales`` (see the module docstring).

    ``load``: returns the adapter; called once, and only when an evaluation is not stored in
    ``cache``. ``model``: what the adapter is (stored with every evaluation and checked on reuse).
    ``cache``: a folder for the evaluations (``validation_cfgS.json``, ``heldout_cfgS.json``).
    ``weights``: a context around each evaluation (e.g. a trainer's EMA weights). ``log``: one line
    per evaluation sampled."""
    adapter = None

    def evaluation(split: str, scale: float) -> Evaluation:
        def compute() -> Evaluation:
            nonlocal adapter
            if adapter is None:
                adapter = load()
                adapter.denoiser.eval()
            if log is not None:
                log(f"  {model or 'model'}: {split} prompts at CFG {scale_text(scale)}, {len(spec.items(split))} images ...")
            with weights() if weights is not None else contextlib.nullcontext():
                ev = spec.evaluate(adapter, split, scale)
            ev.meta.update({"split": split, "model": model})
            return ev

        path = cache / f"{split}_cfg{scale_text(scale)}.json" if cache is not None else None
        return cached_evaluation(path, compute, expect={**spec.expected_meta(split, scale), "model": model},
                                 prompts=spec.items(split))

    validation = {float(s): evaluation("validation", s) for s in spec.scales}
    chosen = choose_scale({s: ev.metrics[HEADLINE] for s, ev in validation.items()})
    return BestScale(chosen, validation, evaluation("heldout", chosen), model)


# --------------------------------------------------------------------------------------------
# Two models, each at its best scale
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BestScaleComparison:
    """``trained - base`` on the held-out prompts, each model at its validation-best scale, paired image by image."""

    base_scale: float
    trained_scale: float
    differences: dict[str, Difference] = field(repr=False)  # every metric, paired 95 % bootstrap over prompts

    @property
    def difference(self) -> Difference:
        """The per-image pass rate's difference."""
        return self.differences[HEADLINE]

    @property
    def verdict(self) -> str:
        return "outside noise" if self.difference.outside_noise else "within noise"

    def sentence(self, base: str = "base", trained: str = "trained") -> str:
        """``At each model's validation-best CFG scale (base CFG 2, trained CFG 1.5): +0.031 [-0.012, +0.074] per image, within noise``."""
        d = self.difference
        return (f"At each model's validation-best CFG scale ({base} CFG {scale_text(self.base_scale)}, {trained} CFG "
                f"{scale_text(self.trained_scale)}): {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}] per image, {self.verdict}")

    def to_json(self) -> dict:
        return {"base_scale": self.base_scale, "trained_scale": self.trained_scale, "metric": HEADLINE,
                "difference": self.difference.to_dict(), "verdict": self.verdict,
                "differences": {k: v.to_dict() for k, v in self.differences.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> "BestScaleComparison":
        """The comparison :meth:`to_json` wrote."""
        return cls(float(data["base_scale"]), float(data["trained_scale"]),
                   {k: Difference(v["value"], v["lo"], v["hi"]) for k, v in data["differences"].items()})


def compare_best_scales(trained: BestScale, base: BestScale) -> BestScaleComparison:
    """``trained`` at its chosen scale against ``base`` at its own (both held-out evaluations on the
    same image list and seed; a ValueError when they are not)."""
    return BestScaleComparison(base.scale, trained.scale, trained.heldout.compare(base.heldout))


def final_weights_id(run_dir: str | Path) -> str:
    """What a run's ``final/`` holds, for stored evaluations: its folder and a SHA-256 of its files'
    contents (a run trained again in the same folder is another model)."""
    final = Path(run_dir) / "final"
    digest = hashlib.sha256()
    for path in sorted(p for p in final.rglob("*") if p.is_file()):
        digest.update(path.relative_to(final).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"{final.resolve()} sha256:{digest.hexdigest()[:16]}"
