"""The method leaderboard: every alignment method's shipped ShapesWorld recipe at one training budget,
over several seeds, with held-out accuracy, cost and a CFG scale chosen on validation prompts.

    python benchmarks/leaderboard.py [--methods flow_grpo,awm] [--seeds 0,1,2]
        [--minutes 15 | --cpu-minutes 30 | --iterations 32]
        [--marks 0.25,0.5,1] [--scales 1,1.5,2,3,4] [--model shapes] [--prepare] [--out runs/leaderboard]
        [key=value ...] [--set METHOD key=value ...] [--judge-set METHOD key=value ...]
    python benchmarks/leaderboard.py --table-only [--out runs/leaderboard]

Cells
    One cell is one method (:data:`METHODS`: a shipped recipe plus overrides) trained with one seed
    until its training budget is spent (:class:`Budget`; iterations only: rollouts, rewards,
    updates; evaluations, setup and preparation excluded, as ``branch_grpo_shapes.py`` measures
    it): ``--minutes`` of training wall-clock (the default, 15), ``--cpu-minutes`` of this
    process's CPU time while training (all of its threads; a fair budget when another job shares
    the machine, which a wall-clock budget is not), or ``--iterations``. Every cell records all
    three, and the rollout images, whatever its budget.
    A cell whose recipe sets a verifier (``train.guard``, docs/reward_hacking.md) also stores its
    training curve beside the learned reward's, under ``guard``; the guard never acts in a cell.
    At each ``--marks`` fraction of that budget (the end, 1, is always one) the current weights are
    evaluated on the held-out prompts at the recipe's training CFG scale. At the last mark the
    weights are also evaluated on the validation prompts (``prompt_set("validation")``) at every
    ``--scales`` scale; the best one there (per-image pass rate, ties: the lower scale) is the
    cell's chosen scale, and every mark's weights (kept in memory) are evaluated on the held-out
    prompts at it too (the recipes train on the whole training split, validation prompts included:
    the scale is chosen on prompts a trained model has seen, never on held-out ones). Every
    evaluation samples the same image list with the same seed (``evaluate_shapes``:
    ``--images-per-family`` images per family, ``--eval-steps`` ODE steps), so image ``i`` starts
    from the same noise in every cell and in the base model's evaluations.

    A finished cell is written to ``OUT/cells/METHOD/seedS.json`` (a temporary file renamed into
    place) and skipped when present, so the table fills over several sittings and an interruption
    loses at most the cell in progress. A stored cell measured with other settings (model, budget,
    marks, scales, evaluation, overrides) stops the run with an error naming the file. A cell holds:
    the recipe and overrides, iterations, training seconds, median seconds per iteration, rollout
    NFE per image (:class:`Method`), setup and preparation seconds, the CPU model, the torch
    threads, ``/proc/loadavg`` at start and end (``busy``: either 1-minute load above the threads
    + 0.5, another heavy process was running), the training reward per iteration, and per mark
    and scale the per-image records (pass flag and prompt index, no images).

Preparation
    Judges and offline data are charged apart from training. SPO needs its step-aware preference
    model and DRM Step-GRPO its diffusion reward model: one judge per method under
    ``OUT/prep/METHOD/judge``, shared by every seed, trained only with ``--prepare`` (without it, a
    missing judge stops the run before anything else with a line naming it). Diffusion-DPO generates
    and labels its pairs in its setup; that setup time is its preparation.

Base model
    Evaluated once per ``--scales`` scale on the validation prompts; its best scale there is the
    one it is compared at, on the held-out prompts. Stored under ``OUT/base/`` (resumable too).

Intervals
    95 % t-intervals over seeds: for a method's accuracy at a mark, ``mean +- t(0.975, n-1) s / sqrt(n)``
    over its n seeds' held-out per-image pass rates; for a difference, the same over the per-seed
    differences (against Flow-GRPO: the seeds both have, each seed's cells paired; against the base:
    the base model is one deterministic evaluation, so only the method's seeds vary). They measure
    how much a number moves when the method is trained again with another seed, on this fixed list
    of prompts and noise; the prompt-sampling noise, which every column shares, is not in them
    (``Evaluation.compare`` gives that for one pair of models). Retraining noise is what separates
    or fails to separate two methods here, hence these intervals rather than a bootstrap over
    prompts. With 3 seeds t(0.975, 2) = 4.30: only large effects separate. Accuracy intervals are
    clipped to [0, 1]. Fewer than 2 seeds: no interval and no verdict. ``better`` / ``worse``: the
    difference's interval excludes 0. Time to reach Flow-GRPO's final accuracy: the mean training
    minutes of the first mark whose mean accuracy is at or above Flow-GRPO's mean final accuracy
    over the seeds both have (``-``: none); ``faster`` when at a mark before the last the paired
    difference to Flow-GRPO's final accuracy lies above 0.

Output: the tables (at the validation-chosen scale and at the training scale; cost per method),
``OUT/results.json`` and ``OUT/accuracy_vs_time.png`` (mean over seeds against mean training
minutes, the band the 95 % interval). ``--table-only`` rebuilds them from the stored cells and
base evaluations without loading a model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.branch_grpo_shapes import VARIANTS as BRANCH_VARIANTS  # noqa: E402
from diffalign.errors import DiffalignError  # noqa: E402
from diffalign.import_noise import filter_known_import_messages  # noqa: E402

filter_known_import_messages()  # before diffusers loads: its dependencies' known import chatter, as the CLI does
from diffalign.stats import Difference, Interval  # noqa: E402

LEVEL = 0.95  # of every interval
BUSY_MARGIN = 0.5  # 1-minute load above (threads + this) = another heavy process shared the CPU
REFERENCE = "flow_grpo"  # the method every other is compared with
KINDS = ("chosen", "training")  # held-out numbers at the validation-chosen and at the training CFG scale


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------


def linear_nfe(cfg) -> float:
    """One ODE / SDE chain per image: ``sampling.num_steps`` denoiser calls (a CFG pair counts once)."""
    return float(cfg.sampling.num_steps)


def stepwise_nfe(cfg) -> float:
    """The chain plus the Tweedie refinement of every state: K - 1 extra calls per step (K >= 2)."""
    return float(cfg.sampling.num_steps * max(cfg.algorithm.tweedie_substeps, 1))


def sol_rl_nfe(cfg) -> float:
    """Stage 1 (``pool_size`` seeds x ``stage1_steps``, low precision) and stage 2 (``group_size`` x
    ``num_steps``), per trained image."""
    a, k = cfg.algorithm, cfg.rollout.group_size
    return (a.pool_size * a.stage1_steps + k * cfg.sampling.num_steps) / k


def offline_nfe(cfg) -> float:
    """No rollouts while training: the pairs are generated in preparation."""
    return 0.0


@dataclass(frozen=True)
class Judge:
    """A model a method trains on that another command trains first."""

    name: str  # what the error message calls it
    run_key: str  # the run config key that names its folder
    trainer: str  # "spm" (diffalign.spm.train) or "drm" (diffalign.drm.train)


SPM = Judge("step-aware preference model (SPM)", "algorithm.spm_kwargs.model", "spm")
DRM = Judge("diffusion reward model (DRM)", "reward.kwargs.path", "drm")


@dataclass(frozen=True)
class Method:
    """A leaderboard row: a shipped recipe, overrides on it, and what its cost accounting needs."""

    recipe: str  # relative to the repository root
    overrides: tuple[str, ...] = ()
    judge: Judge | None = None
    setup_is_preparation: bool = False  # the trainer's setup generates offline data (charged as preparation)
    nfe: Callable = linear_nfe  # rollout NFE per image when the iteration does not report it
    scales: tuple[float, ...] = ()  # the CFG scales its weights may be evaluated at (empty: every --scales scale)


@dataclass(frozen=True)
class Budget:
    """How much training a cell gets: ``amount`` of ``unit``.

    ``minutes``: training wall-clock; ``cpu_minutes``: this process's CPU time while training (every
    thread's, :func:`time.process_time`), which another job on the machine slows down but does not
    consume, so cells measured beside other work stay comparable; ``iterations``: trainer iterations.
    """

    unit: str
    amount: float

    UNITS = ("minutes", "cpu_minutes", "iterations")

    def spent(self, wall_seconds: float, cpu_seconds: float, iterations: int) -> float:
        return {"minutes": wall_seconds / 60, "cpu_minutes": cpu_seconds / 60, "iterations": float(iterations)}[self.unit]

    def __str__(self) -> str:
        return f"{self.amount:g} {self.unit.replace('_', ' ')}"


GUARD = ("algorithm.guard_ratio_norm=true", "algorithm.guard_norm_mode=auto", "algorithm.guard_step_reweight=true")
METHODS: dict[str, Method] = {
    "flow_grpo": Method("configs/shapes/flow_grpo.yaml"),  # Flow-GRPO-Fast: a fixed SDE window on steps 0-3
    # MixGRPO's window: the same 4 SDE steps, sliding one step per iteration
    "flow_grpo_mix": Method("configs/shapes/flow_grpo.yaml", ("sampling.window_mode=sliding", "sampling.window_slide_every=1")),
    "grpo_guard": Method("configs/shapes/flow_grpo.yaml", GUARD),  # docs/grpo_guard.md
    "flow_dppo": Method("configs/shapes/flow_grpo_dppo.yaml"),  # the KL trust-region mask, docs/flow_dppo.md
    "branch_grpo": Method("configs/shapes/branch_grpo.yaml"),
    # depth and width pruning together: the "branch_pruned" variant of branch_grpo_shapes.py
    "branch_grpo_pruned": Method("configs/shapes/branch_grpo.yaml", tuple(BRANCH_VARIANTS["branch_pruned"][1])),
    "branch_grpo_mix": Method("configs/shapes/branch_grpo_mix.yaml"),
    "stepwise_flow_grpo": Method("configs/shapes/stepwise_flow_grpo.yaml", nfe=stepwise_nfe),
    # the k candidates of a step share one denoiser call; the DRM's scoring calls are not counted
    "drm_step_grpo": Method("configs/shapes/drm_step_grpo.yaml", judge=DRM),
    "spo": Method("configs/shapes/spo.yaml", judge=SPM),
    "diffusion_dpo": Method("configs/shapes/diffusion_dpo.yaml", setup_is_preparation=True, nfe=offline_nfe),
    "diffusion_nft": Method("configs/shapes/diffusion_nft.yaml"),
    "awm": Method("configs/shapes/awm.yaml"),
    "dgpo": Method("configs/shapes/dgpo.yaml"),  # one ODE chain per image, no SDE
    "sol_rl": Method("configs/shapes/sol_rl.yaml", nfe=sol_rl_nfe),
    "raft": Method("configs/shapes/raft.yaml"),  # one ODE chain per image; the best 2 of 8 are trained on
}
# what the harness runs itself: no evaluation, checkpoint, report or progress bar inside the trainer;
# the loop is ours and stops on the budget (every shipped recipe keeps a constant learning rate)
PLUMBING = ["eval.every=0", "eval.at_start=false", "checkpoint.every=0", "log.report=false", "log.progress_bar=false",
            "max_iterations=1000000"]


def reported_nfe(records: Sequence[Mapping]) -> float | None:
    """Rollout NFE per image as the iterations report it (BranchGRPO per image, SPO per trajectory)."""
    for key in ("nfe_per_image", "nfe_per_trajectory"):
        values = [float(r[key]) for r in records if key in r]
        if values:
            return statistics.mean(values)
    return None


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average(path: Path = Path("/proc/loadavg")) -> float | None:
    """The 1-minute load average, or None where the file does not exist."""
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def is_busy(loads: Sequence[float | None], threads: int) -> bool | None:
    """Whether any reading exceeds the cores this process uses + :data:`BUSY_MARGIN` (None: no readings)."""
    known = [x for x in loads if x is not None]
    return any(x > threads + BUSY_MARGIN for x in known) if known else None


# --------------------------------------------------------------------------------------------
# Evaluations
# --------------------------------------------------------------------------------------------


def scale_key(scale: float) -> str:
    return f"{float(scale):g}"


@dataclass(frozen=True)
class EvalSpec:
    """How every evaluation samples (the same for the base model and every cell)."""

    images_per_family: int
    steps: int
    seed: int
    batch_size: int
    precision: str  # auto | bf16 | no (diffalign.evaluation.eval_autocast_dtype)

    def settings(self) -> dict:  # what makes two evaluations pair image by image
        return {"images_per_family": self.images_per_family, "steps": self.steps, "seed": self.seed,
                "precision": self.precision}

    def best_scale_spec(self, scales: Sequence[float], device_type: str):
        """The :class:`~diffalign.best_scale.BestScaleSpec` of these settings: validation and held-out
        prompts alike at ``images_per_family``."""
        from diffalign.best_scale import BestScaleSpec
        from diffalign.evaluation import eval_autocast_dtype
        from diffalign.shapes import prompt_set

        return BestScaleSpec(tuple(sorted(float(s) for s in scales)), tuple(prompt_set("validation")),
                             tuple(prompt_set("heldout")), validation_images_per_family=self.images_per_family,
                             images_per_family=self.images_per_family, num_steps=self.steps, seed=self.seed,
                             batch_size=self.batch_size, autocast_dtype=eval_autocast_dtype(self.precision, device_type))

    def evaluate(self, adapter, split: str, scale: float):
        adapter.denoiser.eval()
        return self.best_scale_spec([scale], adapter.device.type).evaluate(adapter, split, scale)


def compact(evaluation, prompts: Sequence[str]) -> dict:
    """An evaluation's per-image records as ``{"passed": [bool], "prompt": [index into prompts],
    "score": [partial credit]}``."""
    index = {p: i for i, p in enumerate(prompts)}
    return {"passed": [bool(r["passed"]) for r in evaluation.records], "prompt": [index[r["prompt"]] for r in evaluation.records],
            "score": [round(float(r["score"]), 4) for r in evaluation.records]}


def accuracy(records: Mapping) -> float:
    """Per-image pass rate of compact records."""
    return sum(records["passed"]) / len(records["passed"])


def base_model(args, spec: EvalSpec, out: Path) -> dict:
    """The base model's validation accuracy at every scale, its best scale and its held-out records
    there (:func:`diffalign.best_scale.evaluate_best_scale`); each evaluation cached under ``OUT/base``."""
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.best_scale import evaluate_best_scale
    from diffalign.shapes import prompt_set

    settings = {"model": args.model, "eval": spec.settings()}
    check_settings(out / "base" / "settings.json", settings)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = evaluate_best_scale(lambda: load_adapter(args.model, device=device), spec.best_scale_spec(args.scales, device),
                                 model=args.model, cache=out / "base")
    validation = {scale_key(s): rate for s, rate in result.validation_rates.items()}
    best = scale_key(result.scale)
    heldout = compact(result.heldout, prompt_set("heldout"))
    base = {"settings": settings, "validation": validation, "best_scale": best, "heldout": heldout,
            "heldout_accuracy": accuracy(heldout)}
    from diffalign.runs import atomic_write_text

    atomic_write_text(out / "base" / "summary.json", json.dumps(base))
    print(f"base model {args.model}: validation per-image accuracy "
          + ", ".join(f"CFG {k} {v:.3f}" for k, v in validation.items())
          + f"; best CFG {best}, held-out there {base['heldout_accuracy']:.3f}", flush=True)
    return base


# --------------------------------------------------------------------------------------------
# Stored settings
# --------------------------------------------------------------------------------------------


def first_difference(stored, current, where: str = "") -> str | None:
    """``key: stored ... now ...`` for the first key whose value differs (None: equal)."""
    if isinstance(stored, dict) and isinstance(current, dict):
        for key in sorted(set(stored) | set(current)):
            diff = first_difference(stored.get(key), current.get(key), f"{where}.{key}" if where else key)
            if diff:
                return diff
        return None
    return None if stored == current else f"{where or 'value'}: stored {stored!r}, now {current!r}"


def check_settings(path: Path, settings: dict) -> None:
    """Write ``settings`` to ``path``, or check them against the ones stored there."""
    from diffalign.runs import atomic_write_text

    if path.is_file():
        diff = first_difference(json.loads(path.read_text()), settings)
        if diff:
            raise DiffalignError(f"{path} was measured with other settings ({diff}); use another --out or delete it")
        return
    atomic_write_text(path, json.dumps(settings, indent=1))


def run_settings(args, spec: EvalSpec) -> dict:
    """What every cell of one table shares."""
    return {"model": args.model, "budget": str(args.budget), "marks": args.marks, "scales": [scale_key(s) for s in args.scales],
            "eval": spec.settings(), "overrides": list(args.overrides)}


def method_overrides(name: str, args, method: Method | None = None) -> list[str]:
    return [*(method or METHODS[name]).overrides, *args.sets.get(name, [])]


# --------------------------------------------------------------------------------------------
# Preparation: judges
# --------------------------------------------------------------------------------------------


def judge_dir(out: Path, name: str) -> Path:
    return out / "prep" / name / "judge"


def judge_seconds(name: str, args, out: Path) -> float:
    """Seconds the method's judge took to train: trained now with ``--prepare`` when missing."""
    judge = METHODS[name].judge
    folder, info = judge_dir(out, name), out / "prep" / name / "prep.json"
    settings = {"model": args.model, "overrides": list(args.judge_sets.get(name, []))}
    if info.is_file():
        stored = json.loads(info.read_text())
        diff = first_difference(stored["settings"], settings)
        if diff:
            raise DiffalignError(f"{info}: the {judge.name} of {name} was trained with other settings ({diff}); "
                                 "use another --out or delete that folder")
        return float(stored["seconds"])
    if not args.prepare:  # checked for every method before anything runs (check_judges)
        raise DiffalignError(missing_judge(name, out))
    recipe = str(ROOT / METHODS[name].recipe)
    print(f"- {name}: training its {judge.name} in {folder} (preparation)", flush=True)
    t0 = time.perf_counter()
    if judge.trainer == "spm":
        from diffalign.spm.train import load_spm_config, train_spm

        train_spm(load_spm_config(recipe, [f"output_dir={folder}", f"model.id={args.model}", *settings["overrides"]]),
                  overwrite=True)
    else:
        from diffalign.drm.train import load_drm_config, train_drm

        train_drm(load_drm_config(recipe, [f"output_dir={folder}", f"drm.base={args.model}", *settings["overrides"]]),
                  overwrite=True)
    seconds = time.perf_counter() - t0
    from diffalign.runs import atomic_write_text

    atomic_write_text(info, json.dumps({"settings": settings, "seconds": seconds}))  # written last: the judge is complete
    return seconds


