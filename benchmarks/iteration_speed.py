"""Seconds per Flow-GRPO iteration of the main job, fp32 vs the fast settings, side by side.

Builds two trainers of ``configs/shapes/flow_grpo.yaml`` (same seed, images and steps) that differ
only in the fast settings, and alternates their iterations in one process, so that both see the
same machine load. Prints the median rollout, update and total seconds per iteration, their
old/new ratios, and each trainer's on-policy self-check (max |log ratio| before the first update).

    python benchmarks/iteration_speed.py [--iterations 4] [--threads 2] [key=value ...]

"old": the main job as it was first tuned: LoRA rank 16 (alpha 32) on the UNet, fp32
       (train.mixed_precision=no, channels_last=false, detach_uncond=false)
"new": the main job as shipped: full fine-tuning (lora.enabled=false), bf16 autocast where the CPU
       has AVX512-BF16 or AMX (train.mixed_precision=auto), channels_last=true, detach_uncond=true
Both sample and train the same images with the same steps. ``--settings-only`` keeps LoRA on both
sides and compares the precision / memory-format switches alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # the sweep module names the LoRA recipe
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

SETTINGS = {
    "old": ["train.mixed_precision=no", "train.channels_last=false", "train.detach_uncond=false"],
    "new": ["train.mixed_precision=auto", "train.channels_last=true", "train.detach_uncond=true"],
}


def main(argv=None) -> int:
    import torch

    from diffalign.config_files import load_config
    from diffalign.trainer import build_trainer
    from sweep_flow_grpo import LORA  # the first tuned main job's LoRA, as the sweep names it

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/shapes/flow_grpo.yaml"))
    p.add_argument("--iterations", type=int, default=4, help="timed iterations per setting (after one warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--settings-only", action="store_true",
                   help="LoRA on both sides (rank 16): only the precision / memory-format switches differ")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="iteration_speed_"))
    trainers = {}
    for name, settings in SETTINGS.items():
        training = LORA if name == "old" or args.settings_only else []
        cfg = load_config(args.config, [f"output_dir={out / name}", "log.progress_bar=false", "log.report=false",
                                        "eval.at_start=false", *args.overrides, *training, *settings])
        trainer = build_trainer(cfg, overwrite=True)
        trainer.setup()
        trainers[name] = trainer
    times = {name: [] for name in trainers}
    for it in range(args.iterations + 1):
        for name, trainer in trainers.items():
            record = trainer.iteration(it)
            if it > 0:  # the first iteration warms up allocators and kernels
                times[name].append((record["time/rollout"], record["time/update"]))
            print(f"  {name} iteration {it}: rollout {record['time/rollout']:.2f} s, update {record['time/update']:.2f} s, "
                  f"reward {record['reward_mean']:.3f}", flush=True)
    med = {name: [statistics.median(t[i] for t in ts) for i in range(2)] for name, ts in times.items()}
    print(f"\n{Path(args.config).name}: median seconds per iteration over {args.iterations} iterations "
          f"({torch.get_num_threads()} threads)")
    print(f"{'':8}{'rollout':>10}{'update':>10}{'total':>10}  precision  self-check |log ratio|  training")
    for name, (roll, upd) in med.items():
        tr = trainers[name]
        kind = "LoRA r16" if tr.cfg.lora.enabled else "full"
        print(f"{name:8}{roll:10.2f}{upd:10.2f}{roll + upd:10.2f}  {tr.mixed_precision:9}  {tr.self_check_log_ratio:.2e}  {kind}")
    (r_old, u_old), (r_new, u_new) = med["old"], med["new"]
    print(f"{'old/new':8}{r_old / r_new:9.2f}x{u_old / u_new:9.2f}x{(r_old + u_old) / (r_new + u_new):9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
