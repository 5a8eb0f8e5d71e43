"""The held-out evaluation a run does before, during and after training, and its records.

The eval prompts are sampled with fixed seeds (ODE) and scored by the run's reward; ShapesWorld
runs also keep per-image ShapesEval records (``eval_records/iter-N.json``: intervals, paired
differences, see :mod:`diffalign.evaluation`) and, before and after training, the generalisation
probe; other runs keep the per-image rewards there (for paired intervals in the report). A grid
goes to ``samples/``: for ShapesWorld, one row per GenEval family, each image labelled with its
prompt and pass / fail; otherwise the first images labelled with prompt and reward (for videos:
one unlabelled frame strip per video). The same list and seed pick the same images every time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from diffalign import runs
from diffalign.evaluation import Evaluation, interval_record, shapes_records
from diffalign.images import labelled_grid, sample_grid, save_png, short_prompt
from diffalign.runs import eval_records_path
from diffalign.sampling import sample_images
from diffalign.shapes import evaluation_prompts

GRID_PER_FAMILY = 8  # ShapesWorld grids: images per GenEval family (one row each)
GRID_IMAGES = 16  # other image grids: the first 16 images (two rows), so a grid of large images stays small
GRID_VIDEOS = 8  # video grids: one frame strip per row
GRID_ROW = 8  # other image grids: images per row
GRID_TILE_PX = 96  # every image of a labelled grid is shown this wide (ShapesWorld's 32 px: 3x, nearest)


def eval_items(cfg, prompts: Sequence[str]) -> list[str]:
    """The evaluation's prompt list (one entry per image). ShapesWorld prompts:
    ``eval.images_per_family`` per family (:func:`diffalign.shapes.evaluation_prompts`), cut to
    the first ``eval.num_prompts`` entries when set; other sources: the first
    ``eval.num_prompts`` prompts, each ``eval.samples_per_prompt`` times."""
    e = cfg.eval
    if cfg.prompts.source == "shapes":
        items = evaluation_prompts(prompts, e.images_per_family)
        return items[: e.num_prompts] if e.num_prompts else items
    prompts = list(prompts[: e.num_prompts]) if e.num_prompts else list(prompts)
    return [p for p in prompts for _ in range(e.samples_per_prompt)]


def evaluate(trainer, iteration: int, *, save_grid: bool = True, probe: bool = False) -> dict:
    """Sample the eval prompts with fixed seeds (ODE) and score them; the record on the main
    process, {} on the others. ``probe``: also evaluate the generalisation probe."""
    acc = trainer.accelerator
    if trainer.sharded:  # sharded forwards: every process samples the same images
        record = _run(trainer, iteration, save_grid=save_grid, probe=probe)
        acc.wait_for_everyone()
        return record if acc.is_main_process else {}
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return {}
    record = _run(trainer, iteration, save_grid=save_grid, probe=probe)
    if acc.num_processes > 1:
        acc.wait_for_everyone()
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


def _save_grid(trainer, iteration: int, images: torch.Tensor, prompts: Sequence[str], rewards: torch.Tensor,
               records: Sequence[dict] | None) -> dict:
    """Write ``samples/eval-iter-N.png`` and ``samples/eval-prompts.txt`` (the grid's prompts in
    grid order); ``records``: the ShapesEval records of ``images`` (a grid by family), else None."""
    out: dict = {}
    samples = trainer.run_dir / "samples"
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
    if getattr(trainer, "tracking", None) is not None:  # a bare trainer (tests) has none
        trainer.tracking.log_image("eval/samples", grid, iteration)
    runs.atomic_write_text(samples / "eval-prompts.txt", "".join(prompts[i] + "\n" for i in index))
    return out


def sample_eval(trainer, items: Sequence[str], what: str = "eval") -> torch.Tensor:
    """The images of ``items``: eval weights (EMA when configured), the eval sampler and seed.
    ``what`` names the progress bar (main process only)."""
    cfg = trainer.cfg
    trainer.adapter.denoiser.eval()
    show = cfg.log.progress_bar and trainer.accelerator.is_main_process
    with trainer.eval_weights():
        with trainer.autocast():
            return sample_images(trainer.adapter, list(items), num_steps=cfg.sampling.eval_num_steps,
                                 guidance_scale=cfg.sampling.guidance_scale, resolution=trainer.resolution,
                                 seed=cfg.eval.seed, batch_size=cfg.eval.batch_size,
                                 progress=f"{what}: {len(items)} images" if show else None)


def _run(trainer, iteration: int, *, save_grid: bool, probe: bool) -> dict:
    cfg, e = trainer.cfg, trainer.cfg.eval
    prompts = eval_items(cfg, trainer.eval_prompts)
    t0 = time.perf_counter()
    images = sample_eval(trainer, prompts, f"eval (iteration {iteration})")
    rewards, info = trainer.score(images, prompts)
    record = {"iteration": iteration, "eval": True, "eval/reward_mean": float(rewards[torch.isfinite(rewards)].mean()),
              "eval/num_images": len(prompts)}
    record.update({f"eval/{k}": v for k, v in info.items()})
    main = trainer.accelerator.is_main_process
    heldout = None
    if cfg.prompts.source == "shapes":
        # Per-image ShapesEval records whatever the training reward: intervals, paired differences.
        meta = {"num_steps": cfg.sampling.eval_num_steps, "guidance_scale": cfg.sampling.guidance_scale,
                "resolution": trainer.resolution, "seed": e.seed, "batch_size": e.batch_size,
                "images_per_family": e.images_per_family, "num_prompts": e.num_prompts}
        heldout = Evaluation.from_records(shapes_records(images, prompts), meta={**meta, "num_images": len(prompts)})
        record.update(interval_record(heldout.intervals, "eval/"))
        saved = {"iteration": iteration, "heldout": heldout.to_json()}
        if probe and trainer.probe_prompts:
            items = eval_items(cfg, trainer.probe_prompts)
            probe_eval = Evaluation.from_records(shapes_records(sample_eval(trainer, items, f"probe (iteration {iteration})"), items),
                                                 meta={**meta, "num_images": len(items)})
            record.update(interval_record(probe_eval.intervals, "eval/probe/"))
            record["eval/probe/num_images"] = len(items)
            saved["probe"] = probe_eval.to_json()
    else:
        # Per-image rewards (None where not finite), so that the report can pair two evaluations.
        saved = {"iteration": iteration, "rewards": {"prompts": list(prompts), "guidance_scale": cfg.sampling.guidance_scale,
                                                     "values": [float(r) if torch.isfinite(r) else None for r in rewards]}}
    if main:
        path = eval_records_path(trainer.run_dir, iteration)
        path.parent.mkdir(parents=True, exist_ok=True)
        runs.atomic_write_text(path, json.dumps(saved))
    record["eval/seconds"] = time.perf_counter() - t0
    if save_grid and main:
        record.update(_save_grid(trainer, iteration, images, prompts, rewards, heldout.records if heldout else None))
    return record
