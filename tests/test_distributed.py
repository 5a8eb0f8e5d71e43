"""Two CPU processes (gloo) compute the same advantages and update as one process over the same samples."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import launch

COMMON = ["configs/tiny/flow_grpo_sd3.yaml", "max_iterations=2", "log.progress_bar=false", "log.report=false",
          "eval.at_start=false", "sampling.eval_num_steps=2", "train.ema.enabled=false", "optim.lr=1e-2",
          "train.batch_size=64", "--overwrite"]


def train_records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]


def test_two_processes_match_one(repo_root, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    launch(["-m", "diffalign.cli", "train", *COMMON, f"output_dir={one}", "rollout.prompts_per_iteration=2"], repo_root)
    launch(["-m", "diffalign.cli", "train", *COMMON, f"output_dir={two}", "rollout.prompts_per_iteration=1"], repo_root, nproc=2)
    a, b = train_records(one), train_records(two)
    # same samples and rewards, hence the same advantages
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert [r["advantage_abs_mean"] for r in a] == [r["advantage_abs_mean"] for r in b]
    wa = load_file(str(one / "final" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(two / "final" / "pytorch_lora_weights.safetensors"))
    assert wa.keys() == wb.keys()
    moved = max(float(v.abs().max()) for v in wa.values())
    assert moved > 1e-3  # the update is real
    for k in wa:  # equal up to the order of floating-point sums across processes
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


FAST = ["log.progress_bar=false", "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2", "train.ema.enabled=false",
        "max_iterations=2", "eval.every=0", "checkpoint.every=0", "optim.lr=1e-2", "--overwrite"]
# (config, overrides for both, one process, two processes): the same global batch either way
OTHER_ALGORITHMS = {
    "branch_grpo": ("configs/tiny/branch_grpo_sd3.yaml", ["train.batch_size=64"],
                    ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "diffusion_nft": ("configs/tiny/diffusion_nft_sd3.yaml", ["train.batch_size=64"],
                      ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "spo": ("configs/tiny/spo_sd15.yaml", ["train.batch_size=64"], ["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"]),
    "diffusion_dpo": ("configs/shapes/diffusion_dpo.yaml",
                      ["model.id=tiny:shapes", "prompts.families=[single_object]", "reward.name=brightness", "reward.kwargs={}",
                       "algorithm.generate_images_per_prompt=2", "train.optimizer_steps_per_iteration=2"],
                      ["train.batch_size=4"], ["train.batch_size=2"]),
}
PER_PROCESS = ("seconds", "time/", "rollout_forwards", "pairs_local_kept")  # costs and local counts, not results


@pytest.mark.parametrize("name", list(OTHER_ALGORITHMS))
def test_other_algorithms_two_processes_match_one(repo_root, tmp_path, name):
    """Every recipe draws global noise, prompts and shuffles and normalises by global term counts:
    two processes log the same numbers and end at the same weights as one (up to summation order)."""
    config, both, one_proc, two_proc = OTHER_ALGORITHMS[name]
    base = ["-m", "diffalign.cli", "train", config, *FAST, *both]
    one, two = tmp_path / "one", tmp_path / "two"
    launch([*base, f"output_dir={one}", *one_proc], repo_root)
    launch([*base, f"output_dir={two}", *two_proc], repo_root, nproc=2)
    a, b = train_records(one), train_records(two)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            if isinstance(va, (int, float)) and not any(p in key for p in PER_PROCESS):
                assert rb[key] == pytest.approx(va, rel=1e-3, abs=1e-5, nan_ok=True), (ra["iteration"], key)
    wa = load_file(str(one / "final" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(two / "final" / "pytorch_lora_weights.safetensors"))
    assert max(float(v.abs().max()) for v in wa.values()) > 1e-2  # the update is real
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=3e-4)
