"""Toolkit overhead: one Flow-GRPO iteration against the bare model work it contains.

    python benchmarks/overhead.py [--size small|medium|tiny] [--iterations N] [--repeats R] [--threads T] [--profile]
                                  [key=value ...]   # extra config overrides, e.g. sampling.num_steps=10

Both sides run in one process on the same objects (one SD3 pipeline saved with ``save_pretrained``
and loaded back through ``model.id=<folder>``, one LoRA, one optimizer):

- **toolkit**: ``FlowGRPOTrainer.iteration(i)``: prompts -> text encoding -> SDE rollout with
  log-probs -> VAE decode -> reward (worker thread) -> advantages -> clipped PPO update with the
  KL reference forward (LoRA disabled) -> gradient clipping, AdamW, EMA;
- **raw**: the same denoiser forwards written as bare loops: per rollout chunk ``num_steps``
  CFG forwards (2B rows) with an Euler update, then per trained (sample batch, step) one forward
  with grad, one no-grad forward with the LoRA disabled (when ``beta > 0``), one backward, and an
  AdamW step per optimizer step. Prompts are encoded once beforehand.

Everything the raw side leaves out (text encoding, VAE decode, reward, advantages, the kernels'
log-probs, the self-check, gradient clipping, EMA, accelerate's wrappers) counts as overhead.
A forward pre-hook on the denoiser records every forward's batch shape and grad mode; the two
sides must match exactly, or the benchmark stops.

Repetitions alternate (toolkit raw, raw toolkit, ...) after one warm-up iteration of each, so
that load from other processes hits both sides alike; the table reports medians of wall time and
of the process's CPU time (which waiting for a busy CPU does not inflate). The exit code is
0 whatever the ratio (this is a measurement, not a test); a ratio above the goal prints
``OVERHEAD ABOVE 1.10``. ``--profile`` adds a cProfile of the toolkit iterations.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built in code: never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

OVERHEAD_GOAL = 1.10  # toolkit / raw seconds per iteration we aim to stay under


from benchmarks.sd3_models import SIZES, ModelSize, build_sd3_pipeline  # noqa: E402,F401 (SIZES, build_sd3_pipeline: used via this module too)


# --------------------------------------------------------------------------------------------
# The run: one Flow-GRPO config shared by both sides
# --------------------------------------------------------------------------------------------

PROMPTS = ["a cat", "a dog", "a red car", "a tree on a hill", "a blue house", "two small stars"]


def bench_config(model_dir: str, output_dir: str, size: ModelSize, overrides: list[str]):
    from diffalign.config_files import load_config

    base = {
        "output_dir": output_dir,
        "seed": 0,
        "model": {"id": model_dir, "resolution": size.resolution},
        "lora": {"enabled": True, "rank": 8, "alpha": 16},
        "sampling": {"num_steps": 6, "guidance_scale": 4.5, "kernel": "flow_grpo", "noise_level": 0.7},
        # 8 images in 2 chunks of 4: the rollout's chunking and reward overlap are exercised
        "rollout": {"prompts_per_iteration": 2, "group_size": 4, "sample_batch_size": 4},
        "reward": {"name": "jpeg_compressibility"},
        "prompts": {"source": "list", "train": PROMPTS},
        # beta > 0: the reference forward is part of every trained step. Zero-std groups are
        # kept so that the number of trained samples (and so of forwards) is fixed.
        "algorithm": {"name": "flow_grpo", "beta": 0.04, "filter_zero_std_groups": False},
        "train": {"batch_size": 4, "optimizer_steps_per_iteration": 1},
        "eval": {"at_start": False, "every": 0},  # never called: only iteration() is timed
        "checkpoint": {"every": 0},
        "log": {"progress_bar": False, "report": False},
    }
    return load_config(base=copy.deepcopy(base), overrides=overrides)


class ForwardLog:
    """Forward pre-hook on the denoiser: one ``(batch shape, grad enabled)`` entry per forward."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[tuple[int, ...], bool]] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.calls.append((tuple(x.shape), torch.is_grad_enabled()))

    def take(self) -> list[tuple[tuple[int, ...], bool]]:
        calls, self.calls = self.calls, []
        return calls


