"""Flow-DPPO (Flow-GRPO's algorithm.trust_region: kl_mask): the masked loss and its mask on
hand-computed numbers, the old step's mean recovered from the rollout, one iteration."""

import math

import pytest
import torch

from diffalign.algorithms.flow_grpo import gaussian_mean_kl, kl_mask_loss, ppo_clip_loss
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.trainer import build_trainer
from tests.helpers.tiny_run import FAST, ROOT, run_cli

# Five steps, old log-probabilities 0, threshold 1e-5:
#   0: A = +1, rho = e^0.1 > 1, D = 1e-3  -> outside and moving farther along A: masked
#   1: A = -1, rho = e^-0.1 < 1, D = 1e-3 -> masked
#   2: A = -1, rho = e^0.1 > 1, D = 1e-3  -> outside but corrective: kept, -A rho = e^0.1
#   3: A = +1, rho = e^-0.1, D = 1e-3     -> corrective: kept, -e^-0.1
#   4: A = +2, rho = e^0.2, D = 1e-9      -> inside the region: kept, -2 e^0.2
LOGP = [0.1, -0.1, 0.1, -0.1, 0.2]
ADV = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0])
D = torch.tensor([1e-3, 1e-3, 1e-3, 1e-3, 1e-9])
E = math.exp


def test_kl_mask_loss_hand_computed():
    logp = torch.tensor(LOGP, requires_grad=True)
    out = kl_mask_loss(logp, torch.zeros(5), ADV, D, threshold=1e-5, kl=torch.ones(5), beta=0.1)
    per_policy = torch.tensor([0.0, 0.0, E(0.1), -E(-0.1), -2 * E(0.2)])
    torch.testing.assert_close(out.per_sample, per_policy + 0.1)
    torch.testing.assert_close(out.policy_loss, per_policy.mean())
    torch.testing.assert_close(out.loss, (per_policy + 0.1).mean())
    assert float(out.clip_frac) == pytest.approx(0.4)  # the masked fraction
    torch.testing.assert_close(out.approx_kl, torch.tensor(0.5 * sum(x * x for x in LOGP) / 5))
    out.loss.backward()
    # d(-A rho)/d logp = -A rho on kept steps, 0 on masked ones; / 5 for the mean
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, E(0.1), -E(-0.1), -2 * E(0.2)]) / 5)


def test_kl_mask_differs_from_the_clip_where_it_should():
    # inside the region nothing is masked however far the ratio moved; the clip (0.05) stops step 4
    logp = torch.tensor(LOGP)
    inside = kl_mask_loss(logp, torch.zeros(5), ADV, torch.zeros(5), threshold=1e-5)
    assert float(inside.clip_frac) == 0.0
    torch.testing.assert_close(inside.per_sample, -ADV * torch.exp(logp))
    clipped = ppo_clip_loss(logp, torch.zeros(5), ADV, clip_range=0.05)
    assert float(clipped.per_sample[4]) == pytest.approx(-2 * 1.05)
    # an overflowed ratio that is masked gives 0, not nan
    huge = kl_mask_loss(torch.tensor([1e4]), torch.zeros(1), torch.ones(1), torch.ones(1), threshold=1e-5)
    assert float(huge.loss) == 0.0


def test_policy_kl_is_the_gaussian_kl():
    # mu - mu_old = [0.1, -0.3], std 0.5: mean(0.01, 0.09) / (2 x 0.25) = 0.1
    mu, old = torch.tensor([[0.1, -0.3]]), torch.zeros(1, 2)
    torch.testing.assert_close(gaussian_mean_kl(mu, old, torch.tensor(0.5)), torch.tensor([0.1]))


# ---- end to end ----------------------------------------------------------------------------

CONFIG = "configs/tiny/flow_grpo_sd3.yaml"


def test_one_iteration_with_the_kl_mask(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", "algorithm.trust_region=kl_mask",
                                      "algorithm.beta=0", "train.inner_epochs=2", "train.batch_size=4", *FAST])
    tr = build_trainer(cfg)
    tr.setup()
    seen = []
    original = tr.policy_kl

    def record(step, rows, steps, x_next):
        d = original(step, rows, steps, x_next)
        seen.append(d)
        return d

    tr.policy_kl = record
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    # before the first optimizer step the re-scored step is the rollout's: the old mean x' - std eps is exact
    assert float(seen[0].max()) < 1e-8
    assert max(float(d.max()) for d in seen) > 0  # later steps see the policy move
    assert rec["optimizer_steps"] == 2 and math.isfinite(rec["loss"]) and 0 <= rec["clip_frac"] <= 1 and "policy_kl" in rec
    assert sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before)) > 0


def test_bad_kl_mask_settings(tmp_path):
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'a'}", "algorithm.trust_region=box", *FAST) == 2
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'b'}", "algorithm.trust_region=kl_mask",
                   "algorithm.kl_mask_threshold=0", *FAST) == 2
    with pytest.raises(ConfigError, match="guard_ratio_norm"):
        load_config(ROOT / CONFIG, ["algorithm.trust_region=kl_mask", "algorithm.guard_ratio_norm=true"])
    with pytest.raises(ConfigError, match="noise_pool"):
        load_config(ROOT / CONFIG, ["algorithm.trust_region=kl_mask", "sampling.noise_pool=2"])
    with pytest.raises(ConfigError, match="algorithm.flow_grpo.trust_region"):  # Sol-RL's seeded stage 2 keeps no step noise
        load_config(ROOT / "configs/tiny/sol_rl_sd3.yaml", ["algorithm.optimizer=flow_grpo", "algorithm.flow_grpo.trust_region=kl_mask"])
