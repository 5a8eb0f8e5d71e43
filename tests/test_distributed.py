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

from tests.helpers.compare import FLOW_GRPO, OTHER_ALGORITHMS, REL, SHORT_RUN, assert_same_update, weights
from tests.helpers.launch import launch, launch_nodes, start_run
from tests.helpers.tiny_run import train_records

# SGD steps are lr x gradient and the policy gradients of the tiny models are small (~1e-4 for
# Flow-GRPO): each learning rate in tests/helpers/compare.py's FLOW_GRPO and OTHER_ALGORITHMS moves
# the weights by about 1e-2 in two iterations.


def test_two_processes_match_one(repo_root, tmp_path, flow_grpo_reference):
    (start, one), two = flow_grpo_reference, tmp_path / "two"
    launch(["-m", "diffalign.cli", "train", *FLOW_GRPO, f"output_dir={two}", "rollout.prompts_per_iteration=1"], repo_root, nproc=2)
    a, b = train_records(one), train_records(two)
    # same samples and rewards, hence the same advantages (up to rounding from the second iteration)
    for key in ("reward_mean", "advantage_abs_mean"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-3)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


def test_two_nodes_match_one_process(repo_root, tmp_path, flow_grpo_reference):
    """Two nodes on loopback: one accelerate launcher per node with the shipped
    configs/accelerate/multi_node_ddp.yaml (--num_machines 2, --machine_rank 0 and 1, rendezvous at
    127.0.0.1), one gloo process each, train the same update as one process."""
    (start, one), two = flow_grpo_reference, tmp_path / "nodes"
    outputs = launch_nodes("configs/accelerate/multi_node_ddp.yaml",
                           ["-m", "diffalign.cli", "train", *FLOW_GRPO, f"output_dir={two}", "rollout.prompts_per_iteration=1"],
                           repo_root, tmp_path / "logs", timeout=240)
    # the main process is node 0's and trains in a world of both nodes' processes
    assert "processes 2," in outputs[0] and "diffalign: flow_grpo" not in outputs[1]
    a, b = train_records(one), train_records(two)
    assert [r["reward_mean"] for r in b] == pytest.approx([r["reward_mean"] for r in a], rel=1e-3)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


def test_a_lost_sample_fails_the_comparison(repo_root, tmp_path, flow_grpo_reference):
    """The comparison catches a sharding defect: two processes where the second leaves one of its
    samples out of the update (tests/drop_sample_worker.py) do not match one process."""
    (start, one), two = flow_grpo_reference, tmp_path / "two"
    launch(["tests/drop_sample_worker.py", *FLOW_GRPO, f"output_dir={two}", "rollout.prompts_per_iteration=1"], repo_root, nproc=2)
    with pytest.raises(AssertionError, match="apart"):
        assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


PER_PROCESS = ("seconds", "time/", "rollout_forwards", "pairs_local_kept", "trained_terms")  # costs and local counts, not results


@pytest.mark.parametrize("name", list(OTHER_ALGORITHMS))
def test_other_algorithms_two_processes_match_one(repo_root, tmp_path, shared_run, name):
    """Every recipe draws global noise, prompts and shuffles and normalises by global term counts:
    two processes log the same numbers and end at the same weights as one (up to summation order)."""
    config, both, one_proc, two_proc = OTHER_ALGORITHMS[name]
    base = ["-m", "diffalign.cli", "train", config, *SHORT_RUN, *both]
    start, one = tmp_path / "start", tmp_path / "one"
    start_run([*base, *one_proc], start)
    launch([*base, f"output_dir={one}", *one_proc], repo_root)
    two, _ = shared_run([*base, *two_proc], nproc=2)  # tests/test_fsdp.py compares FSDP with the same SPO and DPO runs
    a, b = train_records(one), train_records(two)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            if isinstance(va, (int, float)) and not any(p in key for p in PER_PROCESS):
                assert rb[key] == pytest.approx(va, rel=1e-3, abs=1e-5, nan_ok=True), (ra["iteration"], key)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)
