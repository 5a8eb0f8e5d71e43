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
run resumes).

    python benchmarks/guidance_scales.py [--scales 1,2,4] [--prompts validation|heldout] [--run RUN ...]
        [--model shapes] [--images-per-family 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADLINE = "acc/images"


def parse_scales(text: str) -> list[float]:
    try:
        scales = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--scales: comma-separated numbers, got {text!r}") from None
    if len(scales) < 2 or scales[0] < 1:
        raise SystemExit(f"--scales: at least two scales, each >= 1, got {text!r}")
    return scales


def scale_name(scale: float) -> str:
    return f"CFG {scale:g}"


def cached_evaluation(path: Path, compute):
    """The :class:`~diffalign.evaluation.Evaluation` stored at ``path``, or ``compute()`` stored there."""
    from diffalign.evaluation import Evaluation

    if path.is_file():
        stored = json.loads(path.read_text())
        return Evaluation.from_records(stored["records"], seconds=stored["seconds"], meta=stored["meta"])
    evaluation = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(evaluation.to_json()))
    tmp.replace(path)
    return evaluation


def main(argv=None) -> int:
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.evaluation import LEGEND, comparison_columns, eval_autocast_dtype, evaluate_shapes, format_table
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
                                       autocast_dtype=eval_autocast_dtype(args.mixed_precision, adapter.device.type))
            path = out / label.replace(" ", "_") / f"cfg{scale:g}.json" if out else None
            results[label][scale] = cached_evaluation(path, compute) if path else compute()

    base = results["base"]
    first = base[scales[0]]
    print(f"{args.prompts} prompts: {first.meta['num_images']} images per evaluation, {args.steps} ODE steps, "
          f"seed {args.seed}, {first.meta['precision']} forwards, {torch.get_num_threads()} thread(s)")
    print(f"\nbase model ({args.model}) at each CFG scale, paired against {scale_name(args.reference)}:")
    print(format_table(comparison_columns({scale_name(s): base[s] for s in scales}, scale_name(args.reference))))
    best = max(scales, key=lambda s: (base[s].metrics[HEADLINE], -s))
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


if __name__ == "__main__":
    raise SystemExit(main())
