"""Statistics averaged over processes, so that a multi-process run logs what one process would,
and the one-line summary of an evaluation record."""

from __future__ import annotations

import numpy as np
import torch

from diffalign.evaluation import is_bound_key


def mean_stats(accelerator, device, stats: dict[str, list[float]]) -> dict[str, float]:
    """Per-key means of an update's micro-batch statistics over every process (NaN for a key
    that no process recorded). A collective: every process calls it with the same keys in the
    same order."""
    keys = list(stats)
    sums = torch.tensor([float(np.sum(stats[k])) for k in keys], dtype=torch.float64)
    counts = torch.tensor([float(len(stats[k])) for k in keys], dtype=torch.float64)
    if accelerator.num_processes > 1:
        both = accelerator.reduce(torch.cat([sums, counts]).to(device), reduction="sum").cpu()
        sums, counts = both[: len(keys)], both[len(keys) :]
    return {k: float(v / n) if n > 0 else float("nan") for k, v, n in zip(keys, sums.tolist(), counts.tolist())}


def gather_info(accelerator, info: dict[str, float]) -> dict[str, float]:
    """Per-key mean over processes of a process-local info dict (a key that some processes lack,
    say a prompt family that only one of them sampled, is averaged over those that have it).
    A collective: every process calls it."""
    if accelerator.num_processes == 1:
        return dict(info)
    from accelerate.utils import gather_object

    merged: dict[str, list[float]] = {}
    for part in gather_object([dict(info)]):
        for k, v in part.items():
            merged.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in merged.items()}


def header_lines(trainer) -> list[str]:
    """What a run prints when it starts: the method, model and run directory, the derived sizes,
    and a note on settings that do not apply."""
    cfg = trainer.cfg
    d = cfg.derived(trainer.layout.dp_world)  # data-parallel groups: a context-parallel group shares its samples
    n_train = sum(p.numel() for p in trainer.trainable)
    lines = [f"diffalign: {cfg.algorithm.name} on {cfg.model.id} ({trainer.adapter.family}, {trainer.resolution}px) "
             f"-> {trainer.run_dir}",
             "  " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items())
             + f", trainable params {n_train:,}, processes {trainer.accelerator.num_processes}, device {trainer.device}"]
    if cfg.prompts.source == "shapes" and cfg.eval.samples_per_prompt != 1:
        lines.append(f"  note: eval.samples_per_prompt={cfg.eval.samples_per_prompt} does not apply to ShapesWorld prompts; "
                     f"the evaluation samples eval.images_per_family={cfg.eval.images_per_family} images per family")
    if trainer.layout.degree > 1:
        lines.append(f"  context parallelism: each sample's tokens split over {trainer.layout.degree} processes, "
                     f"{trainer.layout.dp_world} data-parallel group(s)")
    return lines


def format_eval(record: dict) -> str:
    """``reward_mean 0.412, acc/overall 0.198 [0.158, 0.243], ...`` (probe metrics last)."""
    skip = ("eval/seconds", "eval/num_images", "eval/probe/num_images", "eval/frames")
    keys = [k for k in record if k.startswith("eval/") and k not in skip and not is_bound_key(k)
            and isinstance(record[k], (int, float))]
    keys.sort(key=lambda k: k.startswith("eval/probe/"))
    parts = []
    for k in keys:
        lo, hi = record.get(f"{k}_lo"), record.get(f"{k}_hi")
        parts.append(f"{k[5:]} {record[k]:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""))
    return ", ".join(parts)
