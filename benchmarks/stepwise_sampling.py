"""Step-wise sampling under a DRM vs plain sampling, at equal steps and at matched compute (ShapesWorld).

Side by side in one process, on the held-out prompts with the same seeds (every method starts
from the same initial noise):

- ``ode``: plain deterministic sampling, T steps;
- ``sde``: plain SDE sampling with the branching kernel, T steps (what step-wise sampling selects
  from, without selection);
- ``stepwise k=K``: K SDE candidates per step, the best under the DRM kept (equal steps);
- matched compute, with ``m`` = measured seconds per image of step-wise / of ``sde``:
  ``ode T*m steps`` (more steps), and ``best-of-n sde`` (n = round(m) full SDE samples per prompt,
  the one the DRM scores best at t = 0 kept).

Prints ShapesEval accuracy per family, denoiser and DRM forwards per image and seconds per image
(``--clock wall`` or ``cpu``; on a shared CPU only CPU time is steady enough to match compute);
saves ``accuracy_vs_compute.png`` and ``results.json``.

    python benchmarks/stepwise_sampling.py --drm runs/drm_shapes                   # the real run
    python benchmarks/stepwise_sampling.py --model tiny:shapes --drm DIR --num-prompts 2 --steps 3   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drm", required=True, help="DRM folder (diffalign train-reward configs/shapes/drm_step_grpo.yaml)")
    p.add_argument("--model", default="shapes", help="model id or run directory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--kernel", default="flow_grpo")
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--num-prompts", type=int, default=0, help="first N held-out prompts (0 = all 86)")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: what a user waits (use on a free machine / GPU); cpu: process CPU time, steadier on a shared CPU")
    p.add_argument("--out", default=str(ROOT / "runs/bench_stepwise_sampling"))
    args = p.parse_args(argv)

    import torch

    import reward_models
    from diffalign.drm.model import check_compatible
    from diffalign.forward_process import model_time
    from diffalign.drm.sampling import load_model, stepwise_sample
    from diffalign.evaluation import format_table
    from diffalign.sampling import build_kernel, draw_noise
    from diffalign.shapes import split_prompts

    adapter = load_model(args.model)
    drm = reward_models.build("drm", path=args.drm)
    check_compatible(drm, adapter, key="--drm")
    res = adapter.default_resolution
    heldout = split_prompts().evaluation()
    prompts = heldout[: args.num_prompts] if args.num_prompts else heldout
    prompts = [q for q in prompts for _ in range(args.samples_per_prompt)]
    kernel = build_kernel(adapter, args.kernel, args.noise_level)
    judge = reward_models.build("shapes_eval")
    g = args.guidance_scale
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def run(name: str, steps: int, branches: int, *, sde: bool, best_of: int = 1) -> dict:
        """Sample every prompt with a fixed seed; returns accuracy, time and forwards per image."""
        schedule = adapter.make_schedule(steps, res, res)
        gen = torch.Generator("cpu").manual_seed(args.seed)
        images = []
        t0 = clock()
        for s in range(0, len(prompts), args.batch_size):
            chunk = prompts[s : s + args.batch_size]
            embeds = adapter.encode_prompts(chunk, with_uncond=g > 1)
            noise = draw_noise(adapter, len(chunk), res, res, gen)  # the same start for every method
            mask = None if sde else torch.zeros(steps, dtype=torch.bool)
            candidates, scores = [], []
            for j in range(best_of):
                start = noise if j == 0 else draw_noise(adapter, len(chunk), res, res, gen)
                out = stepwise_sample(adapter, kernel, embeds, chunk, schedule, drm.score_latents if branches > 1 else None,
                                      branches=branches, guidance_scale=g, height=res, width=res, noise=start, generator=gen,
                                      branch_mask=mask)
                candidates.append(out)
                if best_of > 1:
                    scores.append(drm.score_latents(out.latents, model_time(adapter, torch.zeros(len(chunk))), chunk))
            if best_of > 1:
                pick = torch.stack(scores, 1).argmax(1)
                images.append(torch.stack([c.images.cpu() for c in candidates], 1)[torch.arange(len(chunk)), pick])
            else:
                images.append(candidates[0].images.cpu())
        seconds = (clock() - t0) / len(prompts)
        # forwards per image: best_of samples, each T denoiser forwards and (T - 1) k DRM forwards, + 1 final DRM score
        dnf = candidates[0].denoiser_forwards * best_of
        drf = candidates[0].scorer_forwards * best_of + (1 if best_of > 1 else 0)
        imgs = torch.cat(images)
        judge(imgs, prompts, [{} for _ in prompts])
        row = {"method": name, "steps": steps, "denoiser_forwards": dnf, "drm_forwards": drf, "seconds_per_image": seconds,
               **{k: float(v) for k, v in judge.last_info.items()}}
        print(f"  {name}: accuracy {row.get('acc/overall', float('nan')):.3f}, {seconds:.3f} s/image", file=sys.stderr, flush=True)
        return row

    k, T = args.branches, args.steps
    # warm-up (first calls allocate and initialise kernels): not timed
    warm = adapter.encode_prompts(prompts[:1], with_uncond=g > 1)
    stepwise_sample(adapter, kernel, warm, prompts[:1], adapter.make_schedule(2, res, res), drm.score_latents, branches=min(k, 2),
                    guidance_scale=g, height=res, width=res, generator=torch.Generator().manual_seed(0))
    rows = [run("ode", T, 1, sde=False), run("sde", T, 1, sde=True), run(f"stepwise k={k}", T, k, sde=True)]
    m = rows[2]["seconds_per_image"] / max(rows[1]["seconds_per_image"], 1e-9)
    n = max(1, round(m))
    m_ode = rows[2]["seconds_per_image"] / max(rows[0]["seconds_per_image"], 1e-9)
    rows.append(run(f"ode {max(T, round(T * m_ode))} steps (matched)", max(T, round(T * m_ode)), 1, sde=False))
    rows.append(run(f"best-of-{n} sde (matched)", T, 1, sde=True, best_of=n))

    columns = {r["method"]: {k2: v for k2, v in r.items() if k2.startswith("acc/") or k2 in ("seconds_per_image",)} for r in rows}
    print(f"held-out prompts: {len(prompts) // args.samples_per_prompt} x {args.samples_per_prompt} samples, CFG {g}, kernel "
          f"{args.kernel} (noise {args.noise_level}), model {args.model}, DRM {args.drm}")
    print(format_table(columns))
    print(f"{'method':<32} {'steps':>5} {'denoiser fwd':>12} {'DRM fwd':>8} {'s/image':>8}")
    for r in rows:
        print(f"{r['method']:<32} {r['steps']:>5} {r['denoiser_forwards']:>12} {r['drm_forwards']:>8} {r['seconds_per_image']:>8.3f}")
    print(f"compute ratio step-wise / sde = {m:.2f} (best-of-{n}), step-wise / ode = {m_ode:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["seconds_per_image"], r.get("acc/overall", math.nan), label=r["method"])
    ax.set_xlabel("seconds per image")
    ax.set_ylabel("held-out ShapesEval accuracy")
    ax.set_title("step-wise sampling vs plain sampling", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_compute.png", dpi=120)
    plt.close(fig)
    print(f"plot: {out / 'accuracy_vs_compute.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
