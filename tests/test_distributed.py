"""Two CPU processes (gloo) compute the same advantages and update as one process over the same
samples: the same logged numbers, and weights at most REL of the update apart
(tests/helpers/compare.py). The runs train with plain SGD and a continuous reward, under which the
processes' gradients agree with one process's up to the rounding of another summation order, and
so do the weights.

Not with AdamW: there Diffusion-DPO's two runs end 5e-4 apart on one LoRA A element (lr 1e-2).
Its gradient is exactly zero at the first step (LoRA B starts at zero), then rounding noise at the
second: -2.8e-9 with one process, -1.6e-9 with two, where the largest element is 0.13. AdamW
normalises that noise into steps of 1.24e-3 and 7.4e-4; the gradients themselves agree to 4e-7."""

import json

import pytest

from tests.helpers.compare import COMPARABLE, assert_same_update, weights
from tests.helpers.launch import launch

REL = 1e-3  # largest weight difference allowed, in units of the update
# SGD steps are lr x gradient and the policy gradients of the tiny models are small (~1e-4 for
# Flow-GRPO): each learning rate below moves the weights by about 1e-2 in two iterations.
COMMON = ["configs/tiny/flow_grpo_sd3.yaml", "max_iterations=2", "log.progress_bar=false", "log.report=false",
          "eval.at_start=false", "sampling.eval_num_steps=2", "train.ema.enabled=false", "optim.lr=50",
          "train.batch_size=64", *COMPARABLE]


def train_records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]


def test_two_processes_match_one(repo_root, tmp_path):
    start, one, two = tmp_path / "start", tmp_path / "one", tmp_path / "two"
    train = ["-m", "diffalign.cli", "train", *COMMON]
    launch([*train, f"output_dir={start}", "max_iterations=0"], repo_root)
    launch([*train, f"output_dir={one}", "rollout.prompts_per_iteration=2"], repo_root)
    launch([*train, f"output_dir={two}", "rollout.prompts_per_iteration=1"], repo_root, nproc=2)
    a, b = train_records(one), train_records(two)
    # same samples and rewards, hence the same advantages (up to rounding from the second iteration)
    for key in ("reward_mean", "advantage_abs_mean"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-3)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


def test_a_lost_sample_fails_the_comparison(repo_root, tmp_path):
    """The comparison catches a sharding defect: two processes where the second leaves one of its
    samples out of the update (tests/drop_sample_worker.py) do not match one process."""
    start, one, two = tmp_path / "start", tmp_path / "one", tmp_path / "two"
    launch(["-m", "diffalign.cli", "train", *COMMON, f"output_dir={start}", "max_iterations=0"], repo_root)
    launch(["-m", "diffalign.cli", "train", *COMMON, f"output_dir={one}", "rollout.prompts_per_iteration=2"], repo_root)
    launch(["tests/drop_sample_worker.py", *COMMON, f"output_dir={two}", "rollout.prompts_per_iteration=1"], repo_root, nproc=2)
    with pytest.raises(AssertionError, match="apart"):
        assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


FAST = ["log.progress_bar=false", "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2", "train.ema.enabled=false",
        "max_iterations=2", "eval.every=0", "checkpoint.every=0", *COMPARABLE, "--overwrite"]
# (config, overrides for both, one process, two processes): the same global batch either way
OTHER_ALGORITHMS = {
    "stepwise_flow_grpo": ("configs/tiny/stepwise_flow_grpo_sd3.yaml", ["optim.lr=1", "train.batch_size=64"],
                           ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "branch_grpo": ("configs/tiny/branch_grpo_sd3.yaml", ["optim.lr=20", "train.batch_size=64"],
                    ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "diffusion_nft": ("configs/tiny/diffusion_nft_sd3.yaml", ["optim.lr=2", "train.batch_size=64"],
                      ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "awm": ("configs/tiny/awm.yaml", ["optim.lr=2", "train.batch_size=64"],
            ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "flow_grpo_guard": ("configs/tiny/flow_grpo_guard.yaml", ["optim.lr=5", "train.batch_size=64"],
                        ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "spo": ("configs/tiny/spo_sd15.yaml", ["optim.lr=0.5", "train.batch_size=64"],
            ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "diffusion_dpo": ("configs/shapes/diffusion_dpo.yaml",
                      ["optim.lr=1e-2", "model.id=tiny:shapes", "prompts.families=[single_object]",
                       "algorithm.generate_images_per_prompt=2", "train.optimizer_steps_per_iteration=2"],
                      ["train.batch_size=4"], ["train.batch_size=2"]),
}
PER_PROCESS = ("seconds", "time/", "rollout_forwards", "pairs_local_kept", "trained_terms")  # costs and local counts, not results


@pytest.mark.parametrize("name", list(OTHER_ALGORITHMS))
def test_other_algorithms_two_processes_match_one(repo_root, tmp_path, name):
    """Every recipe draws global noise, prompts and shuffles and normalises by global term counts:
    two processes log the same numbers and end at the same weights as one (up to summation order)."""
    config, both, one_proc, two_proc = OTHER_ALGORITHMS[name]
    base = ["-m", "diffalign.cli", "train", config, *FAST, *both]
    start, one, two = tmp_path / "start", tmp_path / "one", tmp_path / "two"
    launch([*base, f"output_dir={start}", *one_proc, "max_iterations=0"], repo_root)
    launch([*base, f"output_dir={one}", *one_proc], repo_root)
    launch([*base, f"output_dir={two}", *two_proc], repo_root, nproc=2)
    a, b = train_records(one), train_records(two)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            if isinstance(va, (int, float)) and not any(p in key for p in PER_PROCESS):
                assert rb[key] == pytest.approx(va, rel=1e-3, abs=1e-5, nan_ok=True), (ra["iteration"], key)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)
