"""Tune the main job's Flow-GRPO recipe on a validation subset of the TRAINING prompts.

Each variant of ``VARIANTS`` (config overrides of ``configs/shapes/flow_grpo.yaml``) trains for
the same number of iterations (the same images and steps) with ``prompts.evaluate_on=validation``:
training uses the train split less the validation prompts, and the before/after evaluations use
the validation prompts only, so held-out and probe prompts never inform the choice. Results are
written per variant (``<out>/<variant>.json``) and skipped when present: an interrupted sweep
resumes. Prints a table ranked by the validation per-image pass rate (ties: partial credit).

    python benchmarks/sweep_flow_grpo.py [--iterations 24] [--variants lr3e-4,lr1e-3] [--out DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> overrides; the first is the config as shipped. Every other variant names its training
# explicitly (LoRA or full fine-tuning, uniform family draws unless it sets prompts.family_weights)
# so that its stored result keeps its meaning when the shipped config changes.
UNIFORM = ["prompts.family_weights={}"]  # every family equally often (the main job until the family-weighted sweep)
LORA = ["lora.enabled=true", "lora.rank=16", "lora.alpha=32", *UNIFORM]  # the first tuned main job's LoRA
FULL = ["lora.enabled=false", *UNIFORM]
HARD = ["prompts.family_weights={position: 4, color_attr: 4, two_object: 2, counting: 2}"]
VARIANTS: dict[str, list[str]] = {
    "shipped": [],
    "lora_lr1e-4": [*LORA, "optim.lr=1e-4"],
    "lora_lr3e-4": [*LORA, "optim.lr=3e-4"],  # the main job until full fine-tuning won this sweep
    "lora_lr1e-3": [*LORA, "optim.lr=1e-3"],
    "lora_lr1e-3_clip1e-2": [*LORA, "optim.lr=1e-3", "algorithm.clip_range=0.01"],
    "lora_lr1e-3_kl0.01": [*LORA, "optim.lr=1e-3", "algorithm.beta=0.01"],
    "lora_lr3e-3_clip1e-2": [*LORA, "optim.lr=3e-3", "algorithm.clip_range=0.01"],
    # on mean-reduced log-probs |log ratio| stays near 1e-4 per update: only a clip range of that
    # order (the Flow-GRPO reference's 1e-4) binds
    "lora_lr1e-3_clip1e-4": [*LORA, "optim.lr=1e-3", "algorithm.clip_range=1e-4"],
    "lora_lr3e-3_clip1e-4": [*LORA, "optim.lr=3e-3", "algorithm.clip_range=1e-4"],
    # full fine-tuning of the 4M-parameter UNet (cheaper per iteration than LoRA on this model)
    "full_lr1e-5": [*FULL, "optim.lr=1e-5"],
    "full_lr3e-5": [*FULL, "optim.lr=3e-5"],
    "full_lr1e-4": [*FULL, "optim.lr=1e-4"],
    "full_lr3e-4": [*FULL, "optim.lr=3e-4"],
    "full_lr3e-5_steps4": [*FULL, "optim.lr=3e-5", "train.optimizer_steps_per_iteration=4"],
    "full_lr3e-5_noise1": [*FULL, "optim.lr=3e-5", "sampling.noise_level=1.0"],
    "full_lr3e-5_group16x4": [*FULL, "optim.lr=3e-5", "rollout.group_size=16", "rollout.prompts_per_iteration=4"],
    "full_lr2e-4": [*FULL, "optim.lr=2e-4"],
    # more updates per sample: 4 optimizer steps per iteration (2 micro-batches each); only from the
    # second step on is a ratio off 1, so a clip of the log ratio's order (1e-4) can act
    "full_lr1e-4_steps4": [*FULL, "optim.lr=1e-4", "train.optimizer_steps_per_iteration=4"],
    "full_lr3e-4_clip1e-4_steps4": [*FULL, "optim.lr=3e-4", "algorithm.clip_range=1e-4",
                                    "train.optimizer_steps_per_iteration=4"],
    # twice the rollouts on the two families the shipped model fails most (position, colour attribution)
    "full_lr1e-4_hard2": [*FULL, "optim.lr=1e-4", "prompts.family_weights={position: 2, color_attr: 2}"],
    # pass/fail reward (the headline metric) instead of partial credit, which pays for drawing the
    # named objects even when the relation or the colour binding is wrong
    "full_lr1e-4_passfail": [*FULL, "optim.lr=1e-4", "reward.kwargs.partial_credit=false"],
    "full_lr1e-4_passfail_hard4": [*FULL, "optim.lr=1e-4", "reward.kwargs.partial_credit=false",
                                   "prompts.family_weights={position: 4, color_attr: 4}"],
    # the SDE window over steps 0-5 instead of 0-3: on position prompts the layout and which shape
    # stands where are fixed at steps 2-5 of 10 (benchmarks/shapes_commitment.py)
    "full_lr1e-4_passfail_hard4_window6": [*FULL, "optim.lr=1e-4", "reward.kwargs.partial_credit=false",
                                           "prompts.family_weights={position: 4, color_attr: 4}",
                                           "sampling.window_size=6"],
    # more exploration where layouts are drawn (noise level 1.0 instead of 0.7), weak families x4
    "full_lr1e-4_noise1_hard4": [*FULL, "optim.lr=1e-4", "sampling.noise_level=1.0",
                                 "prompts.family_weights={position: 4, color_attr: 4}"],
    # every image of a group from the same initial noise (DanceGRPO): the group's reward differences
    # then come only from the SDE steps the update trains, not from where each image started
    "full_lr1e-4_shared_noise": [*FULL, "optim.lr=1e-4", "rollout.shared_noise=true"],
    # SDE noise only on 4x4 (8x8) pixel blocks: meant to keep exploration where layout, count and
    # colour are decided and to drop fine-pixel noise from the policy gradient
    "full_lr1e-4_pool4": [*FULL, "optim.lr=1e-4", "sampling.noise_pool=4"],
    "full_lr1e-4_pool8": [*FULL, "optim.lr=1e-4", "sampling.noise_pool=8"],
    # less SDE noise: rollouts closer to the ODE samples that evaluation draws, so that less of the
    # update goes into coping with the exploration noise itself
    "full_lr1e-4_noise0.4": [*FULL, "optim.lr=1e-4", "sampling.noise_level=0.4"],
    "full_lr1e-4_noise0.2": [*FULL, "optim.lr=1e-4", "sampling.noise_level=0.2"],
    # coefficients-preserving sampling (CPS, Flow-GRPO's `cps`): the step keeps x0_hat and x1_hat
    # in the proportions of the marginal, so few-step SDE rollouts do not end with leftover noise
    "full_lr1e-4_cps": [*FULL, "optim.lr=1e-4", "sampling.kernel=cps", "sampling.noise_level=0.8"],
    # rollouts weighted toward the families the shipped model fails on (single objects and colours
    # are learned or at their ceiling within a few iterations, and their groups stop carrying signal)
    "full_lr1e-4_hard_families": [*FULL, "optim.lr=1e-4", *HARD],
    # weights evaluated as an exponential moving average (decay 0.95 per optimizer step, about the
    # last 10 iterations): averages out the noise of the last updates
    "full_lr1e-4_ema0.95": [*FULL, "optim.lr=1e-4", "train.ema.enabled=true", "train.ema.decay=0.95", "train.ema.every=1"],
    # one optimizer step per iteration on all 64 samples (twice the samples per step, half the
    # steps) at twice the rate: less of each Adam step is sign noise of a small batch
    "full_lr2e-4_steps1": [*FULL, "optim.lr=2e-4", "train.optimizer_steps_per_iteration=1"],
    "full_lr1e-4_pool4_shared_noise": [*FULL, "optim.lr=1e-4", "sampling.noise_pool=4", "rollout.shared_noise=true"],
    # on top of the family weights above (the main job's draws):
    # advantages scaled by the std of the whole batch (the paper's default) instead of each group's:
    # a group whose rewards barely differ no longer gets advantages as large as one that splits
    "hard_families_global_std": [*FULL, "optim.lr=1e-4", *HARD, "algorithm.advantage_std=global"],
    "hard_families_ema0.95": [*FULL, "optim.lr=1e-4", *HARD, "train.ema.enabled=true", "train.ema.decay=0.95",
                              "train.ema.every=1"],
    # the update differentiates the guided output through both CFG branches: with CFG w the guided
    # velocity is w c - (w - 1) u, so the gradient weighs the prompt-dependent part c - u by w - 1
    # more than the detached branch does (costs the uncond backward)
    "hard_families_uncond_grad": [*FULL, "optim.lr=1e-4", *HARD, "train.detach_uncond=false"],
    # colour attribution barely learns in any run (94 prompts, about one group each per run): draw
    # it less and the two-object prompts, which saturate when drawn often enough, more
    "learnable_families": [*FULL, "optim.lr=1e-4",
                           "prompts.family_weights={position: 4, two_object: 4, counting: 3, color_attr: 2}"],
    # the validation rate peaks by iteration 16-48 at a constant rate and then drifts down: a rate
    # that decays to zero over the run keeps the early progress (optim.lr_schedule)
    "hard_families_cosine": [*FULL, "optim.lr=1e-4", *HARD, "optim.lr_schedule=cosine"],
    "hard_families_lr2e-4_cosine": [*FULL, "optim.lr=2e-4", *HARD, "optim.lr_schedule=cosine"],
    # CFG 4 over-guides the shipped model (benchmarks/guidance_scales.py: 1.5-2 is its best scale on
    # validation prompts): the same recipe sampling, training and evaluating at a lower scale
    "hard_families_cfg2": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0"],
    "hard_families_cfg1": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=1.0"],
    # at CFG 2: which blob becomes which shape is settled below the first steps' noise levels, so
    # SDE noise (and training) on every step, 4 random trained steps per sample (the same update
    # cost), or a window over steps 3-6
    "hard_families_cfg2_window10": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0", "sampling.window_size=10",
                                    "algorithm.train_timestep_fraction=0.4", "algorithm.timestep_selection=random"],
    "hard_families_cfg2_window_start3": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0",
                                         "sampling.window_start=3"],
    # at CFG 2 the main job's held-out colours and colour attribution fall in some seeds: a KL
    # penalty toward the shipped model, or every family drawn equally often
    "hard_families_cfg2_kl0.01": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0", "algorithm.beta=0.01"],
    "uniform_cfg2": [*FULL, "optim.lr=1e-4", "sampling.guidance_scale=2.0"],
    # the CFG-2 recipe with another training seed (how much do one-seed validation gains vary?), and
    # with twice the prompts per iteration in groups of 4 (more prompts seen, for held-out prompts)
    "hard_families_cfg2_seed1": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0", "seed=1"],
    "hard_families_cfg2_16x4": [*FULL, "optim.lr=1e-4", *HARD, "sampling.guidance_scale=2.0",
                                "rollout.prompts_per_iteration=16", "rollout.group_size=4"],
    # partial credit pays 0.8 for colour attribution with both objects in one colour and 0.6 for
    # swapped colours: after the main job, training prompts show fewer swaps, more one-colour
    # images and fewer passes. Pass/fail, and partial credit with a step of 0.5 for passing.
    "hard_families_passfail": [*FULL, "optim.lr=1e-4", *HARD, "reward.kwargs.partial_credit=false"],
    "hard_families_pass_weight0.5": [*FULL, "optim.lr=1e-4", *HARD, "reward.kwargs.pass_weight=0.5"],
}
METRICS = ("eval/acc/images", "eval/partial", "eval/acc/overall")  # pass rate, partial credit, family mean


def run_variant(config: str, name: str, overrides: list[str], out: Path, iterations: int, extra: list[str]) -> dict:
    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer

    run_dir = out / "runs" / name
    cfg = load_config(config, [*overrides, *extra, f"output_dir={run_dir}", f"max_iterations={iterations}",
                               "prompts.evaluate_on=validation", "eval.probe=false", "eval.at_start=true", "eval.every=0",
                               "checkpoint.every=0", "log.report=false", "log.progress_bar=false"])
    t0 = time.perf_counter()
    build_trainer(cfg, overwrite=True).train()
    seconds = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval")]
    train = [r for r in records if not r.get("eval")]
    return {"name": name, "overrides": overrides, "iterations": iterations, "seconds": seconds,
            "before": {k: evals[0][k] for k in METRICS}, "after": {k: evals[-1][k] for k in METRICS},
            "train_reward_first": train[0]["reward_mean"], "train_reward_last": train[-1]["reward_mean"],
            "approx_kl_last": train[-1].get("approx_kl"), "clip_frac_last": train[-1].get("clip_frac"),
            "paired": paired_differences(run_dir)}


def paired_differences(run_dir: Path) -> dict[str, list[float]]:
    """``after - before`` of each headline metric with its paired 95 % interval, from the run's
    per-image records of its first and last evaluation (same prompts and seed)."""
    from diffalign.evaluation import Evaluation

    paths = sorted((run_dir / "eval_records").glob("iter-*.json"))
    if len(paths) < 2:
        return {}
    before, after = (Evaluation.from_records(json.loads(p.read_text())["heldout"]["records"]) for p in (paths[0], paths[-1]))
    diffs = after.compare(before)
    return {k: [diffs[k].value, diffs[k].lo, diffs[k].hi] for k in ("acc/images", "partial", "acc/overall") if k in diffs}


def backfill_partial(result: dict, run_dir: Path) -> None:
    """Fill ``eval/partial`` of a stored piece's first and last evaluation from the run's metrics
    (or, for a run trained on partial credit, from its evaluation reward, which is the same number)."""
    metrics = run_dir / "metrics.jsonl"
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("eval")] if metrics.is_file() else []
    for key, record in (("before", evals[0] if evals else None), ("after", evals[-1] if evals else None)):
        if record is not None and "eval/partial" in record:
            result[key]["eval/partial"] = record["eval/partial"]
        elif "reward.kwargs.partial_credit=false" not in result["overrides"]:
            result[key]["eval/partial"] = result[key]["eval/reward_mean"]
        else:
            raise SystemExit(f"{run_dir}: no partial credit recorded for a pass/fail run")


def format_rows(results: list[dict]) -> str:
    rows = sorted(results, key=lambda r: (r["after"][METRICS[0]], r["after"][METRICS[1]]), reverse=True)
    width = max([30, *(len(r["name"]) + 2 for r in rows)])  # the names column fits the longest name
    lines = [f"{'variant':{width}}{'pass rate':>19}{'partial credit':>19}{'family mean':>19}{'train reward':>15}{'min':>6}"
             f"   paired pass-rate difference [95 % interval]"]
    for r in rows:
        cells = "".join(f"{r['before'][k]:>10.3f} -> {r['after'][k]:.3f}" for k in METRICS)
        paired = r.get("paired", {}).get("acc/images")
        diff = (f"   {paired[0]:+.3f} [{paired[1]:+.3f}, {paired[2]:+.3f}]{' *' if paired[1] > 0 or paired[2] < 0 else ''}"
                if paired else "")
        lines.append(f"{r['name']:{width}}{cells}{r['train_reward_first']:>8.3f}->{r['train_reward_last']:.3f}"
                     f"{r['seconds'] / 60:>6.1f}{diff}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/shapes/flow_grpo.yaml"))
    p.add_argument("--iterations", type=int, default=24, help="training iterations per variant (equal budget)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    p.add_argument("--out", default=str(ROOT / "runs/sweep_flow_grpo"))
    p.add_argument("overrides", nargs="*", help="applied to every variant (e.g. model.id=...)")
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        piece = out / f"{name}.json"
        if piece.is_file():
            print(f"- {name}: done earlier ({piece})", flush=True)
        else:
            print(f"- {name}: {' '.join(VARIANTS[name]) or '(as shipped)'}", flush=True)
            result = run_variant(args.config, name, VARIANTS[name], out, args.iterations, list(args.overrides))
            piece.write_text(json.dumps(result, indent=1))
        result = json.loads(piece.read_text())
        if "paired" not in result:  # a piece written before the paired differences were recorded
            result["paired"] = paired_differences(out / "runs" / name)
        if "eval/partial" not in result["before"]:  # written when the table read partial credit off the
            backfill_partial(result, out / "runs" / name)  # evaluation reward (right for partial-credit runs only)
        results.append(result)
    print(f"\nvalidation prompts (training split), {args.iterations} iterations per variant; before -> after")
    print(format_rows(results))
    best = max(results, key=lambda r: (r["after"][METRICS[0]], r["after"][METRICS[1]]))
    print(f"best: {best['name']} ({' '.join(best['overrides']) or 'as shipped'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
