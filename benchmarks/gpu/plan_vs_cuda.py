"""The memory planner against torch.cuda.max_memory_allocated on tiny builds (a GPU only; skips cleanly otherwise).

    python benchmarks/gpu/plan_vs_cuda.py [--families sd3 flux wan] [--out plan_vs_cuda.json]

For each family's tiny recipe, LoRA and full fine-tuning, with and without gradient checkpointing:
one training micro-batch on the GPU (``diffalign.planner.measure.measure_step``: the trainer's
policy, optimizer and a CFG forward + backward, after a first step that creates the optimizer
states), its CUDA peak above what was allocated before the model loaded, the same step's peak as
the CPU allocation tracker counts it, and the plan's estimate (its train phase less the rollout's
trajectories, which the step does not hold). The CUDA peak includes the caching allocator's
rounding (512-byte blocks) and cuBLAS / attention workspaces, which tiny models make look large.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from diffalign.adapters import load_adapter
from diffalign.config_files import load_config
from diffalign.planner import Settings, plan
from diffalign.planner.measure import measure_step

FAMILIES = ("sd3", "flux", "wan", "qwen", "sana")
BATCH, RESOLUTION = 3, 48


def estimate(cfg) -> float:
    p = plan(Settings.from_config(cfg))
    return sum(line.bytes for line in p.phases["train"] if not line.name.startswith("rollout trajectories"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_vs_cuda: no CUDA device, skipped")
        return 0
    rows = []
    for family in args.families:
        for lora in (True, False):
            for ckpt in (False, True):
                overrides = [f"lora.enabled={str(lora).lower()}", f"train.gradient_checkpointing={str(ckpt).lower()}",
                             f"train.batch_size={BATCH}", f"model.resolution={RESOLUTION}", "algorithm.beta=0"]
                cfg = load_config(f"tiny/flow_grpo_{family}", overrides)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                adapter = load_adapter(cfg.model.id, device="cuda", **cfg.model.options)
                tracked = measure_step(adapter, cfg).peak
                cuda_peak = torch.cuda.max_memory_allocated() - before
                planned = estimate(cfg)
                row = {"family": family, "lora": lora, "checkpointing": ckpt, "plan": planned, "cuda_peak": cuda_peak,
                       "tracked_peak": tracked, "plan_over_cuda": round(planned / cuda_peak, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del adapter
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
