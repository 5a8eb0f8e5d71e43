"""Held-out ShapesEval accuracy of the shipped model before and after the main job.

Runs ``configs/shapes/flow_grpo.yaml`` (or ``--config``) to completion, then evaluates the base
model and the trained run on the held-out prompts with the same seeds and prints a per-family
table, the change in overall accuracy, and the wall-clock time of the training.

    python benchmarks/shapes_alignment.py [--config configs/shapes/flow_grpo.yaml] [--samples-per-prompt 4]
                                          [--run-dir DIR] [--skip-train] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from diffalign.adapters import load_adapter
    from diffalign.config import load_config
    from diffalign.evaluation import evaluate_adapter, format_table
    from diffalign.export import load_trained_adapter
    from diffalign.recipes import build_trainer
    from diffalign.shapes import split_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/shapes/flow_grpo.yaml"))
    p.add_argument("--run-dir", default=None, help="output_dir (default: runs/bench_shapes_alignment)")
    p.add_argument("--skip-train", action="store_true", help="evaluate an existing run directory only")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="eval sampling steps (default: the config's eval_num_steps)")
    p.add_argument("--seed", type=int, default=4321, help="eval seed (differs from the training eval seed)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    run_dir = Path(args.run_dir or ROOT / "runs/bench_shapes_alignment")
    cfg = load_config(args.config, list(args.overrides) + [f"output_dir={run_dir}"])
    train_seconds = None
    if not args.skip_train:
        t0 = time.perf_counter()
        build_trainer(cfg, overwrite=True).train()
        train_seconds = time.perf_counter() - t0
    heldout = split_prompts().evaluation()
    kwargs = dict(num_steps=args.steps or cfg.sampling.eval_num_steps, guidance_scale=cfg.sampling.guidance_scale,
                  seed=args.seed, samples_per_prompt=args.samples_per_prompt)
    base = evaluate_adapter(load_adapter(cfg.model.id), heldout, **kwargs)
    tuned = evaluate_adapter(load_trained_adapter(run_dir), heldout, **kwargs)
    print(f"held-out prompts: {len(heldout)} x {args.samples_per_prompt} samples, {kwargs['num_steps']} ODE steps, "
          f"CFG {kwargs['guidance_scale']}, eval seed {args.seed}")
    print(format_table({"base": base, "flow_grpo": tuned}))
    delta = 100 * (tuned["acc/overall"] - base["acc/overall"])
    if train_seconds is not None:
        print(f"training wall-clock (incl. its own evals): {train_seconds / 60:.1f} min")
    print(f"held-out accuracy: {100 * base['acc/overall']:.1f}% -> {100 * tuned['acc/overall']:.1f}% ({delta:+.1f} points)")
    (run_dir / "benchmark.json").write_text(json.dumps({"base": base, "tuned": tuned, "delta_points": delta,
                                                         "train_seconds": train_seconds, **kwargs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
