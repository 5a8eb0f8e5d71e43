"""ShapesEval accuracy of the shipped model before and after the main job, with intervals.

Runs ``configs/shapes/flow_grpo.yaml`` (or ``--config``) to completion, then evaluates the base
model and the trained run with the same prompt list and seed and prints

- the headline table: held-out prompts plus the in-distribution families,
  ``--images-per-family`` images per family, every metric with its 95 % stratified bootstrap
  interval over prompts, and the paired difference (trained - base) with its interval and a
  ``*`` where 0 lies outside it;
- the generalisation probe (prompts naming colour-shape pairs never trained), before and after,
  reported apart;
- the wall-clock time of the training and of each evaluation.

    python benchmarks/shapes_alignment.py [--config configs/shapes/flow_grpo.yaml] [--images-per-family 96]
                                          [--run-dir DIR] [--skip-train] [--no-probe] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    from diffalign.adapters import load_adapter
    from diffalign.config_files import load_config
    from diffalign.evaluation import LEGEND, comparison_columns, evaluate_shapes, format_table
    from diffalign.export import load_trained_adapter
    from diffalign.trainer import build_trainer
    from diffalign.shapes import split_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/shapes/flow_grpo.yaml"))
    p.add_argument("--run-dir", default=None, help="output_dir (default: runs/bench_shapes_alignment)")
    p.add_argument("--skip-train", action="store_true", help="evaluate an existing run directory only")
    p.add_argument("--images-per-family", type=int, default=96)
    p.add_argument("--steps", type=int, default=None, help="eval sampling steps (default: the config's eval_num_steps)")
    p.add_argument("--seed", type=int, default=4321, help="eval seed (differs from the training eval seed)")
    p.add_argument("--batch-size", type=int, default=None, help="eval batch size (default: the config's eval.batch_size)")
    p.add_argument("--no-probe", action="store_true", help="skip the generalisation probe")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    run_dir = Path(args.run_dir or ROOT / "runs/bench_shapes_alignment")
    cfg = load_config(args.config, list(args.overrides) + [f"output_dir={run_dir}"])
    train_seconds = None
    if not args.skip_train:
        t0 = time.perf_counter()
        build_trainer(cfg, overwrite=True).train()
        train_seconds = time.perf_counter() - t0
    split = split_prompts()
    kwargs = dict(images_per_family=args.images_per_family, num_steps=args.steps or cfg.sampling.eval_num_steps,
                  guidance_scale=cfg.sampling.guidance_scale, seed=args.seed,
                  batch_size=args.batch_size or cfg.eval.batch_size)
    models = {"base": lambda: load_adapter(cfg.model.id), cfg.algorithm.name: lambda: load_trained_adapter(run_dir)}
    sets = {"heldout": split.evaluation()} if args.no_probe else {"heldout": split.evaluation(), "probe": split.probe}
    results: dict[str, dict] = {name: {} for name in sets}
    for name, build in models.items():
        adapter = build()
        for kind, prompts in sets.items():
            results[kind][name] = evaluate_shapes(adapter, prompts, **kwargs)

    head = results["heldout"]["base"].meta
    print(f"{head['num_images']} images ({args.images_per_family} per family), {kwargs['num_steps']} ODE steps, "
          f"CFG {kwargs['guidance_scale']:g}, eval seed {args.seed}, batch {kwargs['batch_size']}; base and "
          f"{cfg.algorithm.name} on the same prompts and seeds")
    print("\nheld-out evaluation (held-out prompts + in-distribution families):")
    print(format_table(comparison_columns(results["heldout"], "base")))
    if "probe" in results:
        print(f"\ngeneralisation probe ({results['probe']['base'].meta['num_images']} images; colour-shape pairs never "
              "trained; reported apart, not the headline):")
        print(format_table(comparison_columns(results["probe"], "base")))
    print("\n" + LEGEND)
    if train_seconds is not None:
        print(f"training wall-clock (incl. its own evals): {train_seconds / 60:.1f} min")
    for kind, evs in results.items():
        print(f"{kind} evaluation wall-clock: " + ", ".join(f"{n} {ev.seconds:.0f} s" for n, ev in evs.items()))

    summary = {
        "eval": {**kwargs},
        "train_seconds": train_seconds,
        **{kind: {"models": {n: ev.to_json() for n, ev in evs.items()},
                  "difference": {k: d.to_dict() for k, d in evs[cfg.algorithm.name].compare(evs["base"]).items()}}
           for kind, evs in results.items()},
    }
    (run_dir / "benchmark.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