def missing_judge(name: str, out: Path) -> str:
    return (f"{name} needs its {METHODS[name].judge.name} in {judge_dir(out, name)}, which is not trained; rerun with "
            f"--prepare to train it (charged as preparation) or leave {name} out of --methods")


def check_judges(names: Sequence[str], seeds: Sequence[int], args, out: Path) -> None:
    """Without ``--prepare``: every method with a cell to run has its judge, or the run stops now."""
    for name in names:
        todo = [s for s in seeds if not cell_path(out, name, s).is_file()]
        if METHODS[name].judge and todo and not args.prepare and not (out / "prep" / name / "prep.json").is_file():
            raise DiffalignError(missing_judge(name, out))


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------


def cell_path(out: Path, name: str, seed: int) -> Path:
    return out / "cells" / name / f"seed{seed}.json"


def run_cell(name: str, seed: int, args, spec: EvalSpec, out: Path, method: Method | None = None) -> dict:
    """Train one method (``METHODS[name]`` unless ``method`` is given) with one seed to ``args.budget``,
    evaluating at every mark (see the module docstring)."""
    import torch

    from diffalign.best_scale import choose_scale
    from diffalign.config_files import load_config, to_dict
    from diffalign.trainer import build_trainer
    from diffalign.shapes import prompt_set

    method = method or METHODS[name]
    prep = {"judge_seconds": judge_seconds(name, args, out) if method.judge else 0.0}
    own = method_overrides(name, args, method)
    judge = [f"{method.judge.run_key}={judge_dir(out, name)}"] if method.judge else []
    cfg = load_config(ROOT / method.recipe, [*own, *args.overrides, *PLUMBING, *judge, f"seed={seed}",
                                             f"model.id={args.model}", f"output_dir={out / 'runs' / name / f'seed{seed}'}"])
    if cfg.optim.lr_schedule != "constant" or cfg.optim.warmup_iterations:
        raise DiffalignError("optim.lr_schedule / optim.warmup_iterations: the leaderboard trains to its own budget, "
                             "not to max_iterations; keep a constant learning rate")
    threads = torch.get_num_threads()
    loads = [load_average()]
    trainer = build_trainer(cfg, overwrite=True)
    t0 = time.perf_counter()
    trainer.setup()
    setup_seconds = time.perf_counter() - t0
    prep["setup_seconds"] = setup_seconds if method.setup_is_preparation else 0.0
    trainer.print_header()
    training = scale_key(cfg.sampling.guidance_scale)
    heldout_prompts, validation_prompts = prompt_set("heldout"), prompt_set("validation")
    budget: Budget = args.budget
    scales = [s for s in args.scales if not method.scales or s in method.scales] or list(method.scales)
    images_per_iteration = cfg.derived()["images_per_iteration"]
    marks: list[dict] = []
    snapshots: list[list[torch.Tensor]] = []  # the evaluated weights of each mark

    def evaluate_now(split: str, scale: str, prompts) -> dict:
        with trainer.eval_weights():
            return compact(spec.evaluate(trainer.adapter, split, float(scale)), prompts)

    records, train_seconds, cpu_seconds, it = [], 0.0, 0.0, 0
    try:
        while budget.spent(train_seconds, cpu_seconds, it) < budget.amount:
            t, c = time.perf_counter(), time.process_time()
            record = trainer.iteration(it)
            seconds, cpu = time.perf_counter() - t, time.process_time() - c
            train_seconds += seconds
            cpu_seconds += cpu
            record.update(trainer.guard_step(it, record, act=False))  # train.guard: recorded, never acted on in a cell
            trainer.write_metrics({"iteration": it, **record, "seconds": seconds, "cpu_seconds": cpu})
            records.append({"seconds": seconds, "cpu_seconds": cpu,
                            **{k: record[k] for k in ("reward_mean", "nfe_per_image", "nfe_per_trajectory", "guard/learned",
                                                      "guard/verifier") if k in record}})
            it += 1
            spent = budget.spent(train_seconds, cpu_seconds, it)
            crossed = [f for f in args.marks[len(marks):] if spent >= f * budget.amount - 1e-9]
            if crossed:  # one evaluation for every mark this iteration reached (the same weights)
                held = evaluate_now("heldout", training, heldout_prompts)
                with trainer.eval_weights():
                    weights = [p.detach().clone() for p in trainer.trainable]
                for fraction in crossed:
                    marks.append({"fraction": fraction, "iteration": it, "train_seconds": train_seconds,
                                  "train_cpu_seconds": cpu_seconds, "images": it * images_per_iteration,
                                  "heldout": {training: held}})
                    snapshots.append(weights)
                print(f"  {name} seed {seed}: {train_seconds / 60:.2f} min, iteration {it}, train reward "
                      f"{record.get('reward_mean', float('nan')):.3f}, held-out {accuracy(held):.3f} at CFG {training}", flush=True)
        validation = {scale_key(s): evaluate_now("validation", scale_key(s), validation_prompts) for s in scales}
        chosen = choose_scale({k: accuracy(v) for k, v in validation.items()})
        if chosen != training:  # each mark's weights back in place (the trainer is not trained further)
            done: dict[int, dict] = {}
            for mark, weights in zip(marks, snapshots):
                if id(weights) not in done:
                    with torch.no_grad():
                        for p, w in zip(trainer.trainable, weights):
                            p.copy_(w)
                    trainer.adapter.denoiser.eval()
                    done[id(weights)] = compact(spec.evaluate(trainer.adapter, "heldout", float(chosen)), heldout_prompts)
                mark["heldout"][chosen] = done[id(weights)]
    finally:
        if trainer.reward_pool is not None:
            trainer.reward_pool.shutdown()
    loads.append(load_average())
    nfe = reported_nfe(records)
    return {
        "method": name, "seed": seed, "recipe": method.recipe, "overrides": own, "settings": run_settings(args, spec),
        "config": to_dict(cfg),  # as resolved, for the record (a recipe edited between sittings shows here)
        "iterations": it, "train_seconds": train_seconds, "train_cpu_seconds": cpu_seconds,
        "images": it * images_per_iteration, "images_per_iteration": images_per_iteration,
        "seconds_per_iteration": statistics.median(r["seconds"] for r in records),
        "cpu_seconds_per_iteration": statistics.median(r["cpu_seconds"] for r in records),
        "nfe_per_image": nfe if nfe is not None else method.nfe(cfg),
        "setup_seconds": setup_seconds, "prep": prep, "prep_seconds": sum(prep.values()),
        "cpu": cpu_model(), "device": str(trainer.device), "threads": threads, "load": loads, "busy": is_busy(loads, threads),
        "training_scale": training, "chosen_scale": chosen,
        "prompts": {"heldout": heldout_prompts, "validation": validation_prompts},
        "validation": validation, "marks": marks, "train_reward": [r.get("reward_mean") for r in records],
        **({"guard": {"verifier": cfg.train.guard.verifier, "learned_key": trainer.learned_reward_key, "every": cfg.train.guard.every,
                      "learned_reward": [r.get("guard/learned") for r in records],  # None at iterations it did not score
                      "verifier_reward": [r.get("guard/verifier") for r in records]}} if trainer.guard is not None else {}),
    }


