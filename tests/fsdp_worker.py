"""Run by tests/test_fsdp.py (one process, or two under torch.distributed.run): Flow-GRPO on tiny
SD3 where the second half of every iteration's samples is dropped from training (keep = False), so
that under FSDP the second process has no micro-batches and must join the first one's forwards."""

import sys

import torch

from diffalign.config_files import load_config
from diffalign.trainer import build_trainer


def main(run_dir: str, *overrides: str) -> None:
    cfg = load_config("configs/tiny/flow_grpo_sd3.yaml", [f"output_dir={run_dir}", "max_iterations=2", "log.progress_bar=false",
                                                          "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2",
                                                          "train.ema.enabled=false", "optim.lr=1e-2", "train.batch_size=2",
                                                          *overrides])
    tr = build_trainer(cfg, overwrite=True)
    update = tr.update

    def update_first_half(traj, embeds, sample_ids, n_global, advantages, keep):
        keep = keep.clone()
        keep[n_global // 2:] = False
        return update(traj, embeds, sample_ids, n_global, advantages, keep)

    tr.update = update_first_half
    tr.train()


if __name__ == "__main__":
    main(*sys.argv[1:])
