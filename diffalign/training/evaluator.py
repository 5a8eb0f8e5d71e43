"""The held-out evaluation a run does before, during and after training, and its records.

The eval prompts are sampled with fixed seeds (ODE) and scored by the run's reward; ShapesWorld
runs also keep per-image ShapesEval records (``eval_records/iter-N.json``: intervals, paired
differences, see :mod:`diffalign.evaluation`) and, before and after training, the generalisation
probe. A grid of the first images goes to ``samples/`` (for videos: one frame strip per video).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from diffalign import runs
from diffalign.images import sample_grid, save_png
from diffalign.sampling import sample_images


def eval_records_path(run_dir: Path, iteration: int) -> Path:
    """Where the trainer keeps one evaluation's per-image records (``eval_records/iter-N.json``)."""
    return Path(run_dir) / "eval_records" / f"iter-{iteration:06d}.json"


def eval_items(cfg, prompts: Sequence[str]) -> list[str]:
    """The evaluation's prompt list (one entry per image). ShapesWorld prompts:
    ``eval.images_per_family`` per family (:func:`diffalign.shapes.evaluation_prompts`), cut to
    the first ``eval.num_prompts`` entries when set; other sources: the first
    ``eval.num_prompts`` prompts, each ``eval.samples_per_prompt`` times."""
    e = cfg.eval
    if cfg.prompts.source == "shapes":
        from diffalign.shapes import evaluation_prompts

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
    from diffalign.evaluation import Evaluation, interval_record, shapes_records

    cfg, e = trainer.cfg, trainer.cfg.eval
    prompts = eval_items(cfg, trainer.eval_prompts)
    t0 = time.perf_counter()
    images = sample_eval(trainer, prompts, f"eval (iteration {iteration})")
    rewards, info = trainer.score(images, prompts)
    record = {"iteration": iteration, "eval": True, "eval/reward_mean": float(rewards[torch.isfinite(rewards)].mean()),
              "eval/num_images": len(prompts)}
    record.update({f"eval/{k}": v for k, v in info.items()})
    main = trainer.accelerator.is_main_process
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
        if main:
            path = eval_records_path(trainer.run_dir, iteration)
            path.parent.mkdir(parents=True, exist_ok=True)
            runs.atomic_write_text(path, json.dumps(saved))
    record["eval/seconds"] = time.perf_counter() - t0
    if save_grid and main:
        if images.ndim == 5:
            record["eval/frames"] = images.shape[1]  # tells the report the grid holds frame strips
        n = min(len(images), 8 if images.ndim == 5 else 64)  # videos: one frame strip per row
        grid = trainer.run_dir / "samples" / f"eval-iter-{iteration:06d}.png"
        save_png(sample_grid(images[:n]), grid, scale=2)
        if getattr(trainer, "tracking", None) is not None:  # a bare trainer (tests) has none
            trainer.tracking.log_image("eval/samples", grid, iteration)
        runs.atomic_write_text(trainer.run_dir / "samples" / "eval-prompts.txt", "".join(p + "\n" for p in prompts[:n]))
    return record
