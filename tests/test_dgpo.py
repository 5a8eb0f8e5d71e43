"""DGPO: the group objective and its surrogate on hand-computed numbers, the surrogate's gradient
against the paper's objective, the noise levels, one iteration, resume and bad values."""

import math

import pytest
import torch
import torch.nn.functional as F

from diffalign.algorithms.dgpo import dgpo_loss, group_logits, group_objective, group_weights, matching_loss, train_levels
from diffalign.config_files import load_config
from diffalign.recipes import available, trainer_class
from diffalign.recipes.dgpo import DGPOTrainer
from tests.helpers.tiny_run import FAST, ROOT, run_cli, train_records

CONFIG = "configs/tiny/dgpo_sd3.yaml"


# ---- the loss, by hand ---------------------------------------------------------------------
# One group of G = 2 samples of two elements, x0 = 0 and eps = 1 for both: target eps - x0 = [1, 1].
#   sample 1: v_theta = [1, 3] -> l_theta = (0 + 4) / 2 = 2;  v_ref = [1, 1] -> l_ref = 0;    delta = 2;    A = +1
#   sample 2: v_theta = [1, 1] -> l_theta = 0;               v_ref = [2, 1] -> l_ref = 0.5;  delta = -0.5; A = -1
# beta = 1: s = 1 / 2 (1 x 2 + (-1) x (-0.5)) = 1.25; objective softplus(1.25); weight sigmoid(1.25).
# Surrogate w A l_theta = [2 sigmoid(1.25), 0]; KL mean((v_theta - v_ref)^2) = [2, 0.5].


def _example():
    v = torch.tensor([[1.0, 3.0], [1.0, 1.0]], requires_grad=True)
    x0, eps = torch.zeros(2, 2), torch.ones(2, 2)
    v_ref = torch.tensor([[1.0, 1.0], [2.0, 1.0]])
    return v, x0, eps, v_ref, torch.tensor([1.0, -1.0]), torch.tensor([0, 0])


def test_group_objective_and_weights_hand_computed():
    v, x0, eps, v_ref, adv, groups = _example()
    l_theta, l_ref = matching_loss(v, x0, eps), matching_loss(v_ref, x0, eps)
    torch.testing.assert_close(l_theta, torch.tensor([2.0, 0.0]), check_dtype=False)
    torch.testing.assert_close(l_ref, torch.tensor([0.0, 0.5]))
    s = group_logits(l_theta - l_ref, adv, groups, 1, beta=1.0, group_size=2)
    torch.testing.assert_close(s, torch.tensor([1.25]))
    torch.testing.assert_close(group_objective(l_theta, l_ref, adv, groups, 1, beta=1.0, group_size=2),
                               torch.tensor([math.log1p(math.exp(1.25))]))
    w = group_weights(l_theta - l_ref, adv, groups, 1, beta=1.0, group_size=2)
    torch.testing.assert_close(w, torch.full((2,), 1 / (1 + math.exp(-1.25))))
    assert not w.requires_grad
    # two groups: each sample gets its own group's weight; beta scales the logit
    w2 = group_weights(torch.tensor([2.0, -0.5, 1.0, 1.0]), torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([0, 0, 1, 1]), 2,
                       beta=10.0, group_size=2)
    torch.testing.assert_close(w2, torch.tensor([torch.sigmoid(torch.tensor(12.5))] * 2 + [0.5, 0.5]))


def test_dgpo_loss_hand_computed():
    v, x0, eps, v_ref, adv, groups = _example()
    w = torch.full((2,), 1 / (1 + math.exp(-1.25)))
    out = dgpo_loss(v, x0, eps, adv, w, v_ref=v_ref, kl_beta=0.1)
    sig = 1 / (1 + math.exp(-1.25))
    torch.testing.assert_close(out.per_sample, torch.tensor([2 * sig + 0.1 * 2, 0.1 * 0.5]))
    torch.testing.assert_close(out.policy_loss, torch.tensor(sig))
    torch.testing.assert_close(out.matching_loss, torch.tensor(1.0))
    torch.testing.assert_close(out.kl, torch.tensor(1.25))
    with pytest.raises(ValueError, match="v_ref"):
        dgpo_loss(v, x0, eps, adv, w, kl_beta=0.1)


