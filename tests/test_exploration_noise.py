"""The exploration-noise switches of group rollouts on a tiny model: rollout.shared_noise (one
initial noise per group) and sampling.noise_pool (Flow-GRPO SDE noise on pixel blocks; the kernel
math is tested in test_schedulers.py)."""

import json

import pytest
import torch

from diffalign.config_files import load_config


@pytest.mark.parametrize("shared", [False, True])
def test_group_plan_shares_initial_noise_within_groups_when_asked(repo_root, tmp_path, shared):
    """rollout.shared_noise: every image of a group starts from its group's noise, the groups'
    noises differ, and the per-step SDE noise stays independent per image."""
    from diffalign.trainer import build_trainer

    cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [
        f"output_dir={tmp_path / 'run'}", "model.id=tiny:shapes", "log.progress_bar=false", "log.report=false",
        "rollout.prompts_per_iteration=3", "rollout.group_size=4", f"rollout.shared_noise={str(shared).lower()}"])
    trainer = build_trainer(cfg, overwrite=True)
    trainer.setup()
    plan = trainer.plan_group_rollout(0)
    noise = plan.noise.flatten(1)
    assert noise.shape[0] == 12
    same_in_group = [torch.equal(noise[i], noise[i - 1]) for i in range(1, 12) if i % 4]
    assert all(same_in_group) if shared else not any(same_in_group)
    assert not any(torch.equal(noise[g * 4], noise[h * 4]) for g in range(3) for h in range(g))
    steps = plan.step_noise.flatten(2)
    assert not any(torch.equal(steps[i], steps[i - 1]) for i in range(1, 12))


def test_flow_grpo_with_coarse_noise_is_on_policy_and_learns(repo_root, tmp_path):
    """sampling.noise_pool: rollouts explore on 4x4 block-constant noise; the update re-scores them
    with ratio exactly 1 before the first step, and gradients reach the weights (KL term included)."""
    from diffalign.trainer import build_trainer

    cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [
        f"output_dir={tmp_path / 'run'}", "model.id=tiny:shapes", "max_iterations=1", "log.progress_bar=false",
        "log.report=false", "eval.at_start=false", "eval.every=0", "rollout.prompts_per_iteration=2",
        "rollout.group_size=4", "rollout.sample_batch_size=8", "train.batch_size=8", "sampling.noise_pool=4",
        "train.self_check_tolerance=0", "reward.name=brightness", "reward.kwargs={}", "algorithm.beta=0.01",
        "eval.images_per_family=1", "eval.probe=false", "sampling.eval_num_steps=2"])  # a token final evaluation
    trainer = build_trainer(cfg, overwrite=True)
    trainer.train()
    assert trainer.kernel.noise_pool == 4
    assert trainer.self_check_log_ratio == 0
    record = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "grad_norm" in r][0]
    assert record["grad_norm"] > 0 and record["optimizer_steps"] >= 1 and record["kl"] >= 0


def test_coarse_noise_config_errors(repo_root, tmp_path):
    from diffalign.errors import ConfigError
    from diffalign.trainer import build_trainer

    base = [f"output_dir={tmp_path / 'run'}", "model.id=tiny:shapes", "sampling.noise_pool=4"]
    with pytest.raises(ConfigError, match="sampling.noise_pool"):
        load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [*base, "sampling.kernel=cps"])
    with pytest.raises(ConfigError, match="sampling.noise_pool"):
        build_trainer(load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [*base, "algorithm.guard_ratio_norm=true"]))
