"""DRaFT / ReFL: truncated gradients in closed form on a linear model, ReFL's one-step x0, the loss,
per-step checkpointing, the differentiable ShapesSoft reward, the refusal of a non-differentiable
reward, and one iteration of every mode on a tiny SD3."""

import json
import math

import numpy as np
import pytest
import torch

import reward_models
from diffalign.algorithms.drft import drft_loss, refl_rollout, refl_stop_candidates, refl_stop_steps, truncated_rollout
from diffalign.config_files import load_config
from diffalign.errors import ConfigError, RewardError
from diffalign.recipes import available
from diffalign.recipes.drft import DrftConfig, DrftTrainer
from diffalign.shapes.scenes import make_batch
from diffalign.trainer import build_trainer
from reward_models.shapes_soft import ShapesSoft, soft_terms, _spec
from tests.helpers.adapters import one_thread, sd3  # noqa: F401  (fixtures)
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/drft_sd3.yaml"
SCHEDULE = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1, 0.0], dtype=torch.float64)  # T = 5 steps; dt_i = t_{i+1} - t_i
T = len(SCHEDULE) - 1


def linear_ode(theta):
    """A linear denoiser v = theta x (theta a scalar or one parameter per step) and its Euler/ODE
    step x_{i+1} = x_i + dt_i v = (1 + dt_i theta_i) x_i."""

    def step(i, x):
        th = theta[i] if theta.ndim else theta
        return x + (SCHEDULE[i + 1] - SCHEDULE[i]) * th * x

    return step


# ---- truncated gradients, by hand ------------------------------------------------------------
# x_T = x_0 prod_i (1 + dt_i theta), reward r = c . x_T (linear). Through all steps
# dr/dtheta = r sum_i dt_i / (1 + dt_i theta); through the last K only, the earlier factors are
# constants: dr/dtheta = r sum_{i >= T-K} dt_i / (1 + dt_i theta).


@pytest.mark.parametrize("k", [1, 2, T])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_drft_k_gradient_has_the_closed_form(k, checkpointed):
    theta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    x0 = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    c = torch.tensor([0.3, 1.0, -2.0], dtype=torch.float64)
    x_T = truncated_rollout(linear_ode(theta), x0, T, k, checkpoint_steps=checkpointed)
    r = (c * x_T).sum()
    r.backward()
    dt = (SCHEDULE[1:] - SCHEDULE[:-1]).tolist()
    th = 0.7
    value = float((c * x0).sum()) * math.prod(1 + d * th for d in dt)
    expected = value * sum(d / (1 + d * th) for d in dt[T - k:])
    assert float(r.detach()) == pytest.approx(value, rel=1e-12)
    assert float(theta.grad) == pytest.approx(expected, rel=1e-10)


def test_drft_1_only_the_last_step_carries_gradient():
    theta = torch.full((T,), 0.4, dtype=torch.float64, requires_grad=True)  # one parameter per step
    grad_mode = []
    step = linear_ode(theta)

    def recording(i, x):
        grad_mode.append((i, torch.is_grad_enabled()))
        return step(i, x)

    x_T = truncated_rollout(recording, torch.ones(2, 3, dtype=torch.float64), T, 1)
    x_T.sum().backward()
    assert grad_mode == [(i, i == T - 1) for i in range(T)]
    assert torch.count_nonzero(theta.grad) == 1 and theta.grad[T - 1] != 0
    # the value is the full rollout's: truncation changes the gradient, not the sample
    with torch.no_grad():
        full = truncated_rollout(step, torch.ones(2, 3, dtype=torch.float64), T, T)
    torch.testing.assert_close(x_T.detach(), full)


def test_refl_predicts_x0_in_one_step_from_its_stop():
    # ReFL on v = theta x: x_s = x_0 prod_{i<s} (1 + dt_i theta) without grad, then
    # x0_hat = x_s - t_s theta x_s (Tweedie) with d x0_hat / d theta = -t_s x_s.
    theta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    x0 = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    stop = 3
    x0_hat = refl_rollout(linear_ode(theta), lambda i, x: x - SCHEDULE[i] * theta * x, x0, stop)
    x_s = x0 * math.prod(1 + float(SCHEDULE[i + 1] - SCHEDULE[i]) * 0.5 for i in range(stop))
    torch.testing.assert_close(x0_hat.detach(), x_s - float(SCHEDULE[stop]) * 0.5 * x_s)
    x0_hat.sum().backward()
    assert float(theta.grad) == pytest.approx(float(-SCHEDULE[stop] * x_s.sum()), rel=1e-12)


