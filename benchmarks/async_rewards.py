"""Seconds per Flow-GRPO iteration with ``reward.async`` on and off, side by side in one process.

    python benchmarks/async_rewards.py [--repeats R] [--threads T] [--kinds sleep,python] [key=value ...]

One trainer (the tiny SD3 config, 4 prompts x 4 images in chunks of 4: four chunks per iteration)
runs iterations alternately with the reward pool synchronous and asynchronous (off on, on off,
...), after one warm-up iteration of each. The reward is brightness wrapped to cost, per chunk,
as long as sampling one chunk takes (calibrated on the warm-up's ``time/rollout``):

- ``sleep``: waits (``time.sleep``) - a reward that releases the GIL: an HTTP judge, a model on
  another device;
- ``python``: a pure-Python loop for that long - a reward that holds the GIL throughout.

With n chunks, sampling r and scoring s <= r seconds each and an update of u seconds, the
synchronous iteration takes n (r + s) + u and the asynchronous one n r + s + u: only the last
chunk's scoring is left after sampling. The table gives medians, the ratio sync / async per
pair of neighbouring iterations (its median and range over the repeats) and that ideal.
The exit code is 0 whatever the numbers (a measurement, not a test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from diffalign.config_files import load_config  # noqa: E402
from diffalign.trainer import build_trainer  # noqa: E402

CONFIG = "configs/tiny/flow_grpo_sd3.yaml"
BASE = ["rollout.prompts_per_iteration=4", "rollout.group_size=4", "rollout.sample_batch_size=4", "train.batch_size=16",
        "sampling.num_steps=10", "reward.name=brightness", "eval.at_start=false", "log.progress_bar=false", "log.report=false"]


class CostlyReward:
    """``inner`` plus ``seconds`` of cost per call: slept (GIL released) or spent in Python (GIL held)."""

    def __init__(self, inner, seconds: float, kind: str):
        self.inner, self.seconds, self.kind = inner, seconds, kind

    def __call__(self, images, prompts, metadata):
        end = time.perf_counter() + self.seconds
        if self.kind == "sleep":
            time.sleep(self.seconds)
        else:
            x = 0
            while time.perf_counter() < end:
                for i in range(1000):
                    x += i * i
        return self.inner(images, prompts, metadata)


def timed(trainer, it: int, asynchronous: bool) -> dict:
    trainer.reward_pool.asynchronous = asynchronous
    t0 = time.perf_counter()
    record = trainer.guarded_iteration(it)
    return {"seconds": time.perf_counter() - t0, "rollout": record["time/rollout"], "update": record["time/update"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per mode and kind")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--kinds", default="sleep,python", help="reward costs to measure: sleep (GIL released), python (GIL held)")
    p.add_argument("--output-dir", default=None, help="run directory (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="extra config overrides")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tempfile

    out = args.output_dir or tempfile.mkdtemp(prefix="async_rewards_")
    cfg = load_config(CONFIG, [*BASE, f"output_dir={out}", f"max_iterations={10 ** 6}", *args.overrides])
    trainer = build_trainer(cfg, overwrite=True, log=lambda m: None)
    trainer.setup()
    inner = trainer.reward_fn
    chunks = -(-cfg.rollout.prompts_per_iteration * cfg.rollout.group_size // cfg.rollout.sample_batch_size)
    it = 0
    for mode in (False, True):  # warm-up, and the rollout time the reward is calibrated to
        warm = timed(trainer, it, mode)
        it += 1
    per_chunk = warm["rollout"] / chunks
    print(f"cpu threads {args.threads}, {chunks} chunks per iteration, sampling {per_chunk:.3f} s per chunk, "
          f"update {warm['update']:.3f} s; the reward costs {per_chunk:.3f} s per chunk")
    results = {}
    print(f"{'reward':<8} {'sync s/it':>10} {'async s/it':>11} {'sync/async (median, range)':>28} {'ideal':>6}")
    for kind in args.kinds.split(","):
        trainer.reward_fn = CostlyReward(inner, per_chunk, kind)
        times = {False: [], True: []}
        ratios = []
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            pair = {}
            for mode in order:
                pair[mode] = timed(trainer, it, mode)
                it += 1
                times[mode].append(pair[mode])
            ratios.append(pair[False]["seconds"] / pair[True]["seconds"])
        sync = statistics.median(t["seconds"] for t in times[False])
        asyn = statistics.median(t["seconds"] for t in times[True])
        u_ = statistics.median(t["update"] for t in times[True])
        ideal = (chunks * 2 * per_chunk + u_) / (chunks * per_chunk + per_chunk + u_)
        results[kind] = {"sync": sync, "async": asyn, "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "ideal": ideal}
        print(f"{kind:<8} {sync:>10.3f} {asyn:>11.3f} {statistics.median(ratios):>12.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
              f"{'':>6} {ideal:>6.3f}")
    trainer.reward_pool.shutdown()
    return results


if __name__ == "__main__":
    main()