class RawIteration:
    """The denoiser work of one Flow-GRPO iteration as bare loops (see the module docstring).

    Uses the trainer's own denoiser (with its LoRA), the unwrapped torch optimizer and prompt
    embeddings encoded once here; the shapes follow ``cfg`` exactly as the recipe does.
    """

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.cfg = cfg
        self.adapter = trainer.adapter
        self.denoiser = trainer.adapter.denoiser
        self.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper -> torch's
        self.guidance = cfg.sampling.guidance_scale
        self.use_cfg = self.guidance > 1
        self.beta = cfg.algorithm.beta
        self.lora = cfg.lora.enabled
        self.n = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
        res = trainer.resolution
        self.latent_shape = trainer.adapter.latent_shape(res, res)
        sigmas = trainer.adapter.make_schedule(cfg.sampling.num_steps, res, res)  # (T+1,) flow sigmas, 1 -> 0
        self.sigmas = sigmas.tolist()
        n_train = trainer.adapter.pipeline.scheduler.config.num_train_timesteps  # the transformer takes sigma * 1000
        self.device = trainer.adapter.device
        self.timesteps = [torch.full((self.n * (2 if self.use_cfg else 1),), s * n_train, device=self.device) for s in self.sigmas]
        prompts = [p for p in PROMPTS[: cfg.rollout.prompts_per_iteration] for _ in range(cfg.rollout.group_size)]
        embeds = trainer.adapter.encode_prompts(prompts, with_uncond=self.use_cfg)
        self.embeds = embeds
        self.generator = torch.Generator("cpu").manual_seed(cfg.seed)
        # trained steps: the first K stochastic steps (the recipe's default selection); with a
        # random selection the step indices differ per sample but the shapes do not
        self.k = cfg.derived()["trained_steps_per_sample"]

    def _cond(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder_hidden_states, pooled_projections) for ``rows``, [uncond; cond] under CFG."""
        e = self.embeds
        if not self.use_cfg:
            return e.cond["encoder_hidden_states"][rows], e.cond["pooled_projections"][rows]
        return (torch.cat([e.uncond["encoder_hidden_states"][rows], e.cond["encoder_hidden_states"][rows]]),
                torch.cat([e.uncond["pooled_projections"][rows], e.cond["pooled_projections"][rows]]))

    def _velocity(self, x: torch.Tensor, step: int, hidden: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        rows = len(x) * (2 if self.use_cfg else 1)
        v = self.denoiser(hidden_states=torch.cat([x, x]) if self.use_cfg else x, timestep=self.timesteps[step][:rows],
                          encoder_hidden_states=hidden, pooled_projections=pooled, return_dict=False)[0]
        if not self.use_cfg:
            return v
        uncond, cond = v.chunk(2)
        return uncond + self.guidance * (cond - uncond)

    def __call__(self, iteration: int) -> None:
        cfg = self.cfg
        num_steps = cfg.sampling.num_steps
        # rollout: chunks of sample_batch_size, num_steps forwards each, Euler steps, latents kept
        self.denoiser.eval()
        chunks = []
        with torch.no_grad():
            for start in range(0, self.n, cfg.rollout.sample_batch_size):
                rows = slice(start, min(start + cfg.rollout.sample_batch_size, self.n))
                hidden, pooled = self._cond(rows)
                x = torch.randn(rows.stop - rows.start, *self.latent_shape, generator=self.generator).to(self.device)
                states = [x]
                for i in range(num_steps):
                    x = x + (self.sigmas[i + 1] - self.sigmas[i]) * self._velocity(x, i, hidden, pooled)
                    states.append(x)
                chunks.append(torch.stack(states, dim=1))  # (b, T+1, C, h, w)
        latents = torch.cat(chunks)
        # update: per (sample batch, trained step) a forward with grad, the reference forward, a backward
        self.denoiser.train()
        bs = cfg.train.batch_size
        for _epoch in range(cfg.train.inner_epochs):
            batches = [slice(s, min(s + bs, self.n)) for s in range(0, self.n, bs)]
            micro = [(b, j) for b in batches for j in range(self.k)]
            for group in np.array_split(np.arange(len(micro)), cfg.train.optimizer_steps_per_iteration):
                for m in group:
                    rows, j = micro[m]
                    hidden, pooled = self._cond(rows)
                    x = latents[rows, j]
                    v = self._velocity(x, j, hidden, pooled)
                    if self.beta > 0:
                        with torch.no_grad():
                            if self.lora:
                                self.denoiser.disable_adapters()
                            v_ref = self._velocity(x, j, hidden, pooled)
                            if self.lora:
                                self.denoiser.enable_adapters()
                        loss = (v - v_ref).square().mean()
                    else:
                        loss = v.square().mean()
                    (loss / len(group)).backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One side's timings, one entry per timed repetition."""

    wall: list[float]  # wall seconds per iteration
    cpu: list[float]  # CPU seconds per iteration of the whole process (all threads, reward worker included)
    nfe: int  # denoiser forwards per iteration

    def median(self, kind: str) -> float:
        return statistics.median(getattr(self, kind))


