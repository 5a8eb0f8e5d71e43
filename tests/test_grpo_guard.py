"""GRPO-Guard: ratio normalisation, step weights and per-step diagnostics on hand-computed numbers,
then one Flow-GRPO iteration with every switch on (diagnostics in metrics.jsonl)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from diffalign.algorithms.grpo_guard import (
    RatioStats,
    analytic_norm_log_ratio,
    batch_norm_log_ratio,
    inverse_dt_weights,
    reduce_sq_diff,
)
from diffalign.config_files import load_config
from diffalign.recipes.flow_grpo import FlowGRPOConfig
from diffalign.errors import ConfigError
from diffalign.recipes._grpo_guard import StepGuard, make_guard
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/flow_grpo_guard.yaml"


# ---- the math, by hand ---------------------------------------------------------------------
# One latent element per sample, transition std s = 0.5 (log-density constants cancel in ratios).
# Sample 1: mu_old = 0, mu_theta = 0.2, eps = 1 -> x' = 0.5.
#   log p_theta(x') = -(0.3)^2 / (2 * 0.25) = -0.18; log p_old(x') = -(0.5)^2 / 0.5 = -0.5 -> l = 0.32
#   (= -eps d / s - d^2 / (2 s^2) with d = mu_old - mu_theta = -0.2: 0.4 - 0.08).
#   l_norm = s l + d^2 / (2 s) = 0.16 + 0.04 = 0.2 = -eps d; d l_norm / d mu_theta = eps = 1.
# Sample 2: mu_old = mu_theta = 1, eps = -2: l = 0, l_norm = 0, gradient eps = -2.


def test_analytic_norm_hand_computed():
    mu = torch.tensor([[0.2], [1.0]], requires_grad=True)
    mu_old = torch.tensor([[0.0], [1.0]])
    eps = torch.tensor([[1.0], [-2.0]])
    s = 0.5
    x_next = mu_old + s * eps
    logp = -((x_next - mu) ** 2).mean(dim=1) / (2 * s**2)
    logp_old = -((x_next - mu_old) ** 2).mean(dim=1) / (2 * s**2)
    log_ratio = logp - logp_old
    torch.testing.assert_close(log_ratio.detach(), torch.tensor([0.32, 0.0]))
    sq = reduce_sq_diff(mu, mu_old)
    torch.testing.assert_close(sq.detach(), torch.tensor([0.04, 0.0]))
    norm = analytic_norm_log_ratio(log_ratio, torch.full((2, 1), s), sq)
    torch.testing.assert_close(norm.detach(), torch.tensor([0.2, 0.0]))
    norm.sum().backward()
    torch.testing.assert_close(mu.grad, eps)  # the gradient no longer scales with 1/s
    # "sum" reduction: squares summed over elements
    torch.testing.assert_close(reduce_sq_diff(torch.ones(1, 3), torch.zeros(1, 3), "sum"), torch.tensor([3.0]))


def test_batch_norm_centres_per_step_and_scales():
    # steps 3, 3, 5; l = [0.32, 0, 0.5]; std = [0.5, 0.5, 0.2]: step 3's mean is 0.16
    # -> [0.5 * 0.16, 0.5 * -0.16, 0.2 * 0] = [0.08, -0.08, 0]
    log_ratio = torch.tensor([0.32, 0.0, 0.5], requires_grad=True)
    norm = batch_norm_log_ratio(log_ratio, torch.tensor([0.5, 0.5, 0.2]), torch.tensor([3, 3, 5]))
    torch.testing.assert_close(norm.detach(), torch.tensor([0.08, -0.08, 0.0]))
    norm.sum().backward()  # the centre is a constant: the gradient is the std
    torch.testing.assert_close(log_ratio.grad, torch.tensor([0.5, 0.5, 0.2]))


def test_inverse_dt_weights_hand_computed():
    # schedule 1, 0.75, 0.25, 0: |dt| = 0.25, 0.5, 0.25 -> 1/|dt| = 4, 2, 4
    ts = torch.tensor([1.0, 0.75, 0.25, 0.0])
    torch.testing.assert_close(inverse_dt_weights(ts, torch.tensor([0, 1])), torch.tensor([4 / 3, 2 / 3, 0.0]))
    torch.testing.assert_close(inverse_dt_weights(ts, torch.arange(3)), torch.tensor([1.2, 0.6, 1.2]))
    assert inverse_dt_weights(ts, torch.tensor([], dtype=torch.long)).abs().sum() == 0


def test_ratio_stats_per_step():
    stats = RatioStats(3)
    # step 0: ratios 1, 2 (mean 1.5, std 0.5); normalised 1, 1. Step 2: ratio 1; normalised 3.
    stats.add(torch.tensor([0, 0, 2]), torch.tensor([0.0, math.log(2.0), 0.0]), torch.tensor([0.0, 0.0, math.log(3.0)]))
    m = stats.metrics()
    assert m["guard/ratio_mean/step_00"] == pytest.approx(1.5) and m["guard/ratio_std/step_00"] == pytest.approx(0.5)
    assert m["guard/norm_ratio_mean/step_00"] == pytest.approx(1.0) and m["guard/norm_ratio_std/step_00"] == pytest.approx(0.0, abs=1e-9)
    assert m["guard/ratio_mean/step_02"] == pytest.approx(1.0) and m["guard/norm_ratio_mean/step_02"] == pytest.approx(3.0)
    assert not any("step_01" in k for k in m)  # no samples at step 1


def test_step_guard_feeds_the_clipped_loss():
    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1), device="cpu")
    ts = torch.tensor([1.0, 0.75, 0.25, 0.0])
    opts = FlowGRPOConfig(guard_ratio_norm=True, guard_step_reweight=True, guard_diagnostics=True)
    # the hand example above, both rows at step 1, sample rows 0 and 1 of the rollout
    noise = torch.zeros(2, 3, 1)
    noise[0, 1], noise[1, 1] = 1.0, -2.0
    guard = StepGuard(trainer, opts, ts, torch.arange(3), step_noise=noise)
    assert guard.mode == "analytic"
    mu = torch.tensor([[0.2], [1.0]])
    x_next = torch.tensor([[0.5], [0.0]])
    step = SimpleNamespace(log_prob=torch.tensor([0.32, 0.0]) - 1.0, mean=mu, std=torch.full((2, 1), 0.5))
    logp, old, adv = guard(step, torch.tensor([-1.0, -1.0]), torch.tensor([1.0, -1.0]), torch.tensor([1, 1]),
                           rows=torch.tensor([0, 1]), x_next=x_next)
    torch.testing.assert_close(logp - old, torch.tensor([0.2, 0.0]))
    torch.testing.assert_close(adv, torch.tensor([0.6, -0.6]))  # step 1's weight
    m = guard.metrics()
    assert m["guard/ratio_mean/step_01"] == pytest.approx((math.exp(0.32) + 1) / 2)
    assert m["guard/norm_ratio_mean/step_01"] == pytest.approx((math.exp(0.2) + 1) / 2)
    # without the rollout's noise "auto" falls back to the batch estimate; "analytic" is refused
    assert StepGuard(trainer, opts, ts, torch.arange(3)).mode == "batch"
    with pytest.raises(ConfigError, match="guard_norm_mode"):
        StepGuard(trainer, FlowGRPOConfig(guard_ratio_norm=True, guard_norm_mode="analytic"), ts, torch.arange(3))
    assert make_guard(trainer, FlowGRPOConfig(), ts, torch.arange(3)) is None  # all switches off: untouched


def test_bad_mode_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="guard_norm_mode"):
        load_config(ROOT / CONFIG, [f"output_dir={tmp_path}", "algorithm.guard_norm_mode=sometimes"])


# ---- end to end ----------------------------------------------------------------------------


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval": true' not in line]


def test_one_iteration_logs_per_step_ratio_diagnostics(tmp_path):
    out = tmp_path / "run"
    # one optimizer step: every trained step is on-policy, so the exact (analytic) normalised
    # ratio must be 1 — which also checks that the rollout's transition mean is recovered.
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "train.optimizer_steps_per_iteration=1", *FAST) == 0
    rec = _records(out)[0]
    assert rec["optimizer_steps"] == 1 and math.isfinite(rec["loss"])
    for i in range(5):  # 6 steps, train_timestep_fraction 0.99 -> the first 5 are trained
        for key in ("ratio_mean", "ratio_std", "norm_ratio_mean", "norm_ratio_std"):
            assert f"guard/{key}/step_{i:02d}" in rec, (key, i)
        assert rec[f"guard/ratio_mean/step_{i:02d}"] == pytest.approx(1.0, abs=1e-4)
        assert rec[f"guard/norm_ratio_mean/step_{i:02d}"] == pytest.approx(1.0, abs=1e-4)
    assert "guard/ratio_mean/step_05" not in rec


def test_sol_rl_flow_grpo_path_takes_the_guard_keys(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "configs/tiny/sol_rl_sd3.yaml", f"output_dir={out}", "max_iterations=1", "algorithm.optimizer=flow_grpo",
                   "algorithm.flow_grpo.guard_ratio_norm=true", "algorithm.flow_grpo.guard_step_reweight=true",
                   "algorithm.flow_grpo.guard_diagnostics=true", *FAST) == 0
    rec = _records(out)[0]
    keys = [k for k in rec if k.startswith("guard/norm_ratio_mean/")]
    assert keys and all(math.isfinite(rec[k]) for k in keys)


@pytest.mark.parametrize("config", ["configs/tiny/stepwise_flow_grpo_sd3.yaml", "configs/tiny/branch_grpo_sd3.yaml"])
def test_the_family_takes_the_guard_keys(tmp_path, config):
    # Stepwise-Flow-GRPO (and DRM Step-GRPO, through the same transition update) and BranchGRPO:
    # no rollout noise is kept, so "auto" normalises with the micro-batch estimate per step.
    out = tmp_path / "run"
    assert run_cli("train", config, f"output_dir={out}", "max_iterations=1", "algorithm.guard_ratio_norm=true",
                   "algorithm.guard_step_reweight=true", "algorithm.guard_diagnostics=true", *FAST) == 0
    rec = _records(out)[0]
    means = [k for k in rec if k.startswith("guard/norm_ratio_mean/step_")]
    assert means and all(math.isfinite(rec[k]) for k in means)
    assert all(rec[k.replace("norm_ratio", "ratio")] == pytest.approx(1.0, abs=1e-3) for k in means if rec["optimizer_steps"] == 1)