# --------------------------------------------------------------------------------------------
# Table math (pure: stored cells in, numbers out)
# --------------------------------------------------------------------------------------------


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The two-sided ``level`` quantile of Student's t (t(0.975, df) for 95 %): :func:`diffalign.trends.t_quantile`
    at the one-sided probability ``(1 + level) / 2``."""
    from diffalign.trends import t_quantile as one_sided

    return one_sided((1 + level) / 2, df)


def seed_interval(values: Sequence[float], kind=Interval):
    """Mean of ``values`` (one per seed) with its 95 % t-interval; None for fewer than 2 seeds."""
    if len(values) < 2:
        return None
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
    return kind(mean, mean - half, mean + half)


def _clipped(iv: Interval | None) -> Interval | None:
    """An accuracy's interval within [0, 1] (a t-interval of a rate near 0 or 1 reaches past them)."""
    return Interval(iv.value, max(iv.lo, 0.0), min(iv.hi, 1.0)) if iv is not None else None


def verdict(diff: Difference | None, word: str = "better") -> str:
    if diff is None or not diff.outside_noise:
        return ""
    return word if diff.lo > 0 else "worse"


def mark_accuracy(cell: Mapping, mark: int, kind: str) -> float:
    scale = cell["chosen_scale"] if kind == "chosen" else cell["training_scale"]
    return accuracy(cell["marks"][mark]["heldout"][scale])


