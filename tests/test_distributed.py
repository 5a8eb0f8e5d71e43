"""Two CPU processes (gloo) compute the same advantages and update as one process over the same samples."""

import json

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
