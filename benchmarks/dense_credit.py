"""Held-out accuracy against wall-clock time: Flow-GRPO vs Stepwise-Flow-GRPO vs DRM Step-GRPO.

Side by side in one process, on the ShapesWorld, at an **equal training-time budget** per method:
each method's recipe config (``configs/shapes/{flow_grpo,stepwise_flow_grpo,drm_step_grpo}.yaml``)
runs iterations until its training time (rollouts + updates, evaluation excluded) reaches
``--minutes``; the held-out ShapesEval accuracy (deterministic ODE samples, fixed seeds, the EMA
weights when enabled) is measured at the start, every ``--eval-every`` seconds of training time and
at the end. Prints a table (iterations, seconds per iteration, accuracy at start / end / best,
training time to reach a target accuracy) and saves ``accuracy_vs_time.png`` and ``results.json``.

DRM Step-GRPO needs a DRM: ``--drm DIR`` uses a trained one; otherwise one is trained first with
``--drm-config`` (default: the ``algorithm.drm_train`` recipe of ``configs/shapes/drm_step_grpo.yaml``, on the same
base model) and its training time
is reported; ``--count-drm-training`` charges it to DRM Step-GRPO's budget.

    python benchmarks/dense_credit.py --minutes 20                                   # the real run
    python benchmarks/dense_credit.py --model tiny:shapes --minutes 0.05 --eval-prompts 2 \\
        --set all:sampling.num_steps=2 --drm-set pairs.reward=brightness ...            # smoke run

``--set METHOD:key=value`` overrides one method's config (``all:`` every method's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {
    "flow_grpo": "configs/shapes/flow_grpo.yaml",
    "stepwise_flow_grpo": "configs/shapes/stepwise_flow_grpo.yaml",
    "drm_step_grpo": "configs/shapes/drm_step_grpo.yaml",
}


def parse_sets(items: list[str], methods: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {m: [] for m in methods}
    for item in items:
        target, sep, override = item.partition(":")
        if not sep or "=" not in override:
            raise SystemExit(f"--set {item!r}: expected METHOD:key=value or all:key=value")
        for m in methods if target == "all" else [target]:
            if m not in out:
                raise SystemExit(f"--set {item!r}: unknown method {m!r} (running: {', '.join(methods)})")
            out[m].append(override)
    return out


def heldout_accuracy(trainer, prompts, args) -> dict:
    from diffalign.evaluation import evaluate_adapter

    trainer.adapter.denoiser.eval()
    with trainer.eval_weights():
        return evaluate_adapter(trainer.adapter, prompts, reward="shapes_eval", num_steps=args.eval_steps,
                                guidance_scale=trainer.cfg.sampling.guidance_scale, resolution=trainer.resolution,
                                seed=args.eval_seed, samples_per_prompt=args.samples_per_prompt)


def run_method(name: str, overrides: list[str], budget_s: float, prompts: list[str], args, offset_s: float = 0.0) -> dict:
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    out_dir = Path(args.out) / name
    base = [f"output_dir={out_dir}", f"model.id={args.model}", f"seed={args.seed}", "max_iterations=1000000",
            "eval.at_start=false", "eval.every=0", "checkpoint.every=0", "log.progress_bar=false", "log.report=false"]
    cfg = load_config(ROOT / METHODS[name], base + overrides)
    trainer = build_trainer(cfg, overwrite=True)
    trainer.setup()
    trainer.print_header()
    train_s, it = offset_s, 0
    curve = [{"train_seconds": train_s, "iteration": 0, **heldout_accuracy(trainer, prompts, args)}]
    print(f"[{name}] start: held-out accuracy {curve[0]['acc/overall']:.3f}", file=sys.stderr, flush=True)
    next_eval = train_s + args.eval_every
    records = []
    try:
        while train_s < budget_s:
            clock = time.perf_counter if args.clock == "wall" else time.process_time
            t0 = clock()
            records.append(trainer.iteration(it))
            train_s += clock() - t0
            it += 1
            if train_s >= next_eval or train_s >= budget_s:
                curve.append({"train_seconds": train_s, "iteration": it, **heldout_accuracy(trainer, prompts, args)})
                print(f"[{name}] {train_s / 60:.1f} min, {it} iterations: held-out accuracy {curve[-1]['acc/overall']:.3f}",
                      file=sys.stderr, flush=True)
                next_eval = train_s + args.eval_every
    finally:
        if trainer.reward_pool is not None:  # the reward worker thread of score_async
            trainer.reward_pool.shutdown()
    spent = train_s - offset_s
    return {"method": name, "iterations": it, "seconds_per_iteration": spent / max(it, 1), "curve": curve,
            "train_reward_mean": [r.get("reward_mean") for r in records], "offset_seconds": offset_s}


def time_to(curve: list[dict], target: float) -> float | None:
    for point in curve:
        if point["acc/overall"] >= target - 1e-9:
            return point["train_seconds"]
    return None


def report(results: list[dict], drm_info: dict | None, out: Path) -> str:
    finals = {r["method"]: r["curve"][-1]["acc/overall"] for r in results}
    target = finals.get("flow_grpo", min(finals.values()))
    what = "Flow-GRPO's final accuracy" if "flow_grpo" in finals else "the lowest final accuracy"
    lines = [f"{'method':<20} {'iters':>5} {'s/iter':>7} {'acc start':>9} {'acc end':>8} {'acc best':>8} {'min to target':>13}"]
    for r in results:
        accs = [p["acc/overall"] for p in r["curve"]]
        reach = time_to(r["curve"], target)
        lines.append(f"{r['method']:<20} {r['iterations']:>5} {r['seconds_per_iteration']:>7.1f} {accs[0]:>9.3f} {accs[-1]:>8.3f} "
                     f"{max(accs):>8.3f} {('-' if reach is None else f'{reach / 60:.2f}'):>13}")
    lines.append(f"target = {what} ({target:.3f}); times are training time (evaluation excluded)")
    if drm_info:
        lines.append(f"DRM: {drm_info['path']} ({'trained here in %.1f min' % (drm_info['seconds'] / 60) if drm_info.get('seconds') else 'given'}"
                     f"{', charged to drm_step_grpo' if drm_info.get('charged') else ', not charged to any budget'})")
    text = "\n".join(lines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot([p["train_seconds"] / 60 for p in r["curve"]], [p["acc/overall"] for p in r["curve"]], marker="o", label=r["method"])
    ax.set_xlabel("training wall-clock (min, evaluation excluded)")
    ax.set_ylabel("held-out ShapesEval accuracy")
    ax.set_title("dense credit vs Flow-GRPO at an equal time budget", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_time.png", dpi=120)
    plt.close(fig)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="training-time budget per method")
    p.add_argument("--model", default="shapes")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--drm", default=None, help="a trained DRM folder for drm_step_grpo")
    p.add_argument("--drm-config", default=str(ROOT / "configs/shapes/drm_step_grpo.yaml"))
    p.add_argument("--drm-set", action="append", default=[], help="override of the DRM training config (key=value)")
    p.add_argument("--count-drm-training", action="store_true", help="charge the DRM's training time to drm_step_grpo")
    p.add_argument("--eval-every", type=float, default=120.0, help="seconds of training time between evaluations")
    p.add_argument("--eval-prompts", type=int, default=0, help="first N held-out prompts (0 = all 86)")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--eval-seed", type=int, default=4321)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="budget clock: wall (a free machine / GPU) or process CPU time (steadier on a shared CPU)")
    p.add_argument("--set", action="append", default=[], help="METHOD:key=value or all:key=value")
    p.add_argument("--out", default=str(ROOT / "runs/bench_dense_credit"))
    args = p.parse_args(argv)

    from diffalign.shapes import split_prompts

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    sets = parse_sets(args.set, methods)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = split_prompts().evaluation()
    prompts = heldout[: args.eval_prompts] if args.eval_prompts else heldout
    budget = args.minutes * 60
    drm_info = None
    if "drm_step_grpo" in methods:
        drm_info = {"path": args.drm, "seconds": None, "charged": False}
        if args.drm is None:
            from diffalign.drm.train import load_drm_config, train_drm

            drm_dir = out / "drm"
            cfg = load_drm_config(args.drm_config, [f"output_dir={drm_dir}", f"drm.base={args.model}", "log.progress_bar=false",
                                                    *args.drm_set])
            t0 = time.perf_counter()
            train_drm(cfg, overwrite=True)
            drm_info = {"path": str(drm_dir), "seconds": time.perf_counter() - t0, "charged": args.count_drm_training}
        sets["drm_step_grpo"].insert(0, f"reward.kwargs.path={drm_info['path']}")
    results = []
    for name in methods:
        offset = drm_info["seconds"] if (name == "drm_step_grpo" and drm_info and drm_info["charged"]) else 0.0
        results.append(run_method(name, sets[name], budget, prompts, args, offset_s=offset))
    text = report(results, drm_info, out)
    print(f"held-out prompts: {len(prompts)} x {args.samples_per_prompt} samples, {args.eval_steps} ODE steps; "
          f"budget {args.minutes:g} min of training per method; model {args.model}")
    print(text)
    (out / "results.json").write_text(json.dumps({"results": results, "drm": drm_info, "args": vars(args)}, indent=2))
    print(f"plot: {out / 'accuracy_vs_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
