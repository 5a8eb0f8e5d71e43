"""Has a ShapesWorld pretraining run reached its plateau? Each checkpoint's model at its
validation-best CFG scale, with pass@k, and the gain per ``--window`` steps.

    python benchmarks/pretrain_plateau.py CHECKPOINT [CHECKPOINT ...] [--scales 1,1.5,2,3,4]
        [--images-per-family 96] [--k 4] [--window 2000] [--min-gain 0.01] [--out DIR]
    python benchmarks/pretrain_plateau.py --table-only [--out DIR]

CHECKPOINT
    A pretraining state folder (``scripts/pretrain_shapes.py --state-dir``, or one of the
    ``<state-dir>-stepNNNNNN`` folders ``--save-every`` keeps), whose EMA model is exported once
    into ``OUT/models/stepN`` (``pretrain_shapes.py --resume --export-only`` with the architecture
    and timestep shift its ``state.json`` records); or a saved model folder as ``STEP=FOLDER``
    (``4500=diffalign/assets/shapes-t2i``: the shipped model is step 4,500 of its run).

Per checkpoint
    ShapesEval on the validation prompts (``prompt_set("validation")``, carved from the training
    split) at every ``--scales`` scale with one seed, ``--images-per-family`` images per family
    (:class:`diffalign.best_scale.BestScaleSpec`; each evaluation stored under
    ``OUT/evals/stepN/`` and reused), the best scale (per-image pass rate, ties: the lower), and at
    that scale pass@k per family (the unbiased estimator of ``benchmarks/pass_at_k.py``; the mean
    over families, capped per family at its fewest images per prompt): how much a model that
    always produced its own best of k samples would pass, the ceiling of what sharpening its own
    samples (RL on a verifier) can reach. Held-out prompts are not touched: they are for the final
    number of the model chosen here. Results: ``OUT/steps/stepN.json`` (skipped when present).

Plateau rule
    The gain at checkpoint s is its validation per-image rate at its best scale minus that of the
    latest checkpoint at or before ``s - window``, with the paired 95 % bootstrap interval over
    prompts (every checkpoint samples the same images from the same noise). The run has reached
    its plateau at the first checkpoint whose gain is below ``--min-gain``. ``OUT/table.md`` and
    ``OUT/results.json`` hold the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.leaderboard import cpu_model, run_cli  # noqa: E402
from benchmarks.pass_at_k import family_table  # noqa: E402
from diffalign.errors import DiffalignError  # noqa: E402
from diffalign.import_noise import filter_known_import_messages  # noqa: E402

filter_known_import_messages()  # before diffusers loads: its dependencies' known import chatter, as the CLI does

PRETRAIN = ROOT / "scripts" / "pretrain_shapes.py"
HEADLINE = "acc/images"


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def architecture_flags(info: Mapping) -> list[str]:
    """The ``pretrain_shapes.py`` flags of the architecture and timestep shift a ``state.json`` records."""
    arch = info.get("architecture", {})
    flags = []
    if "text_encoder" in arch:
        flags += ["--text-encoder", str(arch["text_encoder"])]
    if "cross_attention_levels" in arch:
        flags += ["--cross-attention-levels", str(arch["cross_attention_levels"])]
    if arch.get("text_time_embedding") is False:
        flags.append("--no-text-time-embedding")
    if arch.get("coordinate_channels"):
        flags.append("--coordinate-channels")
    if "timestep_shift" in info:
        flags += ["--timestep-shift", f"{float(info['timestep_shift']):g}"]
    return flags


def parse_checkpoint(text: str) -> tuple[int, Path, bool]:
    """``(step, folder, is_state)`` of a CHECKPOINT argument."""
    if "=" in text:
        step, folder = text.split("=", 1)
        try:
            step_number = int(step)
        except ValueError:
            raise DiffalignError(f"checkpoint {text!r}: STEP=FOLDER needs an integer step") from None
        if not (Path(folder) / "model_index.json").is_file():
            raise DiffalignError(f"checkpoint {text!r}: {folder} is not a saved model folder (no model_index.json)")
        return step_number, Path(folder), False
    state = Path(text)
    if not (state / "state.json").is_file():
        raise DiffalignError(f"checkpoint {text!r}: neither a pretraining state folder (no state.json) nor STEP=FOLDER")
    return int(json.loads((state / "state.json").read_text())["step"]), state, True


def export_state(state: Path, out: Path, extra: Sequence[str] = ()) -> Path:
    """The EMA model of a pretraining state, exported into ``out`` (once); ``extra``: more
    ``pretrain_shapes.py`` flags (``--tiny`` for a tiny test state, which its record does not name)."""
    if (out / "model_index.json").is_file():
        return out
    info = json.loads((state / "state.json").read_text())
    cmd = [sys.executable, str(PRETRAIN), *architecture_flags(info), "--state-dir", str(state), "--resume",
           "--export-only", "--no-eval", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DiffalignError(f"exporting {state} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return out


# --------------------------------------------------------------------------------------------
# Numbers (pure)
# --------------------------------------------------------------------------------------------


def mean_pass_at_k(records: Sequence[Mapping], k: int) -> float | None:
    """pass@k averaged over families (None when a family has fewer than k images per prompt)."""
    table = family_table(list(records), [k])
    values = [row.get(f"pass@{k}") for row in table.values()]
    return None if not values or None in values else sum(values) / len(values)


def plateau(steps: Mapping[int, Mapping], window: int, min_gain: float) -> dict:
    """Per checkpoint the gain over the latest checkpoint at or before ``step - window`` (its
    ``gain`` entry: value, lo, hi of the paired interval, and the step compared with), and the first
    step whose gain is below ``min_gain`` (None: not reached among these checkpoints)."""
    from diffalign.stats import paired_difference

    order = sorted(steps)
    gains, reached = {}, None
    for s in order:
        earlier = [e for e in order if e <= s - window]
        if not earlier:
            continue
        e = earlier[-1]
        d = paired_difference(steps[e]["records"], steps[s]["records"])[HEADLINE]
        gains[s] = {"over_step": e, **d.to_dict()}
        if reached is None and d.value < min_gain:
            reached = s
    return {"gains": gains, "reached_at": reached, "window": window, "min_gain": min_gain}


def format_table(steps: Mapping[int, Mapping], result: Mapping, k: int) -> str:
    lines = [f"validation per-image pass rate of each checkpoint at its best CFG scale; gain over the checkpoint "
             f"{result['window']} steps earlier (paired 95 % bootstrap over prompts)", "",
             f"| step | best CFG | per image | partial credit | pass@{k} | gain per {result['window']} steps |",
             "|---:|---:|---|---:|---:|---|"]
    for s in sorted(steps):
        r, g = steps[s], result["gains"].get(s)
        iv = r["interval"]
        gain = f"{g['value']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] (over {g['over_step']})" if g else "-"
        pk = f"{r['pass_at_k']:.3f}" if r["pass_at_k"] is not None else "-"
        lines.append(f"| {s} | {r['scale']:g} | {iv['value']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}] | {r['partial']:.3f} "
                     f"| {pk} | {gain} |")
    reached = result["reached_at"]
    lines.append("")
    lines.append(f"plateau (gain below {result['min_gain']:g} per {result['window']} steps): "
                 + (f"reached at step {reached}" if reached is not None else "not reached among these checkpoints"))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def evaluate_checkpoint(step: int, model: Path, args, out: Path, source: str = "") -> dict:
    """One checkpoint's validation evaluations at every scale, its best scale and pass@k there;
    ``source``: the checkpoint as given (a state folder), recorded instead of its export's path."""
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.best_scale import BestScaleSpec, cached_evaluation, choose_scale, scale_text
    from diffalign.evaluation import eval_autocast_dtype
    from diffalign.shapes import prompt_set

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = BestScaleSpec(tuple(args.scales), tuple(prompt_set("validation")), tuple(prompt_set("heldout")),
                         validation_images_per_family=args.images_per_family, num_steps=args.eval_steps, seed=args.eval_seed,
                         batch_size=args.eval_batch_size, autocast_dtype=eval_autocast_dtype(args.mixed_precision, device))
    adapter = None

    def evaluation(scale: float):
        def compute():
            nonlocal adapter
            if adapter is None:
                adapter = load_adapter(str(model), device=device)
                adapter.denoiser.eval()
            print(f"  step {step}: validation at CFG {scale_text(scale)} ...", flush=True)
            ev = spec.evaluate(adapter, "validation", scale)
            ev.meta.update({"split": "validation", "model": f"step {step}"})
            return ev

        return cached_evaluation(out / "evals" / f"step{step}" / f"validation_cfg{scale_text(scale)}.json", compute,
                                 expect={**spec.expected_meta("validation", scale), "model": f"step {step}"},
                                 prompts=spec.items("validation"))

    validation = {s: evaluation(s) for s in args.scales}
    best = choose_scale({s: ev.metrics[HEADLINE] for s, ev in validation.items()})
    chosen = validation[best]
    return {"step": step, "model": source or str(model), "scale": best,
            "validation": {scale_text(s): ev.metrics[HEADLINE] for s, ev in validation.items()},
            "interval": chosen.intervals[HEADLINE].to_dict(), "partial": chosen.metrics["partial"],
            "pass_at_k": mean_pass_at_k(chosen.records, args.k), "k": args.k, "records": chosen.records,
            "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "seconds": sum(ev.seconds for ev in validation.values()),
            "settings": settings(args)}


