"""Scaling of one Flow-GRPO iteration: time and peak memory against images, steps, resolution and LoRA.

    python benchmarks/scaling.py [--models sd3,shapes] [--size medium] [--iterations 2] [--threads 2]
        [--out benchmarks/results/scaling]

Each point is one configuration run in its own process: build the trainer, one warm-up iteration,
then ``--iterations`` timed ones (the fastest is reported: other processes only ever add time).
Memory is measured over the timed iterations only, not the model build: on CPU the process's
resident set is trimmed (``gc`` and glibc ``malloc_trim``) and read after the warm-up (``base``),
its high-water mark is reset (``/proc/self/clear_refs``) and read after the timed iterations
(``peak``); on a GPU ``torch.cuda`` peak and allocated bytes the same way. ``iter MiB = peak -
base`` is the memory an iteration itself needs (activations, kept latents, gradients); its
exponent is the fitted memory exponent. Where the high-water mark cannot be reset (not Linux) the
peak is the process's whole-life ``ru_maxrss`` and the table says so. From a base point, one axis
moves at a time:

- **images** per iteration (prompts x group of 4): 4, 8, 16;
- **steps** (every step an SDE step and trained: ``sampling.window_size=0``): 4, 8, 16;
- **resolution**: SD3 32, 64, 128 px (64, 256, 1024 image tokens); the shapes model 32, 64 px;
- **LoRA** (SD3: rank 8; the shapes model: the default rank 32) against full fine-tuning
  (``lora.enabled=false``).

Models: ``sd3``, the SD3 transformer of ``benchmarks/overhead.py`` (``--size``, default
``medium``: 4 joint blocks of width 256) with the tiny text encoders and VAE, saved and loaded back
through ``model.id``; ``shapes``, the shipped ShapesWorld model with its ShapesEval reward.
Rewards: SD3 ``jpeg_compressibility`` (weight-free); the shapes model ShapesEval.

Per axis the table prints each point's seconds and peak memory, and the fitted exponent ``k`` of
``seconds ~ value^k`` (least squares on log-log). Linear cost in images and steps is ``k = 1``;
resolution is in pixels per side, so a cost linear in tokens is ``k = 2``. Results are kept per
point (``<out>/<model>/<point>.json``) and skipped when present: an interrupted run resumes. The
plot goes to ``<out>/scaling.png``. Numbers are only comparable within one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

BASE = {"images": 8, "steps": 8, "lora": True}
BASE_RESOLUTION = {"sd3": 64, "shapes": 32}
AXES = {
    "images": [4, 8, 16],
    "steps": [4, 8, 16],
    "resolution": {"sd3": [32, 64, 128], "shapes": [32, 64]},
    "lora": [True, False],
}
GROUP = 4  # images per prompt; images / GROUP prompts per iteration


def points(model: str, axes=tuple(AXES), micro_batch: int = 0) -> list[tuple[str, dict]]:
    """``(axis, point)`` pairs; the base point appears once per axis (runs once: same key).
    ``micro_batch``: images per denoiser forward (0: all of an iteration's images in one)."""
    base = {**BASE, "resolution": BASE_RESOLUTION[model], "micro_batch": micro_batch}
    out = []
    for axis, values in AXES.items():
        if axis not in axes:
            continue
        values = values[model] if isinstance(values, dict) else values
        for value in values:
            out.append((axis, {**base, axis: value}))
    return out


def point_key(point: dict) -> str:
    mb = f"-mb{point['micro_batch']}" if point.get("micro_batch") else ""
    return f"img{point['images']}-steps{point['steps']}-res{point['resolution']}-{'lora' if point['lora'] else 'full'}{mb}"


def overrides(point: dict) -> list[str]:
    batch = min(point["images"], point.get("micro_batch") or point["images"])
    return [
        f"rollout.prompts_per_iteration={max(1, point['images'] // GROUP)}",
        f"rollout.group_size={GROUP}",
        f"rollout.sample_batch_size={batch}",
        f"train.batch_size={batch}",
        "train.optimizer_steps_per_iteration=1",
        f"sampling.num_steps={point['steps']}",
        "sampling.window_size=0",
        f"model.resolution={point['resolution']}",
        f"lora.enabled={str(point['lora']).lower()}",
        "algorithm.filter_zero_std_groups=false",  # the same trained samples (and forwards) every iteration
    ]


# --------------------------------------------------------------------------------------------
# one point, in a child process
# --------------------------------------------------------------------------------------------


def run_point(model: str, point: dict, size: str, iterations: int, threads: int) -> dict:
    import torch

    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="diffalign-scaling-") as tmp:
        common = [f"output_dir={tmp}/run", "log.progress_bar=false", "log.report=false", "eval.at_start=false",
                  "eval.every=0", "checkpoint.every=0", "train.ema.enabled=false"]
        if model == "sd3":
            from overhead import SIZES, bench_config, build_sd3_pipeline

            build_sd3_pipeline(SIZES[size]).save_pretrained(f"{tmp}/model")
            cfg = bench_config(f"{tmp}/model", f"{tmp}/run", SIZES[size], [*common, *overrides(point), "algorithm.beta=0"])
        else:
            cfg = load_config(str(ROOT / "configs/shapes/flow_grpo.yaml"), [*common, *overrides(point)])
        trainer = build_trainer(cfg, overwrite=True)
        trainer.setup()
        cuda = torch.cuda.is_available() and str(trainer.adapter.device).startswith("cuda")
        trainer.iteration(0)  # warm-up: allocators, kernels
        base = memory_base(cuda)
        seconds = []
        for i in range(1, iterations + 1):
            t0 = time.perf_counter()
            trainer.iteration(i)
            seconds.append(time.perf_counter() - t0)
        peak, base, kind = memory_peak(cuda, base)
        trainable = sum(p.numel() for p in trainer.adapter.denoiser.parameters() if p.requires_grad)
    return {"model": model, "point": point, "seconds": min(seconds), "all_seconds": seconds,
            "peak_mib": peak, "base_mib": base, "iter_mib": peak - base, "memory": kind,
            "trainable_params": trainable, "threads": threads, "load_avg": os.getloadavg()}