def test_refl_stop_range():
    assert refl_stop_candidates(10, 0.7, 0.9).tolist() == [7, 8, 9]
    assert refl_stop_candidates(4, 0.7, 0.9).tolist() == [3]
    assert refl_stop_candidates(10, 0.0, 0.0).tolist() == [0]
    with pytest.raises(ValueError, match="no step"):
        refl_stop_candidates(4, 0.3, 0.45)  # 0.25 and 0.5 fall outside
    draws = refl_stop_steps(10, 0.7, 0.9, 300, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {7, 8, 9}


def test_drft_loss_hand_computed():
    r = torch.tensor([0.5, 1.5, float("nan"), 1.0], requires_grad=True)
    out = drft_loss(r, scale=2.0, normalizer=4)
    assert float(out.loss.detach()) == pytest.approx(-2.0 * 3.0 / 4)  # the NaN is left out of the sum ...
    assert float(out.reward_mean) == pytest.approx(1.0)
    assert out.finite.tolist() == [True, True, False, True]
    out.loss.backward()
    torch.testing.assert_close(r.grad, torch.tensor([-0.5, -0.5, 0.0, -0.5]))  # ... and gets no gradient
    assert float(drft_loss(torch.tensor([1.0, 3.0])).loss) == pytest.approx(-2.0)  # default: the batch mean


def saved_activation_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``fn()`` runs (outside regions
    that a checkpoint recomputes)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def test_per_step_checkpointing_keeps_less_and_gives_the_same_gradient():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))

    def step(i, x):
        return x - 0.1 * net(x)

    x = torch.randn(8, 16)
    grads, sizes = [], []
    for checkpointed in (False, True):
        net.zero_grad()
        size, y = saved_activation_bytes(lambda: truncated_rollout(step, x, 6, 4, checkpoint_steps=checkpointed))
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        sizes.append(size)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert sizes[1] < sizes[0] / 4  # the 4 steps' activations are recomputed, not kept


# ---- the differentiable ShapesWorld reward ----------------------------------------------------


def test_shapes_soft_has_finite_difference_gradients():
    images = (torch.rand(2, 3, 6, 6, dtype=torch.float64) * 0.9 + 0.05).requires_grad_(True)
    specs = [_spec("a photo of a red circle and a blue triangle"), _spec("a photo of two squares")]
    assert torch.autograd.gradcheck(lambda im: soft_terms(im, specs), (images,), eps=1e-6, atol=1e-5)
    reward = ShapesSoft()
    assert reward_models.is_differentiable(reward) and reward_models.build("shapes_soft").differentiable
    out = reward(images.float().detach().requires_grad_(True), ["a photo of a red circle", "a photo of a square"], [{}, {}])
    assert out.shape == (2,) and out.requires_grad


def test_shapes_soft_prefers_clean_renders_of_the_prompt():
    prompts = ["a photo of a red circle and a blue triangle", "a photo of three squares", "a photo of a green square",
               "a photo of four circles"]
    clean = make_batch(prompts, np.random.default_rng(0))
    colour, mass = soft_terms(clean, [_spec(p) for p in prompts])
    # measured on these renders: colour 0.68-0.84 (anti-aliased rims are darker shades), mass 0.81-1.0
    assert (colour > 0.6).all() and (mass > 0.75).all()
    noise = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reward = ShapesSoft()
    assert (reward(noise, prompts) < reward(clean, prompts) - 0.4).all()
    assert (reward(torch.zeros_like(clean), prompts) < 0.1).all()  # an empty image
    wrong, _ = soft_terms(clean[:1], [_spec("a photo of a green circle and a yellow triangle")])
    assert float(wrong) < 0.01  # colours the prompt does not name earn nothing
    assert set(reward.last_info) == {"soft/color", "soft/mass"}
    with pytest.raises(RewardError, match="mass_weight"):
        ShapesSoft(mass_weight=-1)


