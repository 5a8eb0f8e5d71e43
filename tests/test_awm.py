"""AWM: the loss and weightings on hand-computed numbers, the stratified noise levels, one iteration."""

import json
import math

import pytest
import torch

from diffalign.algorithms.awm import awm_loss, matching_weight, scaled_advantages, stratified_levels
from diffalign.config_files import load_config
from diffalign.recipes import available
from diffalign.trainer import build_trainer
from diffalign.recipes.awm import AWMTrainer
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/awm.yaml"
C4 = 1e-10**0.25  # c^p of ghuber, p = 0.25


# ---- the loss, by hand ---------------------------------------------------------------------
# Two samples of two elements each.
# Sample 1: x0 = [0, 0], eps = [1, 1] -> target eps - x0 = [1, 1]; v = [1, 3] -> l = (0 + 4) / 2 = 2;
#   t = 0.5; A = 2.5 -> a = 2.5 / 5 = 0.5. ghuber: 0.5 / 0.25 * ((2 + c)^0.25 - c^0.25) = 2 (2^0.25 - c^0.25).
#   v_ref = [1, 1] -> KL (0 + 4) / 2 = 2; v_ema = [1, 2] -> EMA-KL 0.5.
# Sample 2: x0 = [1, -1], eps = 0 -> target [-1, 1] = v -> l = 0, w = 0; t = 1; A = -10 -> a = -1.
#   v_ref = v -> KL 0; v_ema = [0, 1] -> EMA-KL 0.5.


def _example():
    v = torch.tensor([[1.0, 3.0], [-1.0, 1.0]], requires_grad=True)
    x0 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    eps = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    t = torch.tensor([0.5, 1.0])
    adv = torch.tensor([2.5, -10.0])
    v_ref = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])
    v_ema = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    return v, x0, eps, t, adv, v_ref, v_ema


def test_weightings_hand_computed():
    ell, t = torch.tensor([2.0, 0.0]), torch.tensor([0.5, 1.0])
    torch.testing.assert_close(matching_weight(ell, t, "uniform"), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(matching_weight(ell, t, "t"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(matching_weight(ell, t, "t2"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(matching_weight(ell, t, "huber"), torch.tensor([0.5 * (math.sqrt(2) - 1e-5), 0.0]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(matching_weight(ell, t, "ghuber"), torch.tensor([2 * (2**0.25 - C4), 0.0]))
    torch.testing.assert_close(matching_weight(ell, t, "ghuber", ghuber_power=0.5), torch.tensor([math.sqrt(2) - 1e-5, 0.0]), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        matching_weight(ell, t, "cubic")
    torch.testing.assert_close(scaled_advantages(torch.tensor([2.5, -10.0, 0.0])), torch.tensor([0.5, -1.0, 0.0]))


def test_awm_loss_hand_computed():
    v, x0, eps, t, adv, v_ref, v_ema = _example()
    out = awm_loss(v, x0, eps, t, adv, v_ref=v_ref, v_ema=v_ema, kl_beta=0.1, ema_kl_beta=1.0)
    w1 = 2 * (2**0.25 - C4)
    torch.testing.assert_close(out.per_sample, torch.tensor([0.5 * w1 + 0.1 * 2 + 0.5, 0.5]))
    torch.testing.assert_close(out.policy_loss, torch.tensor(0.25 * w1))
    torch.testing.assert_close(out.matching_loss, torch.tensor(1.0))
    torch.testing.assert_close(out.kl, torch.tensor(1.0))
    torch.testing.assert_close(out.ema_kl, torch.tensor(0.5))
    with pytest.raises(ValueError, match="v_ref"):
        awm_loss(v, x0, eps, t, adv, kl_beta=0.1)
    with pytest.raises(ValueError, match="v_ema"):
        awm_loss(v, x0, eps, t, adv, ema_kl_beta=0.1)


def test_awm_gradient_is_the_advantage_weighted_matching_gradient():
    # uniform weighting, no KL: d(a l)/dv = a * 2 (v - target) / n; sample 1: 0.5 * [0, 2] = [0, 1];
    # sample 2: v = target -> 0. The loss is the mean over 2 samples: [[0, 0.5], [0, 0]].
    # (The reference's -a exp(-w + stopgrad(w)) has this very gradient.)
    v, x0, eps, t, adv, _, _ = _example()
    awm_loss(v, x0, eps, t, adv, weighting="uniform").loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.5], [0.0, 0.0]]))
    v2 = v.detach().clone().requires_grad_(True)
    w = matching_weight(((v2 - (eps - x0)) ** 2).mean(dim=1), t, "uniform")
    a = scaled_advantages(adv)
    (-a * torch.exp(-w + w.detach())).mean().backward()
    torch.testing.assert_close(v2.grad, v.grad)


def test_stratified_levels():
    # 14 steps, 6 strata, fraction 0.9: boundaries linspace(1, 12, 7) -> 1, 2, 4, 6, 8, 10, 12
    gen = torch.Generator().manual_seed(0)
    idx = stratified_levels(14, 6, fraction=0.9, n=200, generator=gen)
    lower, upper = torch.tensor([1, 2, 4, 6, 8, 10]), torch.tensor([2, 4, 6, 8, 10, 12])
    assert idx.shape == (200, 6) and bool(((idx >= lower) & (idx < upper)).all())
    assert set(idx[:, 1].tolist()) == {2, 3}  # both values of a two-wide stratum are drawn
    # "discrete" keeps sigma = 1 (index 0): boundaries 0, 2, ..., 12
    assert int(stratified_levels(14, 6, skip_first=False, n=200, generator=gen)[:, 0].min()) == 0
    with pytest.raises(ValueError, match="no noise levels"):
        stratified_levels(1, 2, fraction=0.9)


# ---- end to end ----------------------------------------------------------------------------


def test_awm_is_registered_and_its_configs_load(tmp_path):
    assert "awm" in available()
    for path in ("configs/tiny/awm.yaml", "configs/shapes/awm.yaml"):
        cfg = load_config(ROOT / path, [f"output_dir={tmp_path / 'x'}"])
        assert cfg.algorithm.name == "awm"
    assert cfg.prompts.balance_families and cfg.train.channels_last and cfg.train.mixed_precision == "auto"


def test_one_iteration_moves_the_weights(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", *FAST])
    tr = build_trainer(cfg)
    assert isinstance(tr, AWMTrainer)
    tr.setup()
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    assert rec["optimizer_steps"] == 1
    for key in ("loss", "policy_loss", "matching_loss", "kl", "ema_kl", "grad_norm", "ema_decay", "reward_mean"):
        assert key in rec and math.isfinite(rec[key]), key
    assert rec["ema_decay"] == pytest.approx(0.001)
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before))
    assert moved > 0
    # the EMA adapter followed by (1 - d) of the step
    ema_moved = sum(float((o.detach() - b).abs().sum()) for o, b in zip(tr.old_params, before))
    assert 0 < ema_moved < moved


def test_train_cli_writes_metrics(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "algorithm.kl_beta=0", "algorithm.ema_kl_beta=0", *FAST) == 0
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval": true' not in line][0]
    assert math.isfinite(rec["loss"]) and rec["optimizer_steps"] == 1
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'bad'}", "algorithm.weighting=cubic", *FAST) == 2