def settings(args) -> dict:
    return {"scales": list(args.scales), "images_per_family": args.images_per_family, "eval_steps": args.eval_steps,
            "eval_seed": args.eval_seed, "precision": args.mixed_precision, "k": args.k}


def stored_steps(out: Path) -> dict[int, dict]:
    return {int(json.loads(p.read_text())["step"]): json.loads(p.read_text()) for p in sorted((out / "steps").glob("step*.json"))}


def write_results(out: Path, args) -> dict:
    from diffalign.runs import atomic_write_text

    steps = stored_steps(out)
    if not steps:
        raise DiffalignError(f"{out / 'steps'}: no checkpoint evaluated yet")
    k = next(iter(steps.values()))["k"]
    result = plateau(steps, args.window, args.min_gain)
    table = format_table(steps, result, k)
    print(table)
    summary = {"plateau": {**result, "gains": {str(s): g for s, g in result["gains"].items()}}, "steps": {str(s): {key: v for key, v in r.items() if key != "records"} for s, r in steps.items()}}
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "table.md", table + "\n")
    return summary


def parse_args(argv=None):
    from diffalign.best_scale import parse_scales

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="*", help="pretraining state folders, or STEP=MODEL_FOLDER")
    p.add_argument("--scales", default="1,1.5,2,3,4", help="CFG scales to choose from on validation prompts")
    p.add_argument("--images-per-family", type=int, default=96, help="validation images per prompt family")
    p.add_argument("--k", type=int, default=4, help="pass@k at the best scale")
    p.add_argument("--window", type=int, default=2000, help="steps over which the gain is measured")
    p.add_argument("--min-gain", type=float, default=0.01, help="a gain per window below this is the plateau")
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--eval-seed", type=int, default=1234)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="auto")
    p.add_argument("--export-flags", default="", help="more pretrain_shapes.py flags for exporting a state, as one word: --export-flags=--tiny")
    p.add_argument("--table-only", action="store_true", help="print the table from the stored results; evaluate nothing")
    p.add_argument("--out", default=str(ROOT / "runs" / "pretrain_plateau"))
    args = p.parse_args(argv)
    args.scales = parse_scales(args.scales)
    for flag, value in (("--images-per-family", args.images_per_family), ("--k", args.k), ("--window", args.window),
                        ("--eval-steps", args.eval_steps), ("--eval-batch-size", args.eval_batch_size)):
        if value < 1:
            raise DiffalignError(f"{flag} must be >= 1, got {value}")
    if not args.table_only and not args.checkpoints:
        raise DiffalignError("give checkpoints to evaluate, or --table-only")
    return args


def main(argv=None) -> dict:
    from diffalign.runs import atomic_write_text

    args = parse_args(argv)
    out = Path(args.out)
    if not args.table_only:
        for text in args.checkpoints:
            step, folder, is_state = parse_checkpoint(text)
            path = out / "steps" / f"step{step}.json"
            if path.is_file():
                stored = json.loads(path.read_text())
                if stored["settings"] != settings(args):
                    raise DiffalignError(f"{path} was measured with other settings; use another --out or delete it")
                print(f"- step {step}: done earlier ({path})", flush=True)
                continue
            model = export_state(folder, out / "models" / f"step{step}", args.export_flags.split()) if is_state else folder
            print(f"- step {step}: {model}", flush=True)
            atomic_write_text(path, json.dumps(evaluate_checkpoint(step, model, args, out, source=text)))
    return write_results(out, args)


def cli(argv=None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
