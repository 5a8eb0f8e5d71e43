"""Branching a reverse step into k candidates, and step-wise sampling under a noisy-state scorer.

Step-wise sampling (inference, no training; the DRM paper): at every reverse step draw k SDE
candidates ``x_{t'}^j`` from the shared state ``x_t`` (one denoiser forward: the k candidates
share the Gaussian's mean and differ only in noise), score each noisy candidate with the DRM at
``t'``, and keep the best. The last step (to the clean sample) is a deterministic ODE step by
default, so the output is a clean image; ``branches=1`` is plain SDE sampling with the same noise.

Cost per sample: T denoiser forwards (with CFG, each one batched forward) + ``(T - 1) k`` DRM
forwards on the branched steps.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import reward_models
from diffalign.adapters import load_adapter
from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.drm.model import check_compatible
from diffalign.errors import ConfigError, DiffalignError
from diffalign.export import load_trained_adapter
from diffalign import progress
from diffalign.images import labelled_grid, save_png, short_prompt
from diffalign.sampling import Kernel, build_kernel, draw_noise
from diffalign.shapes.world import PromptError, parse_prompt

MAX_BRANCHES = 64  # k: more candidates than this buys nothing a best-of-n cannot
Scorer = Callable[[torch.Tensor, torch.Tensor, Sequence[str]], torch.Tensor]  # (latents, t (B,), prompts) -> (B,)


def check_branches(k: int, *, key: str, minimum: int = 1) -> None:
    if not minimum <= k <= MAX_BRANCHES:
        raise ConfigError(f"{key} must be in [{minimum}, {MAX_BRANCHES}], got {k}")


@dataclass
class Candidates:
    """``next_states``: (B, k, *latent) fp32; ``log_probs``: (B, k) fp32 under the kernel;
    ``std``: the transition std (B, 1, ...)."""

    next_states: torch.Tensor
    log_probs: torch.Tensor
    std: torch.Tensor


def branch_candidates(kernel: Kernel, model_output: torch.Tensor, x: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                      k: int, *, noise: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> Candidates:
    """k SDE draws of ``x_{t'}`` from each of the B states ``x`` (model output computed once).

    ``noise``: optional (B, k, *latent) standard normal noise (else drawn from ``generator``)."""
    b = x.shape[0]
    rep = lambda v: v.repeat_interleave(k, dim=0)  # noqa: E731 - (B, ...) -> (B k, ...), row-major over (B, k)
    eps = noise.flatten(0, 1) if noise is not None else None
    out = kernel.step(rep(model_output), rep(x), rep(t), rep(t_next), sde=True, noise=eps, generator=generator)
    return Candidates(out.prev_sample.view(b, k, *x.shape[1:]), out.log_prob.view(b, k), out.std.view(b, k, *out.std.shape[1:])[:, 0])


@dataclass
class StepwiseSample:
    """``latents``: (B, *latent) final samples; ``images``: (B, 3, H, W) in [0, 1];
    ``scores``: (B, T) scorer value of the kept candidate at each branched step (NaN elsewhere);
    ``denoiser_forwards`` / ``scorer_forwards``: rows through the policy / scorer per sample."""

    latents: torch.Tensor
    images: torch.Tensor
    scores: torch.Tensor
    denoiser_forwards: int
    scorer_forwards: int


@torch.no_grad()
def stepwise_sample(
    adapter: ModelAdapter,
    kernel: Kernel,
    embeds: PromptEmbeds,
    prompts: Sequence[str],
    schedule: torch.Tensor,
    scorer: Optional[Scorer],
    *,
    branches: int,
    guidance_scale: float,
    height: int,
    width: int,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    branch_mask: Optional[torch.Tensor] = None,
) -> StepwiseSample:
    """Sample ``len(prompts)`` images keeping, at each branched step, the best of ``branches``
    SDE candidates under ``scorer`` (see the module docstring).

    ``branch_mask`` (T,) bool: steps that branch (SDE); the others are ODE steps. Default: every
    step but the last. ``branches == 1`` needs no scorer (plain SDE on the branched steps).
    """
    check_branches(branches, key="branches")
    if branches > 1 and scorer is None:
        raise ConfigError("step-wise sampling with branches > 1 needs a scorer (a DRM)")
    batch = len(prompts)
    num_steps = len(schedule) - 1
    mask = torch.arange(num_steps) < num_steps - 1 if branch_mask is None else branch_mask.to(torch.bool)
    x = (noise if noise is not None else draw_noise(adapter, batch, height, width, generator)).float().to(adapter.device)
    scores = torch.full((batch, num_steps), float("nan"))
    scorer_rows = 0
    for i in range(num_steps):
        t = schedule[i].expand(batch).to(adapter.device)
        t_next = schedule[i + 1].expand(batch).to(adapter.device)
        v = adapter.predict(x, t, embeds, guidance_scale)
        if not mask[i]:
            x = kernel.step(v, x, t, t_next, sde=False).prev_sample.float()
            continue
        cands = branch_candidates(kernel, v, x, t, t_next, branches, generator=generator)
        if branches == 1:
            x = cands.next_states[:, 0]
            continue
        flat = cands.next_states.flatten(0, 1)
        s = scorer(flat, t_next.repeat_interleave(branches), [p for p in prompts for _ in range(branches)]).float().cpu()
        s = s.view(batch, branches)
        scorer_rows += batch * branches
        best = torch.where(torch.isfinite(s), s, torch.full_like(s, -float("inf"))).argmax(dim=1)
        x = cands.next_states[torch.arange(batch), best.to(cands.next_states.device)]
        scores[:, i] = s[torch.arange(batch), best]
    images = adapter.decode(x).float().clamp(0, 1)
    return StepwiseSample(x, images, scores, num_steps, scorer_rows // max(batch, 1))


# ---- the `diffalign sample` command ----------------------------------------------------------
def load_model(model: str, device: str = "cpu") -> ModelAdapter:
    """A run directory (its final/ weights) or any model id ``load_adapter`` takes."""
    path = Path(model)
    if path.is_dir() and ((path / "final").is_dir() or (path / "diffalign.json").is_file()):
        return load_trained_adapter(path, device=device)
    return load_adapter(model, device=device)


SAMPLE_FILES = ("grid.png", "samples.json")
GRID_IMAGES = 64  # images shown in grid.png (samples.json lists every one)
GRID_ROW = 8  # images per row of grid.png
GRID_TILE_PX = (128, 256)  # each image is shown at its own size within these bounds (32 px ShapesWorld: 4x, nearest)


def save_grid(images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float | None], path: Path, *,
              pass_fail: bool = False) -> None:
    """``grid.png``: the first :data:`GRID_IMAGES` images, row by row in the order of ``samples.json``,
    each labelled with its prompt and its reward when one was scored (``pass_fail``: a pass / fail
    reward such as ShapesEval, drawn as the green pass or red fail mark of the evaluation grids)."""
    n = min(len(images), GRID_IMAGES)
    prompts, rewards = list(prompts[:n]), list(rewards[:n])
    marks = [None if r is None else r >= 1 for r in rewards] if pass_fail else None
    labels = [short_prompt(p) if r is None or pass_fail else f"reward {r:.3f}: {short_prompt(p)}"
              for p, r in zip(prompts, rewards)]
    tile = min(max(images.shape[-1], GRID_TILE_PX[0]), GRID_TILE_PX[1])
    save_png(labelled_grid(images[:n].float(), labels, marks, nrow=min(GRID_ROW, n), tile=tile), path)


def check_sample_out(out: Path) -> None:
    """``--out`` may be new, empty or an earlier sample folder; never a file, a run directory or a
    folder holding anything else (its files would be mixed with or replaced by the samples)."""
    if out.is_symlink() or out.is_file():
        raise DiffalignError(f"--out {str(out)!r} is a file or a link; expected a folder")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in SAMPLE_FILES)
        if foreign:
            raise DiffalignError(f"--out {str(out)!r} holds other files ({', '.join(foreign[:3])}"
                                 f"{', ...' if len(foreign) > 3 else ''}); choose a new folder")


def check_shapes_prompts(prompts: list[str], *, scored: bool, log: Callable[[str], None]) -> None:
    """The shapes model learned ShapesWorld's prompt grammar only ("a photo of a red circle"): a
    prompt outside it is refused when ShapesEval is to score it (it could not), else warned about
    once, naming the first such prompt and why it does not parse."""
    outside = []
    for prompt in dict.fromkeys(prompts):
        try:
            parse_prompt(prompt)
        except PromptError as exc:
            outside.append((prompt, exc))
    if not outside:
        return
    prompt, exc = outside[0]
    more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
    if scored:
        raise ConfigError(f"--prompt: {exc}{more}; ShapesEval scores prompts of the shapes grammar only")
    log(f"warning: {exc}{more}; the shapes model was trained on that grammar only, so its images for it mean little")


def run_sample(
    *,
    model: str,
    prompts: list[str],
    out_dir: str,
    steps: int = 20,
    guidance_scale: float = 4.0,
    seed: int = 1234,
    resolution: int = 0,
    drm_path: Optional[str] = None,
    branches: int = 1,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
    reward: Optional[str] = None,
    batch_size: int = 16,
    device: str = "cpu",
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> dict:
    """Plain sampling (``branches == 1``: deterministic ODE) or step-wise sampling (``branches`` k >= 2
    SDE candidates per step, the best under the DRM at ``drm_path`` kept). Writes ``grid.png`` and ``samples.json``
    (prompt, seed, score per image) to ``out_dir``; returns the summary."""
    check_branches(branches, key="--branches")
    if branches > 1 and not drm_path:
        raise ConfigError("--branches > 1 (step-wise sampling) needs --drm DIR (a DRM trained with diffalign train-reward)")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if not prompts:
        raise DiffalignError("no prompts to sample")
    drm = reward_models.build("drm", path=drm_path, device=device) if drm_path else None  # bad folders fail before any model loads
    # a terminal-only bar that clears itself, so that a bad model id still ends in one line
    with progress.bar(desc=f"loading {model}", unit="", disable=not progress.interactive()):
        adapter = load_model(model, device)
    if adapter.family == "shapes":
        check_shapes_prompts(prompts, scored=reward == "shapes_eval", log=log)
    res = resolution or adapter.default_resolution
    scorer_fn = None
    if drm is not None:
        check_compatible(drm, adapter, key="--drm")
        scorer_fn = drm.score_latents
    stepwise = branches >= 2
    gen = torch.Generator("cpu").manual_seed(seed)
    schedule = adapter.make_schedule(steps, res, res)
    kern = build_kernel(adapter, kernel, noise_level)
    t0 = time.perf_counter()
    images, chosen = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        embeds = adapter.encode_prompts(chunk, with_uncond=guidance_scale > 1)
        noise = draw_noise(adapter, len(chunk), res, res, gen)
        mask = None if stepwise else torch.zeros(steps, dtype=torch.bool)  # plain: ODE on every step
        result = stepwise_sample(adapter, kern, embeds, chunk, schedule, scorer_fn if stepwise else None,
                                 branches=branches if stepwise else 1, guidance_scale=guidance_scale, height=res, width=res,
                                 noise=noise, generator=gen, branch_mask=mask)
        images.append(result.images.cpu())
        chosen.append(result.scores)
    seconds = time.perf_counter() - t0
    images_t = torch.cat(images)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"model": model, "method": f"stepwise k={branches}" if stepwise else "plain ODE", "steps": steps, "guidance_scale": guidance_scale, "seed": seed,
               "images": len(prompts), "seconds": seconds, "drm": drm_path}
    per_image = [{"prompt": p} for p in prompts]
    if reward:
        fn = reward_models.build(reward, device=device)
        scores = reward_models.check_reward_output(reward, fn(images_t, prompts, [{} for _ in prompts]), len(prompts))
        summary["reward"] = reward
        summary["reward_mean"] = float(scores[torch.isfinite(scores)].mean())
        summary.update({f"reward/{k}": float(v) for k, v in (getattr(fn, "last_info", None) or {}).items()})
        for row, s in zip(per_image, scores.tolist()):
            row["reward"] = s
    save_grid(images_t, prompts, [row.get("reward") for row in per_image], out / "grid.png", pass_fail=reward == "shapes_eval")
    (out / "samples.json").write_text(json.dumps({"summary": summary, "images": per_image}, indent=2))
    log(f"{summary['method']}: {len(prompts)} images in {seconds:.1f} s -> {out / 'grid.png'}")
    return summary