def _proc_status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def memory_base(cuda: bool) -> float | None:
    """Memory in use before the timed iterations (MiB), with the peak counter reset to it; None
    where the peak cannot be reset (then :func:`memory_peak` reports the whole process's)."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS is what is in use
    except (OSError, AttributeError):
        pass  # not glibc: RSS may include freed pages, so base is a little high
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        return _proc_status_mib("VmRSS")
    except (OSError, KeyError):
        return None


def memory_peak(cuda: bool, base: float | None) -> tuple[float, float, str]:
    """``(peak, base, kind)`` in MiB: the peak since :func:`memory_base` returned ``base``."""
    import resource

    import torch

    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20, base, "cuda_peak"
    if base is not None:
        return _proc_status_mib("VmHWM"), base, "rss_peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0.0, "rss_peak_whole_process"


def measure(model: str, point: dict, args, out: Path) -> dict:
    piece = out / model / f"{point_key(point)}.json"
    if piece.is_file():
        return json.loads(piece.read_text())
    cmd = [sys.executable, __file__, "--child", json.dumps({"model": model, "point": point}), "--size", args.size,
           "--iterations", str(args.iterations), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        result = {"model": model, "point": point, "error": tail}
    else:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    piece.parent.mkdir(parents=True, exist_ok=True)
    piece.write_text(json.dumps(result, indent=1))
    return result


# --------------------------------------------------------------------------------------------
# table, fits, plot
# --------------------------------------------------------------------------------------------


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den


def axis_rows(results: dict[str, dict], model: str, axes=tuple(AXES), micro_batch: int = 0) -> list[tuple[str, list[dict], float | None, float | None]]:
    rows = []
    for axis in axes:
        pts = [results[point_key(p)] for a, p in points(model, axes, micro_batch) if a == axis]
        ok = [r for r in pts if "error" not in r]
        k_time = k_mem = None
        if axis != "lora" and len(ok) >= 2:
            xs = [r["point"][axis] for r in ok]
            k_time = fit_exponent(xs, [r["seconds"] for r in ok])
            k_mem = fit_exponent(xs, [max(r["iter_mib"], 1.0) for r in ok])
        rows.append((axis, pts, k_time, k_mem))
    return rows


def format_table(all_rows: dict[str, list]) -> str:
    lines = [f"{'model':7}{'axis':12}{'value':>7}{'s/iter':>9}{'peak MiB':>10}{'iter MiB':>10}{'trainable':>12}"
             f"   fitted exponent (time, iteration memory)"]
    for model, rows in all_rows.items():
        for axis, pts, k_time, k_mem in rows:
            for j, r in enumerate(pts):
                value = r["point"][axis]
                value = ("lora" if value else "full") if axis == "lora" else value
                fit = f"   k_time {k_time:.2f}, k_mem {k_mem:.2f}" if j == 0 and k_time is not None else ""
                if "error" in r:
                    lines.append(f"{model:7}{axis:12}{value!s:>7}   failed: {r['error'][:80]}")
                else:
                    note = "" if r["memory"] != "rss_peak_whole_process" else "   (peak over the whole process)"
                    lines.append(f"{model:7}{axis:12}{value!s:>7}{r['seconds']:>9.2f}{r['peak_mib']:>10.0f}{r['iter_mib']:>10.0f}"
                                 f"{r['trainable_params']:>12,}{fit}{note}")
    return "\n".join(lines)


def plot(all_rows: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = [a for a in AXES if a != "lora" and any(name == a for rows in all_rows.values() for name, *_ in rows)]
    fig, axs = plt.subplots(1, len(axes_names), figsize=(4 * len(axes_names), 3.4), squeeze=False)
    axs = axs[0]
    for ax, axis in zip(axs, axes_names):
        for model, rows in all_rows.items():
            for name, pts, k_time, _ in rows:
                ok = [r for r in pts if name == axis and "error" not in r]
                if len(ok) >= 2:
                    ax.loglog([r["point"][axis] for r in ok], [r["seconds"] for r in ok], "o-",
                              label=f"{model} (k={k_time:.2f})", base=2)
        ax.set_xlabel(axis if axis != "resolution" else "resolution (px per side)")
        ax.set_ylabel("seconds per iteration")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="sd3,shapes")
    p.add_argument("--size", default="medium", help="SD3 transformer size of benchmarks/overhead.py")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per point (after one warm-up); the fastest counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--axes", default=",".join(AXES), help=f"a subset of {', '.join(AXES)}")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="images per rollout / training forward (rollout.sample_batch_size, train.batch_size); "
                        "0: an iteration's images in one batch")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(run_point(job["model"], job["point"], args.size, args.iterations, args.threads)))
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(BASE_RESOLUTION))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(BASE_RESOLUTION)}")
    axes = tuple(a for a in args.axes.split(",") if a)
    if set(axes) - set(AXES):
        raise SystemExit(f"--axes: unknown {sorted(set(axes) - set(AXES))}; known: {', '.join(AXES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_rows = {}
    for model in models:
        results = {}
        for axis, point in points(model, axes, args.micro_batch):
            key = point_key(point)
            if key not in results:
                print(f"- {model} {key}", flush=True)
                results[key] = measure(model, point, args, out)
        all_rows[model] = axis_rows(results, model, axes, args.micro_batch)
    print(f"\none Flow-GRPO iteration (fastest of {args.iterations} after a warm-up), {args.threads} threads; "
          f"base point: {BASE['images']} images, {BASE['steps']} steps, LoRA; SD3 size {args.size}; "
          f"{f'micro-batches of {args.micro_batch} images' if args.micro_batch else 'all images in one forward batch'}")
    print(format_table(all_rows))
    png = out / (f"scaling-mb{args.micro_batch}.png" if args.micro_batch else "scaling.png")
    plot(all_rows, png)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
