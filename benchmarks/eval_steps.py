"""Does the ShapesWorld evaluation need its 20 ODE steps? One model, several step counts, paired.

Evaluates a model (default: the shipped one) on the validation prompts of the training split
(``prompts.evaluate_on: validation``'s list: held-out and probe prompts are never touched) at
each ``--steps`` value with the same seed, so image ``i`` starts from the same noise at every
step count, and prints each count's table paired against the largest count (``*``: outside
noise) with the sampling time of each. Fewer steps may replace the default only where the
paired difference is within noise and small.

    python benchmarks/eval_steps.py [--steps 10,20] [--model shapes] [--images-per-family 96] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.evaluation import LEGEND, comparison_columns, eval_autocast_dtype, evaluate_shapes, format_table
    from diffalign.shapes import prompt_set

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="10,20", help="comma-separated ODE step counts; the largest is the reference")
    p.add_argument("--model", default="shapes", help="model id: 'shapes' (shipped) or a saved pipeline folder")
    p.add_argument("--images-per-family", type=int, default=96)
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto",
                   help="as diffalign eval: auto = bf16 autocast where the CPU computes bf16 natively")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    try:
        counts = sorted({int(s) for s in args.steps.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--steps: comma-separated integers, got {args.steps!r}") from None
    if len(counts) < 2 or counts[0] < 1:
        raise SystemExit(f"--steps: at least two positive step counts, got {args.steps!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    validation = prompt_set("validation")
    adapter = load_adapter(args.model)
    dtype = eval_autocast_dtype(args.mixed_precision, adapter.device.type)
    evaluations = {}
    for n in counts:
        evaluations[f"{n} steps"] = evaluate_shapes(adapter, validation, images_per_family=args.images_per_family,
                                                    num_steps=n, guidance_scale=args.guidance_scale, seed=args.seed,
                                                    batch_size=args.batch_size, autocast_dtype=dtype)
    reference = f"{counts[-1]} steps"
    first = next(iter(evaluations.values()))
    print(f"validation prompts: {first.meta['num_images']} images, CFG {args.guidance_scale}, seed {args.seed}, "
          f"{first.meta['precision']} forwards, {torch.get_num_threads()} thread(s); paired against {reference}")
    print(format_table(comparison_columns(evaluations, reference)))
    print(LEGEND)
    for name, ev in evaluations.items():
        print(f"{name}: sampled and scored in {ev.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
