"""Rollout parity: diffalign's training rollout against the stock diffusers pipeline, side by side.

    python benchmarks/rollout_vs_pipeline.py [--families sd3,flux,sd15,sdxl,sana,shapes] [--images 8]
        [--steps 10] [--repeats 21] [--threads 2] [--profile FAMILY]

Per model family, both sides run in one process on the same pipeline object, with the same
prompts, steps, guidance, batch, resolution and dtype:

- **pipeline**: ``pipeline(prompt=..., output_type="pt")``, the stock ``__call__`` with its
  deterministic scheduler (epsilon models: ``DDIMScheduler`` built from the pipeline's config, the
  one-forward-per-step rule the toolkit's DDIM kernel follows). This is the cheapest loop for the
  same model evaluations: no log-probs, no kept latents.
- **rollout**: what a Flow-GRPO / DDPO iteration samples with: ``adapter.encode_prompts`` +
  ``sample_linear`` with the SDE kernel (``flow_grpo`` with noise level 0.7 on flow models, DDIM
  with eta 1 on epsilon models) on every step, fp32 log-probs and every latent kept, then the
  VAE decode.

A forward pre-hook on the denoiser records every forward's batch shape: the two sides must run the
same forwards, or the benchmark stops. After one warm-up call of each, the repeats alternate the
order (pipeline rollout, rollout pipeline, ...) so that load from other processes hits both sides
alike. The table reports the fastest repeat of each side (wall time, and the process's CPU time)
and their ratio rollout / pipeline (the convention of Python's ``timeit``: other processes only
ever add time to a call). The two minima may come from different moments, though, and on a shared
virtual machine the speed of both sides drifts between moments by more than the difference being
measured, so the headline is the **paired ratio**: each repeat times the two sides back to back,
under about the same load, and the median of the per-repeat ratios rollout / pipeline is printed
with its 95 % bootstrap interval (2,000 resamples of the repeats). ``SLOWER THAN THE PIPELINE``
marks a paired ratio above 1.00, with ``(outside noise)`` when the whole interval lies above it.
The exit code is 0 whatever the ratio (a measurement, not a test). ``--profile FAMILY`` adds a
cProfile of that family's rollout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built in code or shipped: never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, str(path))

import torch  # noqa: E402

FAMILIES = ("sd3", "flux", "sd15", "sdxl", "sana", "shapes")
PROMPTS = ["a red circle", "a blue square", "two green triangles", "a yellow star", "a cat on a hill",
           "a small house", "a tree", "a boat on the sea"]
PARITY_GOAL = 1.00


def build_adapter(family: str, size: str):
    """The family's model at the benchmark's size. SD3: the ``overhead.py`` transformer of
    ``size`` (default ``small``: 2 joint blocks of width 128, 64 px); the shipped ShapesWorld
    model as shipped; the others: their tiny builds (``tiny:<family>``)."""
    from diffalign.adapters import load_adapter

    if family == "sd3":
        from overhead import SIZES, build_sd3_pipeline

        from diffalign.adapters.sd3 import SD3Adapter

        return SD3Adapter(build_sd3_pipeline(SIZES[size]))
    if family == "shapes":
        return load_adapter("shapes")
    return load_adapter(f"tiny:{family}")


def resolution_of(family: str, size: str) -> int:
    if family == "sd3":
        from overhead import SIZES

        return SIZES[size].resolution
    return 32 if family == "shapes" else 64


class ForwardLog:
    """Forward pre-hook on the denoiser: the latent and text shapes of every forward."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("hidden_states", kwargs.get("sample", args[0] if args else None))
        text = kwargs.get("encoder_hidden_states", args[2] if len(args) > 2 else None)
        self.calls.append((tuple(x.shape), tuple(text.shape) if text is not None else ()))

    def take(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        calls, self.calls = self.calls, []
        return calls


class Sides:
    """The two ways of sampling the same images with one adapter's pipeline."""

    def __init__(self, family: str, adapter, *, images: int, steps: int, guidance: float, resolution: int):
        from diffalign.sampling import build_kernel

        self.family, self.adapter = family, adapter
        self.prompts = [PROMPTS[i % len(PROMPTS)] for i in range(images)]
        self.steps, self.resolution = steps, resolution
        # FLUX.1 is guidance-distilled: one forward per step with the distilled guidance input
        # (the pipeline's guidance_scale), no classifier-free guidance on either side.
        self.guidance = 1.0 if family == "flux" else guidance
        pipe = adapter.pipeline
        if adapter.prediction_type == "epsilon":
            from diffusers import DDIMScheduler

            pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        sde = "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo"
        self.kernel = build_kernel(adapter, sde, 1.0 if sde == "ddim" else 0.7)

    def pipeline_kwargs(self) -> dict:
        kw = dict(prompt=self.prompts, num_inference_steps=self.steps, height=self.resolution, width=self.resolution,
                  generator=torch.Generator("cpu").manual_seed(0), output_type="pt")
        if self.family == "flux":
            kw["guidance_scale"] = self.adapter.guidance
        else:
            kw["guidance_scale"] = self.guidance
        if self.family in ("sd3", "flux", "sana"):
            kw["max_sequence_length"] = self.adapter.max_sequence_length
        if self.family == "sana":
            kw["use_resolution_binning"] = False
            kw["complex_human_instruction"] = self.adapter.complex_human_instruction
        return kw

    @torch.no_grad()
    def pipeline(self):
        return self.adapter.pipeline(**self.pipeline_kwargs())

    @torch.no_grad()
    def rollout(self):
        from diffalign.sampling import sample_linear

        a = self.adapter
        embeds = a.encode_prompts(self.prompts, with_uncond=self.guidance > 1)
        schedule = a.make_schedule(self.steps, self.resolution, self.resolution)
        mask = torch.ones(self.steps, dtype=torch.bool)
        return sample_linear(a, self.kernel, embeds, schedule, mask, guidance_scale=self.guidance,
                             height=self.resolution, width=self.resolution,
                             generator=torch.Generator("cpu").manual_seed(0))


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU work is asynchronous
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(sides: Sides, repeats: int) -> dict:
    log = ForwardLog(sides.adapter.denoiser)
    sides.pipeline()
    pipe_calls = log.take()
    sides.rollout()
    roll_calls = log.take()
    if pipe_calls != roll_calls:
        raise SystemExit(f"{sides.family}: the two sides ran different forwards "
                         f"(pipeline {len(pipe_calls)} x {pipe_calls[:1]}, rollout {len(roll_calls)} x {roll_calls[:1]})")
    times = {"pipeline": [], "rollout": []}
    for r in range(repeats):
        order = ("pipeline", "rollout") if r % 2 == 0 else ("rollout", "pipeline")
        for side in order:
            times[side].append(timed(getattr(sides, side)))
    best = {side: (min(w for w, _ in ts), min(c for _, c in ts)) for side, ts in times.items()}
    paired = [r[0] / p[0] for r, p in zip(times["rollout"], times["pipeline"])]
    return {"forwards": len(pipe_calls), "rows": pipe_calls[0][0][0], "pipeline": best["pipeline"], "rollout": best["rollout"],
            "wall_ratio": best["rollout"][0] / best["pipeline"][0], "cpu_ratio": best["rollout"][1] / best["pipeline"][1],
            "paired_ratio": statistics.median(paired), "paired_interval": median_interval(paired)}


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The ``level`` percentile bootstrap interval of the median of ``values`` (resampled with
    replacement, a fixed seed: the same values give the same interval)."""
    import numpy as np

    from diffalign.stats import percentile_interval

    data = np.asarray(values, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    return percentile_interval(np.median(data[draws], axis=1), level)


def profile(sides: Sides, repeats: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        sides.rollout()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--size", default="small", help="SD3 transformer size of benchmarks/overhead.py (tiny, small, medium)")
    p.add_argument("--images", type=int, default=8, help="images per call (one batch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=4.5, help="CFG scale (FLUX: none; its distilled guidance input)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", default="", help="a family whose rollout to profile")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; known: {', '.join(FAMILIES)}")

    print(f"rollout (SDE kernel, log-probs, all latents kept) vs stock pipeline __call__; {args.images} images x "
          f"{args.steps} steps, CFG {args.guidance} (FLUX: distilled guidance, no CFG), {args.threads} threads, "
          f"{args.repeats} interleaved repeats; fastest repeat of each side, and the paired ratio: median of the "
          f"per-repeat wall ratios with its 95 % bootstrap interval")
    header = (f"{'family':8}{'res':>5}{'forwards':>10}{'pipeline s':>12}{'rollout s':>11}{'fastest ratio':>15}{'cpu ratio':>11}"
              f"{'paired ratio [95 % interval]':>31}")
    print(header)
    worst = 0.0
    for family in families:
        torch.manual_seed(0)
        adapter = build_adapter(family, args.size)
        res = resolution_of(family, args.size)
        sides = Sides(family, adapter, images=args.images, steps=args.steps, guidance=args.guidance, resolution=res)
        m = measure(sides, args.repeats)
        worst = max(worst, m["paired_ratio"])
        lo, hi = m["paired_interval"]
        flag = ""
        if m["paired_ratio"] > PARITY_GOAL:
            flag = "  SLOWER THAN THE PIPELINE" + (" (outside noise)" if lo > PARITY_GOAL else "")
        print(f"{family:8}{res:>5}{m['forwards']:>6} x{m['rows']:<3}{m['pipeline'][0]:>12.3f}{m['rollout'][0]:>11.3f}"
              f"{m['wall_ratio']:>15.3f}{m['cpu_ratio']:>11.3f}{m['paired_ratio']:>15.3f} [{lo:.3f}, {hi:.3f}]{flag}", flush=True)
        if family == args.profile:
            print(profile(sides, args.repeats))
    print(f"worst paired ratio {worst:.3f} (goal <= {PARITY_GOAL:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
