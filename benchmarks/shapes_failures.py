"""Why a ShapesWorld model fails: each failed image's first failing check, per family and CFG scale.

    python benchmarks/shapes_failures.py [--model shapes] [--prompts heldout|validation|train|probe]
        [--images-per-family 96] [--guidance-scales 4.0] [--steps 20] [--seed 1234] [--threads 2]

Samples the evaluation list of ``--prompts`` (the prompts of each family repeated round-robin to
``--images-per-family`` images, one fixed noise seed, as ``diffalign eval``) at each CFG scale of
``--guidance-scales``, scores every image with ShapesEval and sorts each failed image into the
first of these that applies:

- ``rejected``: the image fails a gate before any requirement is judged (stray foreground pixels,
  or a blob that is no world object: mixed colours, lopsided, elongated);
- ``count``: the wrong number of some named shape, or objects besides the named ones;
- ``relation``: the right objects in the wrong spatial relation (position family);
- ``colour``: the right objects, one of them in the wrong colour.

Prints, per family, the pass rate and the share of the family's images in each category, so a
failure mode (drawing nothing, miscounting, colours bound to the wrong object) reads off the table.
A diagnostic, not a headline: no intervals (``diffalign eval`` gives those).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

CATEGORIES = ("rejected", "count", "relation", "colour")


def prompt_set(name: str) -> list[str]:
    from diffalign.shapes import split_prompts, validation_split

    split = split_prompts()
    sets = {"heldout": split.evaluation, "validation": lambda: validation_split(split)[1],
            "train": lambda: split.train, "probe": lambda: split.probe}
    if name not in sets:
        raise SystemExit(f"--prompts: unknown {name!r}; known: {', '.join(sets)}")
    return list(sets[name]())


def failure_category(record: dict) -> str | None:
    """The first failing check of one ShapesEval record (``None`` when the image passed)."""
    if record["passed"]:
        return None
    met = record["requirements"]
    if not met:
        return "rejected"
    failed = [name for name, ok in met.items() if not ok]
    if any(name == "no_extra" or name.startswith("count:") for name in failed):
        return "count"
    if "relation" in failed:
        return "relation"
    return "colour"


def breakdown(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per family: ``images``, ``passed`` (share) and the share of the family's images per category."""
    by_family: dict[str, list[dict]] = {}
    for r in records:
        by_family.setdefault(r["family"], []).append(r)
    table = {}
    for family, rows in by_family.items():
        counts = Counter(failure_category(r) for r in rows)
        table[family] = {"images": len(rows), "passed": counts[None] / len(rows),
                         **{c: counts[c] / len(rows) for c in CATEGORIES}}
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shapes", help="model id (default: the shipped shapes model)")
    p.add_argument("--prompts", default="heldout", help="heldout | validation | train | probe")
    p.add_argument("--images-per-family", type=int, default=96)
    p.add_argument("--guidance-scales", default="4.0", help="comma-separated CFG scales")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto",
                   help="denoiser forwards under bf16 autocast (auto: where the CPU computes bf16 natively, as diffalign eval)")
    args = p.parse_args(argv)

    import torch

    from diffalign.adapters import load_adapter
    from diffalign.config import native_bf16
    from diffalign.evaluation import maybe_autocast
    from diffalign.sampling import sample_images
    from diffalign.shapes import FAMILIES, evaluation_prompts
    from reward_models.shapes_eval import ShapesEval

    torch.set_num_threads(args.threads)
    scales = [float(s) for s in args.guidance_scales.split(",") if s]
    prompts = evaluation_prompts(prompt_set(args.prompts), args.images_per_family)
    adapter = load_adapter(args.model)
    bf16 = args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and native_bf16(adapter.device.type))
    print(f"{args.model}: {args.prompts} prompts, {len(prompts)} images, {args.steps} ODE steps, seed {args.seed}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}; shares of each family's images")
    print(f"{'cfg':>5} {'family':<14}{'images':>7}{'passed':>8}" + "".join(f"{c:>10}" for c in CATEGORIES))
    for scale in scales:
        with maybe_autocast(torch.bfloat16 if bf16 else None, adapter.device.type):
            images = sample_images(adapter, prompts, num_steps=args.steps, guidance_scale=scale,
                                   resolution=adapter.default_resolution, seed=args.seed, batch_size=args.batch_size)
        table = breakdown(ShapesEval().evaluate(images, prompts))
        for family in (f for f in FAMILIES if f in table):
            row = table[family]
            print(f"{scale:>5.1f} {family:<14}{row['images']:>7}{row['passed']:>8.3f}"
                  + "".join(f"{row[c]:>10.3f}" for c in CATEGORIES), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
