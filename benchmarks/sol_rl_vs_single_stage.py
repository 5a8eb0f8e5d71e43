"""Held-out accuracy against wall-clock: Sol-RL versus single-stage DiffusionNFT, side by side in one run.

Both methods train the shipped ShapesWorld model with the same number of final (trained-on)
samples per iteration — ``configs/shapes/sol_rl.yaml`` (N seeds per prompt explored by the
low-precision copy, K regenerated) against ``configs/shapes/diffusion_nft.yaml`` (K seeds per
prompt, no exploration) — for the same training-time budget. Iterations of the two runs are
interleaved (the one with less training time so far goes next) so that load on a shared machine
hits both alike. Every ``--eval-every`` minutes of a run's own training time its current policy is
evaluated on the held-out prompts with fixed seeds (evaluation time is not counted). Prints the
accuracy-vs-time table per method, the time to reach the single-stage run's final accuracy, and
writes ``result.json`` and ``accuracy_vs_time.png``.

    python benchmarks/sol_rl_vs_single_stage.py [--minutes 15] [--eval-every 3] [--samples-per-prompt 2]
        [--model shapes] [--out runs/bench_sol_rl_vs_single] [--override key=value ...]

``--override`` applies to both configs (e.g. ``rollout.prompts_per_iteration=2``); ``--sol-override``
and ``--single-override`` to one of them. A smoke run: ``--model tiny:shapes --minutes 0.3``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {"sol_rl": "configs/shapes/sol_rl.yaml", "single_stage": "configs/shapes/diffusion_nft.yaml"}


class Run:
    """One method: its trainer, its own training clock and its accuracy curve."""

    def __init__(self, name: str, trainer, eval_fn):
        self.name = name
        self.trainer = trainer
        self.eval_fn = eval_fn
        self.seconds = 0.0  # training wall time so far (evaluation excluded)
        self.cpu_seconds = 0.0
        self.iterations = 0
        self.curve: list[dict] = []
        self.records: list[dict] = []

    def step(self) -> None:
        w, c = time.perf_counter(), time.process_time()
        record = self.trainer.iteration(self.iterations)
        self.seconds += time.perf_counter() - w
        self.cpu_seconds += time.process_time() - c
        self.records.append({"iteration": self.iterations, **{k: v for k, v in record.items() if isinstance(v, (int, float))}})
        self.iterations += 1

    def evaluate(self) -> dict:
        point = {"minutes": self.seconds / 60, "cpu_minutes": self.cpu_seconds / 60, "iterations": self.iterations, **self.eval_fn(self.trainer)}
        self.curve.append(point)
        return point


def main(argv=None) -> dict:
    from diffalign.config_files import load_config
    from diffalign.evaluation import evaluate_adapter
    from diffalign.trainer import build_trainer
    from diffalign.shapes import split_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15.0, help="training-time budget per method (wall minutes)")
    p.add_argument("--eval-every", type=float, default=3.0, help="evaluate every this many training minutes")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=0, help="first N held-out prompts (0 = all 86)")
    p.add_argument("--eval-steps", type=int, default=None, help="default: the config's eval_num_steps")
    p.add_argument("--eval-seed", type=int, default=4321)
    p.add_argument("--model", default=None, help="model.id for both (default: the configs', the shipped model)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_sol_rl_vs_single"))
    p.add_argument("--override", action="append", default=[], help="key=value for both configs (repeatable)")
    p.add_argument("--sol-override", action="append", default=[])
    p.add_argument("--single-override", action="append", default=[])
    args = p.parse_args(argv)
    out = Path(args.out)
    heldout = split_prompts().evaluation()
    heldout = heldout[: args.eval_prompts] if args.eval_prompts else heldout

    runs = []
    for name, config in METHODS.items():
        overrides = [f"output_dir={out / name}", "log.progress_bar=false", "log.report=false", "eval.at_start=false",
                     "max_iterations=100000"]
        overrides += ([f"model.id={args.model}"] if args.model else []) + args.override
        overrides += args.sol_override if name == "sol_rl" else args.single_override
        cfg = load_config(ROOT / config, overrides)
        trainer = build_trainer(cfg, overwrite=True)
        trainer.setup()
        kwargs = dict(num_steps=args.eval_steps or cfg.sampling.eval_num_steps, guidance_scale=cfg.sampling.guidance_scale,
                      seed=args.eval_seed, samples_per_prompt=args.samples_per_prompt, reward=cfg.reward.name,
                      reward_kwargs=cfg.reward.kwargs, resolution=trainer.resolution)

        def eval_fn(tr, kwargs=kwargs):
            tr.adapter.denoiser.eval()
            with tr.eval_weights():
                return evaluate_adapter(tr.adapter, heldout, **kwargs)

        runs.append(Run(name, trainer, eval_fn))
        print(f"{name}: {config} -> {out / name} ({cfg.rollout.prompts_per_iteration} prompts x {cfg.rollout.group_size} final samples"
              + (f", {cfg.algorithm.pool_size} explored per prompt" if cfg.algorithm.name == "sol_rl" else "") + ")", flush=True)

    budget = args.minutes * 60
    for run in runs:
        run.evaluate()  # the base model, at minute 0
    next_eval = {run.name: args.eval_every * 60 for run in runs}
    while True:
        active = [r for r in runs if r.seconds < budget]
        if not active:
            break
        run = min(active, key=lambda r: r.seconds)
        run.step()
        if run.seconds >= next_eval[run.name] or run.seconds >= budget:
            point = run.evaluate()
            next_eval[run.name] = (run.seconds // (args.eval_every * 60) + 1) * args.eval_every * 60
            print(f"  {run.name}: {point['minutes']:.1f} min, {point['iterations']} iterations, acc {_acc(point):.3f}", flush=True)

    print()
    print(format_table(runs))
    target = _acc(runs[1].curve[-1])
    reach = {r.name: _time_to(r.curve, target) for r in runs}
    print(f"\ntime to reach the single-stage run's final held-out accuracy ({target:.3f}): "
          + ", ".join(f"{k} {'-' if v is None else f'{v:.1f} min'}" for k, v in reach.items()))
    result = {"args": vars(args), "heldout_prompts": len(heldout),
              "runs": {r.name: {"curve": r.curve, "records": r.records, "seconds": r.seconds, "cpu_seconds": r.cpu_seconds}
                       for r in runs},
              "time_to_single_stage_final": reach}
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    plot(runs, out / "accuracy_vs_time.png")
    print(f"wrote {out / 'result.json'} and {out / 'accuracy_vs_time.png'}")
    for r in runs:
        r.trainer.reward_pool.shutdown()
    return result


def _acc(point: dict) -> float:
    return point.get("acc/overall", point.get("reward_mean", float("nan")))


def _time_to(curve: list[dict], target: float):
    for point in curve:
        if _acc(point) >= target:
            return point["minutes"]
    return None


def format_table(runs) -> str:
    lines = [f"{'method':<14} {'minutes':>8} {'CPU min':>8} {'iters':>6} {'held-out acc':>13} {'reward':>8}"]
    for r in runs:
        for point in r.curve:
            lines.append(f"{r.name:<14} {point['minutes']:>8.2f} {point['cpu_minutes']:>8.2f} {point['iterations']:>6} "
                         f"{_acc(point):>13.3f} {point.get('reward_mean', float('nan')):>8.3f}")
    return "\n".join(lines)


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ax.plot([p["minutes"] for p in r.curve], [_acc(p) for p in r.curve], marker="o", label=r.name)
    ax.set_xlabel("training wall-clock (minutes, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (ShapesEval)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
    sys.exit(0)