def test_decode_with_grad_matches_decode_and_carries_gradient(sd3):
    from diffalign.adapters import load_adapter

    for adapter in (sd3, load_adapter("tiny:shapes", seed=0)):
        z = torch.randn(1, *adapter.latent_shape(32, 32)) * 0.5
        plain = adapter.decode(z)
        assert not plain.requires_grad
        zg = z.clone().requires_grad_(True)
        images = adapter.decode_with_grad(zg)
        torch.testing.assert_close(images.detach(), plain)
        images.sum().backward()
        assert zg.grad is not None and zg.grad.abs().sum() > 0


# ---- the recipe -------------------------------------------------------------------------------


def test_drft_config_keys_are_checked(tmp_path):
    assert "drft" in available()
    for path in (CONFIG, "configs/shapes/drft.yaml"):
        assert load_config(ROOT / path, [f"output_dir={tmp_path / 'x'}"]).algorithm.name == "drft"
    for override, key in (("algorithm.mode=reinforce", "algorithm.mode"), ("algorithm.grad_steps=0", "algorithm.grad_steps"),
                          ("algorithm.refl_range=[0.9,0.5]", "algorithm.refl_range"),
                          ("algorithm.reward_scale=0", "algorithm.reward_scale")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'x'}", override])


def test_a_non_differentiable_reward_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "reward.name=jpeg_compressibility", *FAST) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: config key 'reward.name': 'jpeg_compressibility' is not differentiable")
    assert not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'k'}", "algorithm.grad_steps=5", *FAST) == 2  # > num_steps


def test_one_iteration_of_each_mode_moves_the_weights(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", "train.ema.enabled=false", *FAST])
    tr = build_trainer(cfg)
    assert isinstance(tr, DrftTrainer)
    tr.setup()
    for it, (mode, stochastic) in enumerate([("drft", False), ("refl", False), ("drft_lv", True)]):
        tr.algo.mode, tr.algo.stochastic = mode, stochastic
        before = [p.detach().clone() for p in tr.trainable]
        rec = tr.iteration(it)
        assert rec["optimizer_steps"] == 1, mode
        for key in ("loss", "reward_mean", "grad_norm"):
            assert math.isfinite(rec[key]), (mode, key)
        assert rec["loss"] == pytest.approx(-rec["reward_mean"])
        assert rec["grad_norm"] > 0, mode
        moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before))
        assert moved > 0, mode


def test_reward_failures_are_retried_then_stop_with_a_checkpoint(tmp_path, capsys):
    """DRaFT calls the reward through the trainer's retries: one failed call (reward.max_failures=1)
    is made again and counted; a second stops the run with a checkpoint at the iteration's start."""
    from diffalign import runs
    from tests.helpers import rewards as helper_rewards

    torch.set_num_threads(1)
    reward = ["reward.name=tests.helpers.rewards:counting_reward", "reward.kwargs.differentiable=true",
              "reward.max_failures=1"]
    out = tmp_path / "retried"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", *FAST, *reward, "reward.kwargs.fail_calls=[1]") == 0
    assert helper_rewards.CALLS == [2, 2, 2, 2]  # two micro-batches of 2, the second one scored again; the evaluation
    [record] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]
    assert record["reward_failures"] == 1 and record["optimizer_steps"] == 1 and math.isfinite(record["reward_mean"])
    capsys.readouterr()

    stopped = tmp_path / "stopped"
    assert run_cli("train", CONFIG, f"output_dir={stopped}", "max_iterations=1", *FAST, *reward,
                   "reward.kwargs.fail_calls=[0,1]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: stopped: counting reward: call 1 fails") and "reward.max_failures=1" in err[-1]
    assert helper_rewards.CALLS == [2, 2]
    state = runs.load_checkpoint(runs.latest_checkpoint(stopped))
    assert state["iteration"] == 0 and state["stats"]["reward_failures"] == 2


def test_refl_default_range_is_imagereward_s_stops():
    """ImageReward's ReFL: 40 steps, the stop drawn from steps 30-39."""
    assert DrftConfig().refl_range == [0.75, 0.975]
    assert refl_stop_candidates(40, *DrftConfig().refl_range).tolist() == list(range(30, 40))
    assert refl_stop_candidates(10, *DrftConfig().refl_range).tolist() == [8, 9]


def test_train_cli_end_to_end(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", *FAST) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]
    assert len(records) == 1 and records[0]["optimizer_steps"] == 1 and math.isfinite(records[0]["reward_mean"])
    assert (out / "final").is_dir()