def summarise(cells: Mapping[str, Mapping[int, Mapping]], base: Mapping) -> dict:
    """Per method: accuracy per mark (mean, interval), differences against the base at its best
    scale and against Flow-GRPO, time to reach Flow-GRPO's final accuracy, and cost.
    ``cells``: ``{method: {seed: cell}}``; ``base``: ``heldout_accuracy`` and ``best_scale``."""
    ref = cells.get(REFERENCE, {})
    out = {}
    for name, by_seed in cells.items():
        seeds = sorted(by_seed)
        first = by_seed[seeds[0]]
        n_marks = len(first["marks"])
        common = [s for s in seeds if s in ref]
        row: dict = {"seeds": seeds, "marks": [m["fraction"] for m in first["marks"]],
                     "chosen_scales": [by_seed[s]["chosen_scale"] for s in seeds],
                     "training_scale": first["training_scale"]}
        for kind in KINDS:
            acc = {s: [mark_accuracy(by_seed[s], m, kind) for m in range(n_marks)] for s in seeds}
            minutes = [statistics.mean(by_seed[s]["marks"][m]["train_seconds"] for s in seeds) / 60 for m in range(n_marks)]
            means = [statistics.mean(acc[s][m] for s in seeds) for m in range(n_marks)]
            final = [acc[s][-1] for s in seeds]
            vs_base = seed_interval([a - base["heldout_accuracy"] for a in final], Difference)
            res = {"mean": means, "interval": [_dict(_clipped(seed_interval([acc[s][m] for s in seeds]))) for m in range(n_marks)],
                   "minutes": minutes, "vs_base": _dict(vs_base), "vs_base_mean": statistics.mean(final) - base["heldout_accuracy"],
                   "vs_base_verdict": verdict(vs_base)}
            if common and name != REFERENCE:
                ref_final = {s: mark_accuracy(ref[s], -1, kind) for s in common}
                target = statistics.mean(ref_final.values())
                diff = seed_interval([acc[s][-1] - ref_final[s] for s in common], Difference)
                res["vs_reference"] = _dict(diff)
                res["vs_reference_mean"] = statistics.mean(acc[s][-1] - ref_final[s] for s in common)
                res["verdict"] = verdict(diff)
                early = [seed_interval([acc[s][m] - ref_final[s] for s in common], Difference) for m in range(n_marks - 1)]
                res["faster"] = any(d is not None and d.lo > 0 for d in early)
            elif name == REFERENCE:
                target = statistics.mean(final)
                res["faster"] = False
            else:
                target = None
            reach = next((m for m in range(n_marks) if target is not None
                          and statistics.mean(acc[s][m] for s in (common or seeds)) >= target), None)
            res["target"] = target
            res["reach_minutes"] = minutes[reach] if reach is not None else None
            row[kind] = res
        row["cost"] = {
            "iterations": statistics.mean(by_seed[s]["iterations"] for s in seeds),
            "train_minutes": statistics.mean(by_seed[s]["train_seconds"] for s in seeds) / 60,
            "train_cpu_minutes": (statistics.mean(by_seed[s]["train_cpu_seconds"] for s in seeds) / 60
                                  if all("train_cpu_seconds" in by_seed[s] for s in seeds) else None),
            "seconds_per_iteration": statistics.mean(by_seed[s]["seconds_per_iteration"] for s in seeds),
            "nfe_per_image": statistics.mean(by_seed[s]["nfe_per_image"] for s in seeds),
            "prep_minutes": statistics.mean(by_seed[s]["prep_seconds"] for s in seeds) / 60,
            "busy": sum(bool(by_seed[s]["busy"]) for s in seeds),
        }
        out[name] = row
    return out


