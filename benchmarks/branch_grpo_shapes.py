"""Held-out ShapesEval accuracy against training wall-clock: linear Flow-GRPO, BranchGRPO, its pruned
variants and BranchGRPO-Mix at an equal time budget, side by side in one run.

    python benchmarks/branch_grpo_shapes.py [--minutes 15] [--variants flow_grpo,branch,branch_depth_pruned,...]
                                            [--eval-every 5] [--eval-prompts 0] [--samples-per-prompt 2]
                                            [--model shapes] [--out runs/bench_branch_grpo_shapes]
                                            [--branch-override key=value ...] [key=value ...]

Every variant starts from the same model (the shipped ShapesWorld model by default) with the same
seed, reward (``shapes_eval`` with partial credit), prompts and optimiser, and trains until its
*training* wall-clock (rollouts + rewards + updates, evaluations excluded) reaches ``--minutes``.
Every ``--eval-every`` iterations and at the end, the current weights are evaluated on the held-out
prompts (deterministic ODE samples, fixed seed, ShapesEval pass/fail accuracy); the base model is
evaluated once (the LoRA starts as the identity). Variants (``--variants``, comma-separated):

| name | config |
|---|---|
| ``flow_grpo`` | ``configs/shapes/flow_grpo.yaml`` (linear rollouts, Flow-GRPO-Fast window) |
| ``branch`` | ``configs/shapes/branch_grpo.yaml`` |
| ``branch_depth_pruned`` | + ``depth_pruning [7, 8, 9, 10]``, sliding towards the last split |
| ``branch_width_pruned`` | + ``width_pruning best_worst``, ratio 0.5 |
| ``branch_pruned`` | both prunings |
| ``branch_mix`` | ``configs/shapes/branch_grpo_mix.yaml`` |

Output: a table (iterations, seconds per iteration, rollout NFE per image, trained terms per
iteration, held-out accuracy at the end and its best, change against the base), a plot of
held-out accuracy against training wall-clock (``accuracy_vs_time.png``) and ``results.json``.
Extra ``key=value`` overrides apply to every variant (e.g. ``rollout.prompts_per_iteration=4``);
``--branch-override key=value`` only to the BranchGRPO ones (e.g. ``algorithm.split_steps=[0,2]``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = {
    "flow_grpo": ("configs/shapes/flow_grpo.yaml", []),
    "branch": ("configs/shapes/branch_grpo.yaml", []),
    "branch_depth_pruned": ("configs/shapes/branch_grpo.yaml",
                            ["algorithm.depth_pruning=[7,8,9,10]", "algorithm.depth_pruning_slide=true"]),
    "branch_width_pruned": ("configs/shapes/branch_grpo.yaml",
                            ["algorithm.width_pruning=best_worst", "algorithm.width_pruning_ratio=0.5"]),
    "branch_pruned": ("configs/shapes/branch_grpo.yaml",
                      ["algorithm.depth_pruning=[7,8,9,10]", "algorithm.depth_pruning_slide=true",
                       "algorithm.width_pruning=best_worst", "algorithm.width_pruning_ratio=0.5"]),
    "branch_mix": ("configs/shapes/branch_grpo_mix.yaml", []),
}


def evaluate(trainer, prompts, args) -> dict:
    from diffalign.evaluation import evaluate_adapter

    cfg = trainer.cfg
    trainer.adapter.denoiser.eval()
    with trainer.eval_weights():
        return evaluate_adapter(trainer.adapter, prompts, reward="shapes_eval", num_steps=cfg.sampling.eval_num_steps,
                                guidance_scale=cfg.sampling.guidance_scale, resolution=trainer.resolution, seed=args.seed,
                                samples_per_prompt=args.samples_per_prompt, batch_size=cfg.eval.batch_size)


def run_variant(name: str, args, prompts, base: dict | None) -> dict:
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    config, extra = VARIANTS[name]
    own = args.branch_overrides if name.startswith("branch") else []
    overrides = [*extra, *args.overrides, *own, f"output_dir={Path(args.out) / name}", f"model.id={args.model}",
                 "log.progress_bar=false", "log.report=false", "eval.at_start=false", "checkpoint.every=0"]
    cfg = load_config(ROOT / config, overrides)
    trainer = build_trainer(cfg, overwrite=True)
    trainer.setup()
    if base is None:
        base = evaluate(trainer, prompts, args)
    curve = [(0.0, 0, base["acc/overall"])]
    records, train_seconds, it = [], 0.0, 0
    budget = args.minutes * 60
    try:
        while train_seconds < budget:
            clock = time.perf_counter if args.clock == "wall" else time.process_time
            t0 = clock()
            record = trainer.iteration(it)
            record["seconds"] = clock() - t0
            train_seconds += record["seconds"]
            records.append(record)
            it += 1
            if it % args.eval_every == 0 or train_seconds >= budget:
                acc = evaluate(trainer, prompts, args)["acc/overall"]
                curve.append((train_seconds, it, acc))
                print(f"  {name}: iteration {it}, {train_seconds / 60:.2f} min, train reward {record['reward_mean']:.3f}, "
                      f"held-out acc {acc:.3f}", flush=True)
    finally:
        trainer.reward_pool.shutdown()
    secs = [r["seconds"] for r in records]
    steps = cfg.sampling.num_steps
    nfe = statistics.mean(r["nfe_per_image"] for r in records) if "nfe_per_image" in records[0] else float(steps)
    if "edges_trained" in records[0]:
        terms = statistics.mean(r["edges_trained"] for r in records)
    else:  # linear: images x trained steps
        terms = cfg.derived()["images_per_iteration"] * cfg.derived()["trained_steps_per_sample"]
    return {"base": base, "curve": curve, "iterations": it, "train_seconds": train_seconds,
            "seconds_per_iteration": statistics.median(secs) if secs else float("nan"),
            "rollout_seconds": statistics.median(r["rollout_seconds"] for r in records) if "rollout_seconds" in records[0] else None,
            "nfe_per_image": nfe, "trained_terms_per_iteration": terms,
            "final_acc": curve[-1][2], "best_acc": max(c[2] for c in curve[1:]) if len(curve) > 1 else base["acc/overall"]}


def main(argv=None) -> dict:
    from diffalign.shapes import split_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15.0, help="training wall-clock budget per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--eval-every", type=int, default=5, help="iterations between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=0, help="first N held-out prompts (0 = all 86)")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--seed", type=int, default=4321, help="eval seed")
    p.add_argument("--model", default="shapes", help="model.id for every variant (tiny:shapes for a smoke run)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="budget clock: wall (a free machine / GPU) or process CPU time (steadier on a shared CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_branch_grpo_shapes"))
    p.add_argument("--branch-override", dest="branch_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the BranchGRPO variants only (e.g. algorithm.split_steps=[0,2]); repeatable")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    heldout = split_prompts().evaluation()
    prompts = heldout[: args.eval_prompts] if args.eval_prompts else heldout
    print(f"{len(names)} variants x {args.minutes:g} min of training on {args.model}; held-out: {len(prompts)} prompts x "
          f"{args.samples_per_prompt} samples, eval seed {args.seed}", flush=True)
    results, base = {}, None
    for name in names:
        print(f"- {name}", flush=True)
        results[name] = run_variant(name, args, prompts, base)
        base = results[name]["base"]
    base_acc = base["acc/overall"]
    head = f"{'variant':22} {'iters':>5} {'s/iter':>7} {'rollout s':>9} {'NFE/img':>7} {'terms/iter':>10} {'acc end':>7} {'best':>6} {'change':>7}"
    lines = [f"held-out ShapesEval accuracy of the base model: {base_acc:.3f}", head]
    for name, r in results.items():
        roll = f"{r['rollout_seconds']:9.2f}" if r["rollout_seconds"] is not None else f"{'-':>9}"
        lines.append(f"{name:22} {r['iterations']:5d} {r['seconds_per_iteration']:7.2f} {roll} {r['nfe_per_image']:7.2f} "
                     f"{r['trained_terms_per_iteration']:10.0f} {r['final_acc']:7.3f} {r['best_acc']:6.3f} {r['final_acc'] - base_acc:+7.3f}")
    if "branch" in results:
        ref = results["branch"]["seconds_per_iteration"]
        for name in ("branch_pruned", "branch_depth_pruned", "branch_width_pruned", "branch_mix"):
            if name in results:
                r = results[name]["seconds_per_iteration"]
                lines.append(f"{name}: {100 * (r / ref - 1):+.0f} % time per iteration vs branch ({ref / r:.2f}x)")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    _plot(results, out / "accuracy_vs_time.png")
    print(f"saved {out / 'results.json'} and {out / 'accuracy_vs_time.png'}")
    return results


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results.items():
        t, _, acc = zip(*r["curve"])
        ax.plot([x / 60 for x in t], acc, marker="o", ms=3, label=name)
    ax.set_xlabel("training wall-clock (min, evaluations excluded)")
    ax.set_ylabel("held-out ShapesEval accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
