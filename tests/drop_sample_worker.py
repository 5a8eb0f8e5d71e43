"""Run by tests/test_distributed.py under torch.distributed.run: ``diffalign train`` (a config and
overrides from argv) where the last sample of every iteration is left out of the update, which is
what a sharding defect that loses one sample does."""

import sys

from diffalign.config_files import load_config
from diffalign.trainer import build_trainer


def main(config: str, *overrides: str) -> None:
    tr = build_trainer(load_config(config, list(overrides)), overwrite=True)
    update = tr.update

    def update_without_last(traj, embeds, sample_ids, n_global, advantages, keep):
        keep = keep.clone()
        keep[n_global - 1] = False
        return update(traj, embeds, sample_ids, n_global, advantages, keep)

    tr.update = update_without_last
    tr.train()


if __name__ == "__main__":
    main(*sys.argv[1:])