def method_order(names) -> list[str]:
    """:data:`METHODS` order; names no longer in it last, alphabetically."""
    return sorted(names, key=lambda n: (list(METHODS).index(n) if n in METHODS else len(METHODS), n))


def _dict(value):
    return value.to_dict() if value is not None else None


def _interval_text(mean: float, iv: Mapping | None, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    text = f.format(mean)
    return text + (f" [{f.format(iv['lo'])}, {f.format(iv['hi'])}]" if iv else "")


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows]]


def format_tables(summary: Mapping[str, Mapping], base: Mapping) -> str:
    """The accuracy tables (chosen and training scale) and the cost table, as text."""
    names = method_order(summary)
    lines = [f"base model: best CFG on validation prompts {base['best_scale']}, held-out per-image accuracy there "
             f"{base['heldout_accuracy']:.3f}",
             f"intervals: {100 * LEVEL:g} % t-intervals over seeds (see the docstring); differences paired by seed"]
    for kind, title in zip(KINDS, ("the validation-chosen CFG scale (per seed)", "the training CFG scale")):
        marks = summary[names[0]]["marks"]
        header = ["method", "seeds", "CFG", *[f"@{f:g}" for f in marks], f"- base (CFG {base['best_scale']})",
                  f"- {REFERENCE}", f"reach {REFERENCE} (min)"]
        rows = []
        for n in names:
            r, k = summary[n], summary[n][kind]
            scales = "/".join(r["chosen_scales"]) if kind == "chosen" else r["training_scale"]
            vs_ref = (_interval_text(k["vs_reference_mean"], k["vs_reference"], True) + (f" {k['verdict']}" if k["verdict"] else "")
                      if "vs_reference" in k else "-")
            reach = f"{k['reach_minutes']:.1f}" if k["reach_minutes"] is not None else "-"
            rows.append([n, str(len(r["seeds"])), scales, *[_interval_text(m, iv) for m, iv in zip(k["mean"], k["interval"])],
                         _interval_text(k["vs_base_mean"], k["vs_base"], True) + (f" {k['vs_base_verdict']}" if k["vs_base_verdict"] else ""),
                         vs_ref, reach + (" faster" if k.get("faster") else "")])
        lines += ["", f"held-out per-image accuracy at {title}, by fraction of the training budget:", *_rows(header, rows)]
    header = ["method", "iterations", "train min", "CPU min", "s/iter", "NFE/img", "prep min", "busy"]
    rows = [[n, f"{c['iterations']:.1f}", f"{c['train_minutes']:.1f}",
             f"{c['train_cpu_minutes']:.1f}" if c.get("train_cpu_minutes") is not None else "-", f"{c['seconds_per_iteration']:.2f}",
             f"{c['nfe_per_image']:.1f}", f"{c['prep_minutes']:.1f}",
             f"busy {c['busy']} of {len(summary[n]['seeds'])}" if c["busy"] else "-"]
            for n in names for c in [summary[n]["cost"]]]
    lines += ["", "cost (means over seeds; prep = judge training / pair generation, not in train min):", *_rows(header, rows)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Stored cells -> results.json, plot
# --------------------------------------------------------------------------------------------


def stored_cells(out: Path, settings: Mapping | None) -> dict[str, dict[int, dict]]:
    """Every ``OUT/cells/METHOD/seedS.json``; each must share ``settings`` (when given)."""
    cells: dict[str, dict[int, dict]] = {}
    for path in sorted((out / "cells").glob("*/seed*.json")):
        cell = json.loads(path.read_text())
        diff = first_difference(cell["settings"], settings) if settings is not None else None
        if diff:
            raise DiffalignError(f"{path} was measured with other settings than the base model's ({diff})")
        cells.setdefault(cell["method"], {})[int(cell["seed"])] = cell
    return cells


def write_results(out: Path, base: Mapping, settings: Mapping | None) -> dict:
    """The tables of every stored cell (all measured with ``settings``, the base model with its part
    of them), printed and written to ``results.json`` and ``accuracy_vs_time.png``."""
    cells = stored_cells(out, settings)
    if not cells:
        raise DiffalignError(f"{out / 'cells'}: no finished cells yet")
    diff = first_difference(base["settings"], {"model": settings["model"], "eval": settings["eval"]})
    if diff:
        raise DiffalignError(f"{out / 'base'} was evaluated with other settings than the cells ({diff})")
    summary = summarise({m: cells[m] for m in method_order(cells)}, base)
    print(format_tables(summary, base))
    results = {"settings": settings, "interval": f"{100 * LEVEL:g} % t-interval over seeds; differences paired by seed",
               "base": {k: v for k, v in base.items() if k != "heldout"}, "methods": summary,
               "cells": [f"{m}/seed{s}" for m in cells for s in sorted(cells[m])]}
    from diffalign.runs import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    plot(summary, base, out / "accuracy_vs_time.png")
    print(f"saved {out / 'results.json'} and {out / 'accuracy_vs_time.png'}")
    return results


def plot(summary: Mapping[str, Mapping], base: Mapping, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, kind, title in zip(axes, KINDS, ("validation-chosen CFG scale", "training CFG scale")):
        for name, row in summary.items():
            k = row[kind]
            (line,) = ax.plot(k["minutes"], k["mean"], marker="o", ms=3, label=name)
            if all(iv is not None for iv in k["interval"]):
                ax.fill_between(k["minutes"], [iv["lo"] for iv in k["interval"]], [iv["hi"] for iv in k["interval"]],
                                color=line.get_color(), alpha=0.15)
        ax.axhline(base["heldout_accuracy"], color="grey", ls="--", lw=1, label=f"base (CFG {base['best_scale']})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training wall-clock (min, evaluations and preparation excluded)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out per-image accuracy (mean over seeds)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_numbers(text: str, flag: str, kind=float) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DiffalignError(f"{flag}: comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}") from None
    if not values:
        raise DiffalignError(f"{flag}: at least one value, got {text!r}")
    return values


def parse_sets(items: list[list[str]], flag: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, *overrides in items:
        if name not in METHODS:
            raise DiffalignError(f"{flag}: unknown method {name!r}; known: {', '.join(METHODS)}")
        out.setdefault(name, []).extend(overrides)
    return out


def budget_from_args(args, default: Budget = Budget("minutes", 15.0)) -> Budget:
    """The one budget flag given (``--minutes``, ``--cpu-minutes``, ``--iterations``), else ``default``."""
    for unit in Budget.UNITS:
        amount = getattr(args, unit)
        if amount is not None:
            flag = "--" + unit.replace("_", "-")
            if not amount > 0 or (unit == "iterations" and amount != int(amount)):
                raise DiffalignError(f"{flag} must be {'a whole number ' if unit == 'iterations' else ''}> 0, got {amount:g}")
            return Budget(unit, float(amount))
    return default


def add_cell_arguments(p: argparse.ArgumentParser, default_budget: Budget) -> None:
    """The flags every harness of cells shares (this one, ``limits.py``): seeds, the budget, the CFG
    scales, the model and how every evaluation samples; :func:`check_cell_arguments` reads them."""
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    budget = p.add_mutually_exclusive_group()
    default = f" (the default budget: {default_budget})"
    budget.add_argument("--minutes", type=float, help="budget per cell in training wall-clock minutes, evaluations excluded" + default)
    budget.add_argument("--cpu-minutes", type=float, help="budget per cell in this process's CPU minutes while training" + default)
    budget.add_argument("--iterations", type=float, help="budget per cell in trainer iterations" + default)
    p.set_defaults(default_budget=default_budget)
    p.add_argument("--scales", default="1,1.5,2,3,4", help="CFG scales to choose from on validation prompts")
    p.add_argument("--model", default="shapes", help="model.id of every cell and of the base model")
    p.add_argument("--images-per-family", type=int, default=96, help="evaluation images per prompt family")
    p.add_argument("--eval-steps", type=int, default=20, help="ODE steps of every evaluation")
    p.add_argument("--eval-seed", type=int, default=1234)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto", help="evaluation forwards")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")


def check_cell_arguments(args) -> None:
    """Parse and check what :func:`add_cell_arguments` added, in place (one DiffalignError naming the flag)."""
    args.seeds = parse_numbers(args.seeds, "--seeds", int)
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        raise DiffalignError(f"--seeds: distinct integers >= 0, got {args.seeds}")
    args.budget = budget_from_args(args, args.default_budget)
    args.scales = sorted(set(parse_numbers(args.scales, "--scales")))
    if args.scales[0] < 1:
        raise DiffalignError(f"--scales: CFG scales >= 1 (1 = no guidance), got {args.scales}")
    for flag, value in (("--images-per-family", args.images_per_family), ("--eval-steps", args.eval_steps),
                        ("--eval-batch-size", args.eval_batch_size)):
        if value < 1:
            raise DiffalignError(f"{flag} must be >= 1, got {value}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated names (default: all)")
    add_cell_arguments(p, Budget("minutes", 15.0))
    p.add_argument("--marks", default="0.25,0.5,1", help="fractions of the budget at which held-out accuracy is measured (1 is added)")
    p.add_argument("--prepare", action="store_true", help="train missing judges (SPO's SPM, DRM Step-GRPO's DRM)")
    p.add_argument("--table-only", action="store_true", help="print the table from the stored cells; run nothing")
    p.add_argument("--out", default=str(ROOT / "runs" / "leaderboard"))
    p.add_argument("--set", dest="sets", nargs="+", action="append", default=[], metavar=("METHOD", "KEY=VALUE"),
                   help="overrides for one method's training (repeatable)")
    p.add_argument("--judge-set", dest="judge_sets", nargs="+", action="append", default=[], metavar=("METHOD", "KEY=VALUE"),
                   help="overrides for one method's judge training (SPM / DRM config keys)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every method (before any --set / --judge-set, "
                                                "which take every word after them)")
    args = p.parse_args(argv)
    args.method_names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_names if m not in METHODS]
    if unknown or not args.method_names:
        raise DiffalignError(f"--methods: unknown {', '.join(unknown) or 'none given'}; known: {', '.join(METHODS)}")
    check_cell_arguments(args)
    marks = parse_numbers(args.marks, "--marks")
    if any(not 0 < m <= 1 for m in marks):
        raise DiffalignError(f"--marks: fractions in (0, 1], got {args.marks!r}")
    args.marks = sorted({*marks, 1.0})
    args.sets = parse_sets(args.sets, "--set")
    args.judge_sets = parse_sets(args.judge_sets, "--judge-set")
    for name in args.judge_sets:
        if METHODS[name].judge is None:
            raise DiffalignError(f"--judge-set: {name} has no judge (only {', '.join(n for n, m in METHODS.items() if m.judge)})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    spec = EvalSpec(args.images_per_family, args.eval_steps, args.eval_seed, args.eval_batch_size, args.mixed_precision)
    if args.table_only:
        summary = out / "base" / "summary.json"
        if not summary.is_file():
            raise DiffalignError(f"{summary}: no base evaluation stored yet (run the leaderboard first)")
        base = json.loads(summary.read_text())
        cells = stored_cells(out, None)
        settings = next(iter(next(iter(cells.values())).values()))["settings"] if cells else None
        return write_results(out, base, settings)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    check_judges(args.method_names, args.seeds, args, out)
    settings = run_settings(args, spec)
    base = base_model(args, spec, out)
    for name in args.method_names:
        for seed in args.seeds:
            path = cell_path(out, name, seed)
            if path.is_file():
                stored = json.loads(path.read_text())
                diff = first_difference({"settings": stored["settings"], "overrides": stored["overrides"]},
                                        {"settings": settings, "overrides": method_overrides(name, args)})
                if diff:
                    raise DiffalignError(f"{path} was measured with other settings ({diff}); use another --out or delete it")
                print(f"- {name} seed {seed}: done earlier ({path})", flush=True)
                continue
            print(f"- {name} seed {seed}: {args.budget} of training", flush=True)
            cell = run_cell(name, seed, args, spec, out)
            from diffalign.runs import atomic_write_text

            atomic_write_text(path, json.dumps(cell))
    return write_results(out, base, settings)


def run_cli(main: Callable, argv=None) -> int:
    """``main(argv)`` with bad input as one ``error: ...`` line and exit code 2 (every cell harness's
    command line: this one, ``limits.py``, ``pretrain_plateau.py``)."""
    try:
        main(argv)
    except DiffalignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cli(argv=None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