def test_surrogate_gradient_is_the_objective_gradient_times_g_over_beta():
    # three groups of three, random numbers: d sum(surrogate) = G / beta x d sum_g softplus(s_g)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(9, 4, generator=gen, requires_grad=True)
    x0, eps, v_ref = (torch.randn(9, 4, generator=gen) for _ in range(3))
    adv = torch.randn(9, generator=gen)
    groups = torch.arange(9) // 3
    beta = 7.0
    l_ref = matching_loss(v_ref, x0, eps)
    group_objective(matching_loss(v, x0, eps), l_ref, adv, groups, 3, beta=beta, group_size=3).sum().backward()
    expected = v.grad * 3 / beta
    v2 = v.detach().clone().requires_grad_(True)
    w = group_weights(matching_loss(v2, x0, eps) - l_ref, adv, groups, 3, beta=beta, group_size=3)
    dgpo_loss(v2, x0, eps, adv, w).per_sample.sum().backward()
    torch.testing.assert_close(v2.grad, expected)
    # and the objective is -log sigmoid(R(G+) - R(G-)) with R(G) = -beta / G sum |A| (l_theta - l_ref)
    l = matching_loss(v.detach(), x0, eps)
    for g in range(3):
        m = groups == g
        a, d = adv[m], (l - l_ref)[m]
        r_pos = -beta / 3 * (a.clamp(min=0) * d).sum()
        r_neg = -beta / 3 * ((-a).clamp(min=0) * d).sum()
        torch.testing.assert_close(group_objective(l, l_ref, adv, groups, 3, beta=beta, group_size=3)[g], -F.logsigmoid(r_pos - r_neg))


def test_train_levels():
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([train_levels(6, 4, generator=gen) for _ in range(200)])
    assert draws.min() == 0 and draws.max() == 6
    assert all(len(set(row.tolist())) == 4 for row in draws)  # distinct levels
    with pytest.raises(ValueError, match="distinct"):
        train_levels(2, 4)


# ---- end to end ----------------------------------------------------------------------------


def test_dgpo_is_registered_and_its_configs_load(tmp_path):
    assert "dgpo" in available()
    for path in ("configs/tiny/dgpo_sd3.yaml", "configs/shapes/dgpo.yaml", "configs/sd3/dgpo_pickscore.yaml"):
        cfg = load_config(ROOT / path, [f"output_dir={tmp_path / 'x'}"])
        assert cfg.algorithm.name == "dgpo"
    assert cfg.algorithm.dpo_beta == 10.0 and cfg.algorithm.kl_beta == 0.001 and cfg.rollout.group_size == 24
    assert trainer_class("dgpo") is DGPOTrainer


def test_resume_matches_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    common = ["max_iterations=2", "checkpoint.every=1", "train.ema.every=1", "eval.every=0", *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli("train", CONFIG, f"output_dir={full}", *common) == 0
    assert run_cli("train", CONFIG, f"output_dir={part}", *common, "max_iterations=1") == 0
    assert run_cli("resume", str(part), "max_iterations=2") == 0
    a = load_file(str(full / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(part / "final" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = train_records(full), train_records(part)
    assert [r["iteration"] for r in rb] == [0, 1]
    for key in ("reward_mean", "loss"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    for rec in ra:  # each iteration trained: one optimizer step, finite statistics, group weights in (0, 1)
        assert rec["optimizer_steps"] == 1 and 0 < rec["group_weight"] < 1
        for key in ("loss", "policy_loss", "matching_loss", "kl", "grad_norm"):
            assert math.isfinite(rec[key]), key
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)  # the zero-initialised B moved


@pytest.mark.parametrize("override, key", [("algorithm.trunc_steps=4", "algorithm.trunc_steps"),
                                           ("algorithm.train_timesteps=4", "algorithm.trunc_steps"),
                                           ("algorithm.dpo_beta=0", "algorithm.dpo_beta")])
def test_bad_value_exits_2_with_one_line_naming_the_key(tmp_path, capsys, override, key):
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'bad'}", override, *FAST) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and f"config key '{key}'" in err[0], err
