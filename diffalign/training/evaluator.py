"""The held-out evaluation a run does before, during and after training, and its records.

The eval prompts are sampled with fixed seeds (ODE) and scored by the run's reward; ShapesWorld
runs also keep per-image ShapesEval records (``eval_records/iter-N.json``: intervals, paired
differences, see :mod:`diffalign.evaluation`) and, before and after training, the generalisation
probe; other runs keep the per-image rewards there (for paired intervals in the report). A grid
goes to ``samples/``: for ShapesWorld, one row per GenEval family, each image labelled with its
prompt and pass / fail; otherwise the first images labelled with prompt and reward (for videos:
one unlabelled frame strip per video). The same list and seed pick the same images every time.

With ``eval.best_scale`` the final evaluation of a ShapesWorld run also compares the base model and
the evaluated weights each at its validation-best CFG scale (:mod:`diffalign.best_scale`): every
``eval.scales`` scale on the validation prompts, then the run's eval list at the chosen one, paired
image by image; the summary goes to the record (``eval/best_scale/...``) and to
``eval_records/iter-N.json`` (``best_scale``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from diffalign import progress, runs
from diffalign.adapters import ModelAdapter
from diffalign.best_scale import BestScaleSpec, compare_best_scales, evaluate_best_scale, scale_text
from diffalign.config import EvalConfig
from diffalign.errors import RewardError
from diffalign.evaluation import Evaluation, interval_record, shapes_records
from diffalign.images import labelled_grid, sample_grid, save_png, short_prompt
from diffalign.runs import eval_records_path
from diffalign.sampling import sample_images
from diffalign.shapes import evaluation_prompts, prompt_family, prompt_set
from diffalign.training.rewards import agree_on_failure

GRID_PER_FAMILY = 8  # ShapesWorld grids: images per GenEval family (one row each)
GRID_IMAGES = 16  # other image grids: the first 16 images (two rows), so a grid of large images stays small
GRID_VIDEOS = 8  # video grids: one frame strip per row
GRID_ROW = 8  # other image grids: images per row
GRID_TILE_PX = 96  # every image of a labelled grid is shown this wide (ShapesWorld's 32 px: 3x, nearest)


@dataclass(frozen=True)
class EvalSetup:
    """What an evaluation reads from a run, and nothing more: the model and its sampler settings,
    the prompts, the reward, where the records go and the process layout. The trainer makes one
    (:meth:`diffalign.trainer.Trainer.eval_setup`)."""

    adapter: ModelAdapter
    eval: EvalConfig  # the run's ``eval`` section: seed, batch size, images per family, ...
    shapes: bool  # ShapesWorld prompts (prompts.source: shapes): per-image ShapesEval records and family grids
    num_steps: int  # sampling.eval_num_steps
    guidance_scale: float  # sampling.guidance_scale
    resolution: Any  # the images' size, as the adapter takes it
    eval_prompts: Sequence[str]
    probe_prompts: Sequence[str]  # the generalisation probe's prompts (empty: none)
    # (images, prompts) -> (rewards (B,), info): the run's reward with its retries and checks
    score: Callable[[torch.Tensor, list[str]], tuple[torch.Tensor, dict]]
    eval_weights: Callable[[], ContextManager]  # context: the weights to evaluate (EMA when configured)
    autocast: Callable[[], ContextManager]  # context: the forwards' precision
    run_dir: Path
    accelerator: Any  # accelerate.Accelerator: which process writes, and when processes wait
    sharded: bool  # ZeRO-3 / FSDP: every process takes part in every forward
    progress_bar: bool = False
    log_image: Optional[Callable[[str, Path, int], None]] = None  # (tag, png path, iteration) to the trackers
    # eval.best_scale: the base model, loaded afresh (a second copy: ShapesWorld models are small), and
    # the forwards' autocast dtype as evaluation.evaluate_shapes takes it (None: fp32)
    load_base: Optional[Callable[[], ModelAdapter]] = None
    autocast_dtype: Optional[torch.dtype] = None
    base_model: str = ""  # model.id, as the best-scale summary names the base


def eval_items(e: EvalConfig, prompts: Sequence[str], *, shapes: bool) -> list[str]:
    """The evaluation's prompt list (one entry per image). ShapesWorld prompts (``shapes``):
    ``eval.images_per_family`` per family (:func:`diffalign.shapes.evaluation_prompts`), cut to
    the first ``eval.num_prompts`` entries when set; other sources: the first
    ``eval.num_prompts`` prompts, each ``eval.samples_per_prompt`` times."""
    if shapes:
        items = evaluation_prompts(prompts, e.images_per_family)
        return items[: e.num_prompts] if e.num_prompts else items
    prompts = list(prompts[: e.num_prompts]) if e.num_prompts else list(prompts)
    return [p for p in prompts for _ in range(e.samples_per_prompt)]


def evaluate(setup: EvalSetup, iteration: int, *, save_grid: bool = True, probe: bool = False,
             best_scale: bool = False) -> dict:
    """Sample the eval prompts with fixed seeds (ODE) and score them; the record on the main
    process, {} on the others. ``probe``: also evaluate the generalisation probe; ``best_scale``
    (ShapesWorld): also the best-scale comparison (:func:`best_scale_comparison`)."""
    acc = setup.accelerator
    # The processes meet after the evaluation in agree_on_failure rather than at a plain barrier: a
    # reward that failed on one process stops every process there, instead of leaving the others waiting.
    if setup.sharded:  # sharded forwards: every process samples the same images
        record = _agreed_run(setup, iteration, save_grid=save_grid, probe=probe, best_scale=best_scale)
        return record if acc.is_main_process else {}
    if not acc.is_main_process:
        agree_on_failure(None, acc, acc.device)
        return {}
    return _agreed_run(setup, iteration, save_grid=save_grid, probe=probe, best_scale=best_scale)


def _agreed_run(setup: EvalSetup, iteration: int, **kwargs) -> dict:
    """:func:`_run` on this process, then every process learns whether the reward failed on any."""
    record, error = {}, None
    try:
        record = _run(setup, iteration, **kwargs)
    except RewardError as exc:
        error = exc
    agree_on_failure(error, setup.accelerator, setup.accelerator.device)
    return record


def grid_rows(families: Sequence[str], prompts: Sequence[str], per_family: int = GRID_PER_FAMILY) -> list[list[int]]:
    """The images of a ShapesWorld grid: per family (order of first appearance), the indices of up
    to ``per_family`` images, spread evenly over the family's distinct prompts (the first image of
    each chosen prompt); a family with fewer distinct prompts adds further images of them (other
    seeds) in list order."""
    positions: dict[str, list[int]] = {}
    for i, family in enumerate(families):
        positions.setdefault(family, []).append(i)
    rows = []
    for pos in positions.values():
        first: dict[str, int] = {}
        for i in pos:
            first.setdefault(prompts[i], i)
        distinct = list(first.values())
        k = min(per_family, len(pos))
        if len(distinct) >= k:
            rows.append([distinct[j * len(distinct) // k] for j in range(k)])
        else:
            chosen = set(distinct)
            rows.append(sorted(distinct + [i for i in pos if i not in chosen][: k - len(distinct)]))
    return rows


def _save_grid(run_dir: Path, iteration: int, images: torch.Tensor, prompts: Sequence[str], rewards: torch.Tensor,
               records: Sequence[dict] | None, log_image: Optional[Callable[[str, Path, int], None]] = None) -> dict:
    """Write ``samples/eval-iter-N.png`` and ``samples/eval-prompts.txt`` (the grid's prompts in
    grid order); ``records``: the ShapesEval records of ``images`` (a grid by family), else None.
    ``log_image``: also send the grid to the trackers."""
    out: dict = {}
    samples = run_dir / "samples"
    grid = samples / f"eval-iter-{iteration:06d}.png"
    if images.ndim == 5:
        out["eval/frames"] = images.shape[1]  # tells the report the grid holds frame strips
        index = list(range(min(len(images), GRID_VIDEOS)))
        save_png(sample_grid(images[index]), grid, scale=2)
    elif records is not None:  # one row per family; a shorter row (a list cut by eval.num_prompts) is padded blank
        rows = grid_rows([r["family"] for r in records], prompts)
        width = max(len(row) for row in rows)
        index = [i for row in rows for i in row]
        cells, labels, marks = [], [], []
        for row in rows:
            blank = width - len(row)
            cells += [images[i] for i in row] + [torch.ones_like(images[0])] * blank
            labels += [short_prompt(prompts[i]) for i in row] + [""] * blank
            marks += [bool(records[i]["passed"]) for i in row] + [None] * blank
        save_png(labelled_grid(torch.stack(cells), labels, marks, nrow=width, tile=GRID_TILE_PX), grid)
    else:
        index = list(range(min(len(images), GRID_IMAGES)))
        labels = [f"reward {float(rewards[i]):.3f}: {short_prompt(prompts[i])}" for i in index]
        save_png(labelled_grid(images[index], labels, nrow=GRID_ROW, tile=GRID_TILE_PX), grid)
    if log_image is not None:
        log_image("eval/samples", grid, iteration)
    runs.atomic_write_text(samples / "eval-prompts.txt", "".join(prompts[i] + "\n" for i in index))
    return out


def sample_eval(setup: EvalSetup, items: Sequence[str], what: str = "eval") -> torch.Tensor:
    """The images of ``items``: eval weights (EMA when configured), the eval sampler and seed.
    ``what`` names the progress bar (main process only)."""
    setup.adapter.denoiser.eval()
    show = setup.progress_bar and setup.accelerator.is_main_process
    with setup.eval_weights():
        with setup.autocast():
            return sample_images(setup.adapter, list(items), num_steps=setup.num_steps,
                                 guidance_scale=setup.guidance_scale, resolution=setup.resolution,
                                 seed=setup.eval.seed, batch_size=setup.eval.batch_size,
                                 progress=f"{what}: {len(items)} images" if show else None)


def validation_prompts(eval_prompts: Sequence[str]) -> list[str]:
    """The validation prompts (``prompt_set("validation")``) of the families ``eval_prompts`` holds
    (a run restricted by ``prompts.families`` chooses its scale on those families only)."""
    families = {prompt_family(p) for p in eval_prompts}
    return [p for p in prompt_set("validation") if prompt_family(p) in families]


def best_scale_comparison(setup: EvalSetup) -> dict:
    """The base model (``setup.load_base``) and the evaluated weights, each at its validation-best
    scale of ``eval.scales`` (the validation prompts at ``eval.validation_images_per_family``, then
    the run's eval list at the chosen scale), and the paired comparison: ``{"base", "trained",
    "comparison"}`` as :meth:`~diffalign.best_scale.BestScale.to_json` and
    :meth:`~diffalign.best_scale.BestScaleComparison.to_json` write them."""
    e = setup.eval
    show = setup.progress_bar and setup.accelerator.is_main_process
    spec = BestScaleSpec(tuple(sorted(e.scales)), tuple(validation_prompts(setup.eval_prompts)), tuple(setup.eval_prompts),
                         validation_images_per_family=e.validation_images_per_family,
                         images_per_family=e.images_per_family, heldout_limit=e.num_prompts, num_steps=setup.num_steps,
                         seed=e.seed, batch_size=e.batch_size, resolution=setup.resolution,
                         autocast_dtype=setup.autocast_dtype, progress=show)
    log = progress.phase if show else None
    if setup.load_base is None:
        raise ValueError("eval.best_scale needs EvalSetup.load_base")
    base = evaluate_best_scale(setup.load_base, spec, model=setup.base_model, log=log)
    trained = evaluate_best_scale(lambda: setup.adapter, spec, model="final weights", weights=setup.eval_weights, log=log)
    comparison = compare_best_scales(trained, base)
    if log is not None:
        log("  " + comparison.sentence())
    return {"base": base.to_json(), "trained": trained.to_json(), "comparison": comparison.to_json(),
            "scales": [scale_text(s) for s in spec.scales]}


def best_scale_record(summary: dict) -> dict[str, float]:
    """The metrics-log keys of a best-scale summary: both chosen scales and the per-image
    difference with its interval."""
    d = summary["comparison"]["difference"]
    return {"eval/best_scale/base_scale": summary["comparison"]["base_scale"],
            "eval/best_scale/trained_scale": summary["comparison"]["trained_scale"],
            "eval/best_scale/difference": d["value"], "eval/best_scale/difference_lo": d["lo"],
            "eval/best_scale/difference_hi": d["hi"]}


def _run(setup: EvalSetup, iteration: int, *, save_grid: bool, probe: bool, best_scale: bool = False) -> dict:
    e = setup.eval
    prompts = eval_items(e, setup.eval_prompts, shapes=setup.shapes)
    t0 = time.perf_counter()
    images = sample_eval(setup, prompts, f"eval (iteration {iteration})")
    rewards, info = setup.score(images, prompts)
    record = {"iteration": iteration, "eval": True, "eval/reward_mean": float(rewards[torch.isfinite(rewards)].mean()),
              "eval/num_images": len(prompts)}
    record.update({f"eval/{k}": v for k, v in info.items()})
    main = setup.accelerator.is_main_process
    heldout = None
    if setup.shapes:
        # Per-image ShapesEval records whatever the training reward: intervals, paired differences.
        meta = {"num_steps": setup.num_steps, "guidance_scale": setup.guidance_scale,
                "resolution": setup.resolution, "seed": e.seed, "batch_size": e.batch_size,
                "images_per_family": e.images_per_family, "num_prompts": e.num_prompts}
        heldout = Evaluation.from_records(shapes_records(images, prompts), meta={**meta, "num_images": len(prompts)})
        record.update(interval_record(heldout.intervals, "eval/"))
        saved = {"iteration": iteration, "heldout": heldout.to_json()}
        if probe and setup.probe_prompts:
            items = eval_items(e, setup.probe_prompts, shapes=True)
            probe_eval = Evaluation.from_records(shapes_records(sample_eval(setup, items, f"probe (iteration {iteration})"), items),
                                                 meta={**meta, "num_images": len(items)})
            record.update(interval_record(probe_eval.intervals, "eval/probe/"))
            record["eval/probe/num_images"] = len(items)
            saved["probe"] = probe_eval.to_json()
        if best_scale:
            saved["best_scale"] = best_scale_comparison(setup)
            record.update(best_scale_record(saved["best_scale"]))
    else:
        # Per-image rewards (None where not finite), so that the report can pair two evaluations.
        saved = {"iteration": iteration, "rewards": {"prompts": list(prompts), "guidance_scale": setup.guidance_scale,
                                                     "values": [float(r) if torch.isfinite(r) else None for r in rewards]}}
    if main:
        path = eval_records_path(setup.run_dir, iteration)
        path.parent.mkdir(parents=True, exist_ok=True)
        runs.atomic_write_text(path, json.dumps(saved))
    record["eval/seconds"] = time.perf_counter() - t0
    if save_grid and main:
        record.update(_save_grid(setup.run_dir, iteration, images, prompts, rewards, heldout.records if heldout else None,
                                 setup.log_image))
    return record