@dataclass
class BenchmarkResult:
    size: str
    toolkit: Side
    raw: Side
    forward_seconds: float  # median wall time of one no-grad CFG forward at the rollout chunk's shape
    load_before: tuple[float, float, float]  # os.getloadavg()
    load_after: tuple[float, float, float]
    profile: str = ""  # --profile's report

    def ratio(self, kind: str = "wall") -> float:
        """toolkit / raw of the medians; ``kind`` is "wall" or "cpu"."""
        return self.toolkit.median(kind) / self.raw.median(kind)

    def paired_ratio(self, kind: str = "wall") -> float:
        """Median of the per-repeat ratios: each pair ran back to back, under about the same load."""
        return statistics.median(a / b for a, b in zip(getattr(self.toolkit, kind), getattr(self.raw, kind)))


def _run_block(fn, start: int, iterations: int, log: ForwardLog, side: Side | None, calls: list) -> None:
    """Run ``fn(i)`` ``iterations`` times; append the per-iteration wall and CPU seconds to
    ``side`` (None: a warm-up) and each iteration's forwards to ``calls``."""
    gc.collect()
    wall = cpu = 0.0
    for i in range(start, start + iterations):
        w0, c0 = time.perf_counter(), time.process_time()
        fn(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # GPU work is asynchronous: count it in the iteration that queued it
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        calls.append(log.take())
    if side is not None:
        side.wall.append(wall / iterations)
        side.cpu.append(cpu / iterations)


def _check_same_forwards(toolkit: list, raw: list) -> None:
    """Every iteration of both sides ran the same forwards (batch shape, grad mode), in any order."""
    reference = Counter(toolkit[0])
    for name, per_iteration in (("toolkit", toolkit), ("raw", raw)):
        for calls in per_iteration:
            if Counter(calls) != reference:
                raise AssertionError(
                    f"{name} iteration ran other denoiser forwards than the toolkit's first: "
                    f"{sorted(Counter(calls).items())} vs {sorted(reference.items())}")


def _time_forward(raw: RawIteration, repeats: int = 5) -> float:
    bs = min(raw.cfg.rollout.sample_batch_size, raw.n)
    hidden, pooled = raw._cond(slice(0, bs))
    x = torch.randn(bs, *raw.latent_shape).to(raw.device)
    raw.denoiser.eval()
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            raw._velocity(x, 0, hidden, pooled)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _quiet_progress_bars() -> None:
    """diffusers' and transformers' save / load progress bars would bury the table."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def benchmark(args: argparse.Namespace) -> BenchmarkResult:
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _benchmark(args)
    finally:
        torch.set_num_threads(threads_before)  # main() may run inside another process (the smoke test)


def _benchmark(args: argparse.Namespace) -> BenchmarkResult:
    from diffalign.recipes.flow_grpo import FlowGRPOTrainer

    _quiet_progress_bars()
    size = SIZES[args.size]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="diffalign-bench-") as tmp:
        model_dir, output_dir = os.path.join(tmp, "model"), os.path.join(tmp, "run")
        build_sd3_pipeline(size).save_pretrained(model_dir)  # loaded back below through model.id
        cfg = bench_config(model_dir, output_dir, size, args.overrides)
        trainer = FlowGRPOTrainer(cfg, log=lambda msg: None)
        trainer.setup()
        raw = RawIteration(trainer)
        log = ForwardLog(trainer.adapter.denoiser)
        try:
            forward_seconds = _time_forward(raw)
            log.take()
            # warm-up; the toolkit goes first so that its on-policy self-check sees unchanged weights
            toolkit_calls, raw_calls = [], []
            _run_block(trainer.iteration, 0, 1, log, None, toolkit_calls)
            _run_block(raw, 0, 1, log, None, raw_calls)
            toolkit, raw_side = Side([], [], 0), Side([], [], 0)
            sides = [(trainer.iteration, toolkit, toolkit_calls), (raw, raw_side, raw_calls)]
            next_iteration = 1
            for repeat in range(args.repeats):
                # A B, B A, A B, ...: a load that rises or falls over a pair hits both sides alike
                for fn, side, calls in (sides if repeat % 2 == 0 else sides[::-1]):
                    _run_block(fn, next_iteration, args.iterations, log, side, calls)
                next_iteration += args.iterations
            toolkit.nfe, raw_side.nfe = len(toolkit_calls[0]), len(raw_calls[0])
            _check_same_forwards(toolkit_calls, raw_calls)
            profile = profile_toolkit(trainer, next_iteration, max(2, args.iterations)) if args.profile else ""
        finally:
            log.handle.remove()
            trainer.reward_pool.shutdown()  # the reward worker thread; Trainer.train() shuts it down the same way
    return BenchmarkResult(args.size, toolkit, raw_side, forward_seconds, load_before, os.getloadavg(), profile)


# Disjoint parts of a toolkit iteration, found in the profile by (file name, function name) and,
# where the function is also called elsewhere, the calling function; "raw" marks work the raw side
# also does.
PROFILE_PARTS = [
    ("denoiser forwards (raw)", "transformer_sd3.py", "forward", None),
    ("backward (raw)", "_tensor.py", "backward", None),
    ("LoRA off/on around the reference (raw)", "trainer.py", "reference_model", None),
    ("AdamW + grad clip + EMA (AdamW raw)", "trainer.py", "optimizer_step", None),
    ("denoiser.dtype in adapter.predict", "modeling_utils.py", "dtype", "predict"),
    ("kernel steps with log-probs", "sampling.py", "step", None),
    ("VAE decode", "sd3.py", "decode", None),
    ("text encoding", "sd3.py", "encode_prompts", None),
    ("waiting for the reward thread", "_base.py", "result", None),
    ("PPO loss + KL", "flow_grpo.py", "ppo_clip_loss", None),
    ("PPO loss + KL", "flow_grpo.py", "gaussian_mean_kl", None),
    ("advantages", "flow_grpo.py", "group_advantages", None),
    ("on-policy self-check", "flow_grpo.py", "_self_check", None),
]


def profile_toolkit(trainer, start: int, iterations: int, top: int = 25) -> str:
    """cProfile of ``iterations`` toolkit iterations: milliseconds per iteration in the parts of
    :data:`PROFILE_PARTS` (the rest is glue), then the top functions by own time. The reward runs
    in a worker thread, which cProfile does not see; the main thread's wait for it is shown."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(start, start + iterations):
        trainer.iteration(i)
    profiler.disable()
    stats = pstats.Stats(profiler)
    per_iteration_ms = 1000 / iterations
    parts: dict[str, float] = {}
    total = 0.0
    for (filename, _line, function), (_cc, _nc, _tt, cumulative, callers) in stats.stats.items():
        if function == "iteration" and filename.endswith("flow_grpo.py"):
            total += cumulative
        for label, file_suffix, name, caller in PROFILE_PARTS:
            if function != name or not filename.endswith(file_suffix):
                continue
            if caller is not None:  # only the time spent under calls from `caller`
                cumulative = sum(c[3] for (_f, _l, fn), c in callers.items() if fn == caller)
            parts[label] = parts.get(label, 0.0) + cumulative
    out = io.StringIO()
    out.write(f"\n=== cProfile of {iterations} toolkit iterations: ms per iteration (profiler overhead included) ===\n")
    for label, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        out.write(f"{label:<44}{seconds * per_iteration_ms:>10.1f}\n")
    out.write(f"{'other (Python glue, Trajectory, ...)':<44}{(total - sum(parts.values())) * per_iteration_ms:>10.1f}\n")
    out.write(f"{'total':<44}{total * per_iteration_ms:>10.1f}\n")
    out.write(f"\n=== top {top} functions by own time ===\n")
    stats.stream = out
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


def format_table(r: BenchmarkResult, args: argparse.Namespace) -> str:
    size = SIZES[r.size]
    ratio = r.ratio("wall")

    def row(name: str, side: Side) -> str:
        return (f"{name:<22}{side.median('wall'):>10.3f}{min(side.wall):>9.3f}{max(side.wall):>9.3f}"
                f"{side.median('cpu'):>14.3f}{side.nfe:>16}")

    lines = [
        f"diffalign overhead: Flow-GRPO iteration, SD3 '{r.size}' ({size.describe()}), torch {torch.__version__}, "
        f"torch threads {args.threads}",
        f"one no-grad CFG forward of a rollout chunk: {r.forward_seconds * 1000:.1f} ms",
        f"{args.repeats} repeats x {args.iterations} iterations per side, interleaved (A B, B A, ...) after 1 warm-up each; "
        f"load average {r.load_before[0]:.2f} before, {r.load_after[0]:.2f} after, on {os.cpu_count()} CPUs",
        "",
        f"{'':<22}{'wall s/iteration':>28}{'CPU s/iter':>14}{'NFE/iteration':>16}",
        f"{'':<22}{'median':>10}{'min':>9}{'max':>9}{'median':>14}",
        row("toolkit (iteration)", r.toolkit),
        row("raw (bare loops)", r.raw),
        "",
        f"ratio toolkit/raw, wall: {ratio:.3f} (medians), {r.paired_ratio('wall'):.3f} (median of per-repeat ratios); "
        f"goal <= {OVERHEAD_GOAL:.2f}",
        f"ratio toolkit/raw, CPU:  {r.ratio('cpu'):.3f} (medians), {r.paired_ratio('cpu'):.3f} (median of per-repeat ratios); "
        "less sensitive to other processes' load",
    ]
    if ratio > OVERHEAD_GOAL:
        lines.append(f"OVERHEAD ABOVE {OVERHEAD_GOAL:.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="denoiser size (tiny: smoke test only)")
    p.add_argument("--iterations", type=int, default=1, help="iterations per timed repetition")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each side, interleaved")
    # 1 by default: on a machine whose cores other processes also use, OpenMP's barrier waits
    # make 2 threads several times slower than 1 (11 vs 48 GFLOP/s measured on 2 shared cores)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of toolkit iterations")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. sampling.num_steps=10")
    args = p.parse_args(argv)
    if args.iterations < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--iterations, --repeats and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> BenchmarkResult:
    args = parse_args(argv)
    result = benchmark(args)
    print(format_table(result, args), flush=True)
    if result.profile:
        print(result.profile, flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)  # a benchmark: the ratio is reported, never an error
