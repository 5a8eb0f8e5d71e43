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
A second table splits the colour failures of colour attribution ("a red circle and a blue
square") by what the two objects show (:data:`BINDING_KINDS`): ``swapped`` (each in the other's
colour), ``one_colour`` (both in the same one of the two named colours: the prompt's colours
treated as one property of the whole image), ``one_right`` (one object right, the other in an
unnamed colour) and ``other``. A third table asks whether the model reads the relation word: of
the position images with the right objects, the share where the prompted relation holds (they
pass), where the opposite one holds instead ("left of" for "right of", "above" for "below") and
where neither does. A model that ignores the relation passes about as often as it
draws the opposite.
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
BINDING_KINDS = ("swapped", "one_colour", "one_right", "other")
RELATION_KINDS = ("prompted", "opposite", "neither")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def prompt_set(name: str) -> list[str]:
    """:func:`diffalign.shapes.prompt_set`, with an unknown name as a ``--prompts`` usage error."""
    from diffalign.shapes import PromptError, prompt_set as named_set

    try:
        return named_set(name)
    except PromptError as exc:
        raise SystemExit(f"--prompts: {exc}") from None


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


def binding_kind(record: dict) -> str | None:
    """What a colour-attribution image with a colour failure shows (one of :data:`BINDING_KINDS`);
    ``None`` for any other image."""
    from diffalign.shapes.world import parse_prompt

    if record["family"] != "color_attr" or failure_category(record) != "colour":
        return None
    wanted = {o.shape: o.color for o in parse_prompt(record["prompt"]).objects}
    got = {o["shape"]: o["color"] for o in record["objects"]}  # the count check passed: one per shape
    shown = [got[shape] for shape in wanted]
    named = set(wanted.values())
    if set(shown) == named:  # both named colours, and not on their shapes
        return "swapped"
    if len(set(shown)) == 1 and shown[0] in named:
        return "one_colour"
    if any(got[shape] == colour for shape, colour in wanted.items()):
        return "one_right"
    return "other"


def binding_breakdown(records: list[dict]) -> dict[str, float]:
    """Shares of the colour-attribution images in each of :data:`BINDING_KINDS` (plus ``images``)."""
    rows = [r for r in records if r["family"] == "color_attr"]
    kinds = Counter(binding_kind(r) for r in rows)
    return {"images": len(rows), **{k: kinds[k] / len(rows) if rows else 0.0 for k in BINDING_KINDS}}


def relation_kind(record: dict) -> str | None:
    """Which of :data:`RELATION_KINDS` a position image with the right objects (passed, or failed
    only the relation) shows; ``None`` for any other image."""
    from types import SimpleNamespace

    from diffalign.shapes.scenes import relation_holds
    from diffalign.shapes.world import parse_prompt

    if record["family"] != "position" or failure_category(record) not in (None, "relation"):
        return None
    spec = parse_prompt(record["prompt"])
    found = {o["shape"]: SimpleNamespace(**o) for o in record["objects"]}  # the count check passed: one per shape
    a, b = (found[o.shape] for o in spec.objects)
    if relation_holds(a, b, spec.relation):
        return "prompted"
    return "opposite" if relation_holds(a, b, OPPOSITE[spec.relation]) else "neither"


def relation_breakdown(records: list[dict]) -> dict[str, float]:
    """Shares of the position images in each of :data:`RELATION_KINDS` (plus ``images``)."""
    rows = [r for r in records if r["family"] == "position"]
    kinds = Counter(relation_kind(r) for r in rows)
    return {"images": len(rows), **{k: kinds[k] / len(rows) if rows else 0.0 for k in RELATION_KINDS}}


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
    from diffalign.evaluation import eval_autocast_dtype, maybe_autocast
    from diffalign.sampling import sample_images
    from diffalign.shapes import FAMILIES, evaluation_prompts
    from reward_models.shapes_eval import ShapesEval

    torch.set_num_threads(args.threads)
    scales = [float(s) for s in args.guidance_scales.split(",") if s]
    prompts = evaluation_prompts(prompt_set(args.prompts), args.images_per_family)
    adapter = load_adapter(args.model)
    dtype = eval_autocast_dtype(args.mixed_precision, adapter.device.type)
    print(f"{args.model}: {args.prompts} prompts, {len(prompts)} images, {args.steps} ODE steps, seed {args.seed}, "
          f"{'bf16 autocast' if dtype is not None else 'fp32'}; shares of each family's images")
    print(f"{'cfg':>5} {'family':<14}{'images':>7}{'passed':>8}" + "".join(f"{c:>10}" for c in CATEGORIES))
    binding, relations = {}, {}
    for scale in scales:
        with maybe_autocast(dtype, adapter.device.type):
            images = sample_images(adapter, prompts, num_steps=args.steps, guidance_scale=scale,
                                   resolution=adapter.default_resolution, seed=args.seed, batch_size=args.batch_size)
        records = ShapesEval().evaluate(images, prompts)
        table = breakdown(records)
        for family in (f for f in FAMILIES if f in table):
            row = table[family]
            print(f"{scale:>5.1f} {family:<14}{row['images']:>7}{row['passed']:>8.3f}"
                  + "".join(f"{row[c]:>10.3f}" for c in CATEGORIES), flush=True)
        binding[scale] = binding_breakdown(records)
        relations[scale] = relation_breakdown(records)
    if any(row["images"] for row in binding.values()):
        print("\ncolour attribution, colour failures by what the two objects show (shares of its images)")
        print(f"{'cfg':>5} {'images':>7}" + "".join(f"{k:>11}" for k in BINDING_KINDS))
        for scale, row in binding.items():
            print(f"{scale:>5.1f} {row['images']:>7}" + "".join(f"{row[k]:>11.3f}" for k in BINDING_KINDS))
    if any(row["images"] for row in relations.values()):
        print("\nposition, images with the right objects: which relation holds (shares of its images)")
        print(f"{'cfg':>5} {'images':>7}" + "".join(f"{k:>11}" for k in RELATION_KINDS))
        for scale, row in relations.items():
            print(f"{scale:>5.1f} {row['images']:>7}" + "".join(f"{row[k]:>11.3f}" for k in RELATION_KINDS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
