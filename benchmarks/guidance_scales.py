"""How much of an aligned model's gain would a different CFG scale give the base model for free?

Evaluates the base model (default: the shipped one) and, optionally, trained runs (their
``final/`` weights) at several classifier-free guidance scales, every model and scale with the
same seed, so image ``i`` starts from the same noise everywhere and any two columns pair image
by image. Prints

- the base model at every scale, paired against ``--reference`` (the scale the main job uses);
- for each run, its pass rate at every scale, paired against the base at the same scale and
  against the base at the base's best scale on these prompts (ties: the lower scale; chosen on the
  prompts evaluated, so an optimistic baseline; choose on ``--prompts validation`` before quoting
  held-out numbers).

Results are stored per model and scale under ``--out`` and reused when present (an interrupted
run resumes; one stored with other steps, seed, precision or images is refused). The choice and the
store are :mod:`diffalign.best_scale`'s; ``diffalign eval RUN --best-scale`` is the comparison that
chooses each model's scale on validation prompts and reports held-out ones.

    python benchmarks/guidance_scales.py [--scales 1,2,4] [--prompts validation|heldout] [--run RUN ...]
        [--model shapes] [--images-per-family 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADLINE = "acc/images"


def parse_scales(text: str) -> list[float]:
    from diffalign.best_scale import parse_scales as parse
    from diffalign.errors import DiffalignError

    try:
        return parse(text, "--scales")
    except DiffalignError as exc:
        raise SystemExit(str(exc)) from None


def scale_name(scale: float) -> str:
    return f"CFG {scale:g}"


def main(argv=None) -> int:
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.best_scale import cached_evaluation, choose_scale
    from diffalign.evaluation import (LEGEND, comparison_columns, eval_autocast_dtype, evaluate_shapes, format_table,
                                      shapes_eval_list)
    from diffalign.export import load_trained_adapter
    from diffalign.shapes import prompt_set

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="1,2,4", help="comma-separated CFG scales (1 = no guidance)")
    p.add_argument("--reference", type=float, default=4.0, help="the base model's columns are paired against this scale")
    p.add_argument("--prompts", default="validation", help="validation (training prompts set aside) or heldout")
    p.add_argument("--model", default="shapes", help="base model: 'shapes' (shipped) or a saved pipeline folder")
    p.add_argument("--run", action="append", default=[], help="a trained run directory (repeatable)")
    p.add_argument("--images-per-family", type=int, default=96)
    p.add_argument("--steps", type=int, default=20, help="ODE steps (the main job's evaluation uses 20)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto")
    p.add_argument("--out", default=None, help="store each evaluation here and reuse it when present")
    args = p.parse_args(argv)
    scales = parse_scales(args.scales)
    if args.reference not in scales:
        scales = sorted({*scales, args.reference})
    if args.prompts not in ("validation", "heldout"):
        raise SystemExit(f"--prompts: validation or heldout, got {args.prompts!r}")
    prompts = prompt_set(args.prompts)
    out = Path(args.out) if args.out else None
    models = {"base": lambda: load_adapter(args.model)}
    for i, run in enumerate(args.run):
        models[f"run {i + 1}"] = lambda run=run: load_trained_adapter(run)

    autocast_dtype = eval_autocast_dtype(args.mixed_precision, "cpu")  # every model loads on the CPU
    precision = str(autocast_dtype).removeprefix("torch.") if autocast_dtype else "float32"
    items = shapes_eval_list(prompts, args.images_per_family)
    results: dict[str, dict[float, object]] = {}
    for label, load in models.items():
        adapter = None
        results[label] = {}
        for scale in scales:
            def compute(scale=scale):
                nonlocal adapter
                adapter = adapter or load()
                return evaluate_shapes(adapter, prompts, images_per_family=args.images_per_family, num_steps=args.steps,
                                       guidance_scale=scale, seed=args.seed, batch_size=args.batch_size,
                                       autocast_dtype=autocast_dtype)
            path = out / label.replace(" ", "_") / f"cfg{scale:g}.json" if out else None
            expect = {"guidance_scale": scale, "num_steps": args.steps, "seed": args.seed,
                      "images_per_family": args.images_per_family, "precision": precision}
            results[label][scale] = cached_evaluation(path, compute, expect=expect, prompts=items)

    base = results["base"]
    first = base[scales[0]]
    print(f"{args.prompts} prompts: {first.meta['num_images']} images per evaluation, {args.steps} ODE steps, "
          f"seed {args.seed}, {first.meta['precision']} forwards, {torch.get_num_threads()} thread(s)")
    print(f"\nbase model ({args.model}) at each CFG scale, paired against {scale_name(args.reference)}:")
    print(format_table(comparison_columns({scale_name(s): base[s] for s in scales}, scale_name(args.reference))))
    best = choose_scale({s: base[s].metrics[HEADLINE] for s in scales})
    print(f"base model's best scale on these prompts: {scale_name(best)} "
          f"({base[best].metrics[HEADLINE]:.3f} per image)")
    for label, run in zip(list(results)[1:], args.run):
        print(f"\n{label}: {run}")
        print(f"{'scale':<8} {'base':>7} {'run':>7}   run - base (same scale)       run - base at {scale_name(best)}")
        for s in scales:
            same = results[label][s].compare(base[s])[HEADLINE]
            vs_best = results[label][s].compare(base[best])[HEADLINE]
            print(f"{scale_name(s):<8} {base[s].metrics[HEADLINE]:7.3f} {results[label][s].metrics[HEADLINE]:7.3f}   "
                  f"{same.format():<29} {vs_best.format()}")
    print(LEGEND)
    return 0


def cli(argv=None) -> int:
    """``main`` with bad input (a store measured with other settings) as one ``error: ...`` line and exit code 2."""
    from diffalign.errors import DiffalignError

    try:
        return main(argv)
    except DiffalignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(cli())
