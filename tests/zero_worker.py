"""Run by tests/test_zero.py under torch.distributed.run: drives a ZeRO-2 trainer's backend (backward /
discard / step) by hand and writes what it saw to argv[1] (rank 0)."""

import json
import sys

import torch

from diffalign.config_files import load_config
from diffalign.trainer import build_trainer


def main(out: str, run_dir: str) -> None:
    cfg = load_config("configs/tiny/flow_grpo_sd3.yaml", [f"output_dir={run_dir}", "train.zero_stage=2", "log.progress_bar=false",
                                                          "train.ema.enabled=false", "optim.lr=1e-2", "optim.grad_clip=0"])
    tr = build_trainer(cfg, overwrite=True)
    tr.setup()
    p = tr.trainable
    before = [x.detach().clone() for x in p]
    rank = tr.accelerator.process_index

    def loss_fn():  # a different loss on each process; the global gradient is their sum
        return sum(((x.float() - 0.1 * (rank + 1)) ** 2).sum() for x in p)

    tr.backend.backward(loss_fn())
    tr.backend.discard_gradients()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, p))
    tr.backend.backward(loss_fn())
    tr.backend.backward(loss_fn())  # two micro-batches: accumulated
    norm, applied = tr.backend.optimizer_step()
    # expected global gradient: sum over ranks and micro-batches of 2 (x - c_r)
    world = tr.accelerator.num_processes
    grads = [sum(4 * (b.float() - 0.1 * (r + 1)) for r in range(world)) for b in before]
    expected_norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    moved = max(float((a - b).abs().max()) for a, b in zip(before, p))
    if rank == 0:
        json.dump({"unchanged_after_discard": unchanged, "applied": applied, "norm": norm, "expected_norm": expected_norm,
                   "moved": moved, "skipped": tr.stats["skipped_steps"], "world": world}, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
