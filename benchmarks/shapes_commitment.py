"""When does a ShapesWorld model commit to what it draws? Branch its rollouts and see what changes.

    python benchmarks/shapes_commitment.py [--model shapes] [--prompts validation] [--family position]
        [--images 96] [--steps 10] [--noise-level 0.7] [--guidance-scale 4.0] [--seed 1234] [--threads 2]

Samples ``--images`` images of one family's prompts (round-robin, one fixed noise seed) with the
deterministic (ODE) sampler and keeps every state. Then, from each step ``k``, it continues every
state ``x_k`` with the Flow-GRPO SDE kernel (``--noise-level``, fresh noise) to a new final image:
what the model had not yet committed to at step ``k`` can still change there, and what it had
cannot. ShapesEval finds the objects of both images. Among the branched images that show the same
number of objects as the original, each branched object is matched to the nearest original one:

- ``layout kept``: every matched pair is within ``--radius`` pixels (the objects stayed put);
- of those, ``colours kept`` and ``shapes kept``: every matched pair has the same colour / shape.

On position prompts (two shapes, colours drawn at random by the renders) the relation is right
when the right shape lands on the right side: a model that fixes the layout and the colours early
but the shapes late decides which blob becomes which shape after the layout is set. Also prints,
per ``k``, the share of branched images that pass ShapesEval. The SDE with the main job's settings
(10 steps, noise level 0.7) is what Flow-GRPO explores with, so the table also says at which
steps exploration can still change a property. A diagnostic: no intervals.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, str(path))


def match_objects(original: list[dict], branched: list[dict]) -> list[tuple[dict, dict]] | None:
    """Pair each branched object with the nearest original one (greedy by distance, each used
    once); ``None`` when the two images show different numbers of objects or none."""
    if not original or len(original) != len(branched):
        return None
    pairs = sorted(((math.dist((a["cx"], a["cy"]), (b["cx"], b["cy"])), i, j)
                    for i, a in enumerate(original) for j, b in enumerate(branched)))
    used_a, used_b, out = set(), set(), []
    for _, i, j in pairs:
        if i not in used_a and j not in used_b:
            used_a.add(i), used_b.add(j)
            out.append((original[i], branched[j]))
    return out


def compare(original: list[dict], branched: list[dict], radius: float) -> dict[str, bool] | None:
    """``layout``, ``colours``, ``shapes`` kept between two images' objects (see the module
    docstring); ``None`` when they cannot be matched."""
    pairs = match_objects(original, branched)
    if pairs is None:
        return None
    layout = all(math.dist((a["cx"], a["cy"]), (b["cx"], b["cy"])) <= radius for a, b in pairs)
    return {"layout": layout, "colours": all(a["color"] == b["color"] for a, b in pairs),
            "shapes": all(a["shape"] == b["shape"] for a, b in pairs)}


def summarise(records: list[dict], originals: list[dict], radius: float) -> dict[str, float]:
    """Shares over one branch step's images: ``matched`` (same object count as the original),
    ``layout`` (of all images), ``colours`` and ``shapes`` (of those whose layout was kept), ``passed``."""
    rows = [compare(o["objects"], r["objects"], radius) for o, r in zip(originals, records)]
    matched = [c for c in rows if c is not None]
    kept = [c for c in matched if c["layout"]]
    n = len(records)
    return {"images": n, "matched": len(matched) / n, "layout": len(kept) / n,
            "colours": sum(c["colours"] for c in kept) / len(kept) if kept else float("nan"),
            "shapes": sum(c["shapes"] for c in kept) / len(kept) if kept else float("nan"),
            "passed": sum(r["passed"] for r in records) / n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shapes", help="model id (default: the shipped shapes model)")
    p.add_argument("--prompts", default="validation", help="heldout | validation | train | probe")
    p.add_argument("--family", default="position", help="the GenEval family whose prompts to sample")
    p.add_argument("--images", type=int, default=96)
    p.add_argument("--steps", type=int, default=10, help="sampling steps (the main job trains with 10)")
    p.add_argument("--noise-level", type=float, default=0.7, help="Flow-GRPO SDE noise level of the branches")
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--radius", type=float, default=3.0, help="pixels an object may move and count as kept")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto")
    args = p.parse_args(argv)

    import torch
    from shapes_failures import prompt_set

    from diffalign.adapters import load_adapter
    from diffalign.evaluation import eval_autocast_dtype, maybe_autocast
    from diffalign.sampling import build_kernel, draw_noise, sample_linear
    from diffalign.shapes import FAMILIES, evaluation_prompts
    from diffalign.shapes.world import prompt_family
    from reward_models.shapes_eval import ShapesEval

    if args.family not in FAMILIES:
        raise SystemExit(f"--family: unknown {args.family!r}; known: {', '.join(FAMILIES)}")
    torch.set_num_threads(args.threads)
    family_prompts = [q for q in prompt_set(args.prompts) if prompt_family(q) == args.family]
    if not family_prompts:
        raise SystemExit(f"--family: no {args.family} prompts in --prompts {args.prompts}")
    prompts = evaluation_prompts(family_prompts, args.images)
    adapter = load_adapter(args.model)
    dtype = eval_autocast_dtype(args.mixed_precision, adapter.device.type)
    side = adapter.default_resolution
    schedule = adapter.make_schedule(args.steps, side, side)
    ode = build_kernel(adapter, "flow_grpo", 0.0)
    sde = build_kernel(adapter, "flow_grpo", args.noise_level)
    scorer = ShapesEval()
    gen = torch.Generator("cpu").manual_seed(args.seed)

    def run(kernel, embeds, start, sched, mask, generator):
        with maybe_autocast(dtype, adapter.device.type):
            return sample_linear(adapter, kernel, embeds, sched, mask, guidance_scale=args.guidance_scale,
                                 height=side, width=side, noise=start, generator=generator)

    originals, branches = [], {k: [] for k in range(args.steps)}
    for s in range(0, len(prompts), args.batch_size):
        chunk = prompts[s : s + args.batch_size]
        embeds = adapter.encode_prompts(chunk, with_uncond=args.guidance_scale > 1)
        noise = draw_noise(adapter, len(chunk), side, side, gen)
        traj = run(ode, embeds, noise, schedule, torch.zeros(args.steps, dtype=torch.bool), None)
        originals += scorer.evaluate(traj.images, chunk)
        for k in range(args.steps):  # continue x_k stochastically on steps k .. steps-1
            branch_gen = torch.Generator("cpu").manual_seed(args.seed + 1 + k)
            out = run(sde, embeds, traj.latents[:, k], schedule[k:], torch.ones(args.steps - k, dtype=torch.bool),
                      branch_gen)
            branches[k] += scorer.evaluate(out.images, chunk)

    print(f"{args.model}: {args.family} prompts ({args.prompts}), {len(prompts)} images, {args.steps} ODE steps, "
          f"CFG {args.guidance_scale}, seed {args.seed}; branched from step k with the Flow-GRPO SDE (noise level "
          f"{args.noise_level}); originals passing: {sum(r['passed'] for r in originals) / len(originals):.3f}")
    print("layout kept: objects within %.0f px of the original's (share of all images); colours / shapes kept: "
          "share of the layout-kept images" % args.radius)
    print(f"{'k':>3}{'sigma':>8}{'matched':>9}{'layout':>8}{'colours':>9}{'shapes':>8}{'passed':>8}")
    for k in range(args.steps):
        row = summarise(branches[k], originals, args.radius)
        print(f"{k:>3}{float(schedule[k]):>8.3f}{row['matched']:>9.3f}{row['layout']:>8.3f}{row['colours']:>9.3f}"
              f"{row['shapes']:>8.3f}{row['passed']:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
