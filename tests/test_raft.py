"""RAFT: the selection and the loss on hand-computed numbers, the noise levels, the pretraining-loss
weight of v-prediction models, one iteration end to end, resume, and a bad value."""

import math

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.algorithms.raft import keep_count, raft_loss, sample_noise_levels, select_kept, shift_noise_levels
from diffalign.config_files import load_config
from diffalign.forward_process import add_noise, denoising_target, pretraining_loss_weight, scheduler_shift
from diffalign.recipes import available
from diffalign.recipes import raft as raft_recipe
from diffalign.recipes.raft import RaftTrainer
from diffalign.trainer import build_trainer
from tests.helpers.compare import assert_resumed_equals_uninterrupted
from tests.helpers.tiny_run import FAST, ROOT, run_cli, train_records

CONFIG = "configs/tiny/raft_sd3.yaml"
NAN, INF = float("nan"), float("inf")

# ---- the selection, by hand ----------------------------------------------------------------
# Two prompt groups of 4:
#   group 0: i0 0.1, i1 0.5, i2 0.5, i3 NaN   -> best first: i1, i2 (tie: the lower index), i0; NaN last
#   group 1: i4 0.9, i5 0.2, i6 +inf, i7 0.3  -> i4, i7, i5; +inf is non-finite: last, never kept
# Over the whole batch: i4 0.9, i1, i2, i7 0.3, i5 0.2, i0 0.1, then i3, i6 (non-finite, in index order).
REWARDS = torch.tensor([0.1, 0.5, 0.5, NAN, 0.9, 0.2, INF, 0.3])


def kept(sel) -> list[int]:
    return torch.nonzero(sel.keep).flatten().tolist()


def test_selection_per_group_hand_computed():
    sel = select_kept(REWARDS, 4, keep_top=1)
    assert kept(sel) == [1, 4]
    assert sel.rank.tolist() == [2, 0, 1, 3, 0, 2, 3, 1]
    assert (sel.nonfinite, sel.below_threshold, sel.empty_groups, sel.kept) == (2, 0, 0, 2)
    assert kept(select_kept(REWARDS, 4, keep_top=2)) == [1, 2, 4, 7]
    assert kept(select_kept(REWARDS, 4, keep_top=3)) == [0, 1, 2, 4, 5, 7]
    # all 4 asked for: every finite reward, never the NaN or the +inf
    assert kept(select_kept(REWARDS, 4, keep_top=4)) == [0, 1, 2, 4, 5, 7]
    # keep_fraction 0.5 of 4 -> 2, the same as keep_top 2 (and overrides keep_top)
    assert kept(select_kept(REWARDS, 4, keep_top=1, keep_fraction=0.5)) == [1, 2, 4, 7]


def test_selection_threshold_and_ties():
    # top 2 of each group, then reward >= 0.4: i7 (0.3) was in group 1's top 2 and is dropped
    sel = select_kept(REWARDS, 4, keep_top=2, min_reward=0.4)
    assert kept(sel) == [1, 2, 4] and sel.below_threshold == 1 and sel.empty_groups == 0
    # nothing reaches 0.95: both groups empty, both best images counted as dropped by the threshold
    sel = select_kept(REWARDS, 4, keep_top=1, min_reward=0.95)
    assert kept(sel) == [] and sel.below_threshold == 2 and sel.empty_groups == 2
    # all equal: the lower indices win, the same on every call
    assert kept(select_kept(torch.ones(8), 4, keep_top=2)) == [0, 1, 4, 5]


def test_selection_over_the_batch():
    sel = select_kept(REWARDS, 4, keep_top=1, ranking="batch")  # 1 per group x 2 groups, best over all 8
    assert kept(sel) == [1, 4] and sel.rank.tolist() == [5, 1, 2, 6, 0, 4, 7, 3]
    assert kept(select_kept(REWARDS, 4, keep_top=2, ranking="batch")) == [1, 2, 4, 7]
    # both kept images may come from one group: group 0 is then empty
    batch = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.9, 0.8, 0.7, 0.6])
    sel = select_kept(batch, 4, keep_top=1, ranking="batch")
    assert kept(sel) == [4, 5] and sel.empty_groups == 1
    assert kept(select_kept(batch, 4, keep_fraction=0.25, ranking="batch")) == [4, 5]  # ceil(0.25 x 8) = 2
    with pytest.raises(ValueError, match="groups of 3"):
        select_kept(batch, 3)
    with pytest.raises(ValueError, match="ranking"):
        select_kept(batch, 4, ranking="global")


def test_keep_count():
    assert keep_count(8, keep_top=1, keep_fraction=0.25) == 2  # 0.25 x 8 is exactly 2
    assert keep_count(8, keep_top=1, keep_fraction=0.3) == 3  # ceil(2.4)
    assert keep_count(8, keep_top=5, keep_fraction=0.01) == 1  # at least one
    assert keep_count(4, keep_top=9, keep_fraction=0.0) == 4  # never more than the pool


# ---- the loss, by hand ---------------------------------------------------------------------
# prediction [[1, 3], [0, 0]], target [[1, 1], [1, -1]]: per-sample mean squared errors
# (0 + 4) / 2 = 2 and (1 + 1) / 2 = 1; loss 1.5. Weights [0.5, 4]: [1, 4], loss 2.5 (mse still 1.5).
# Gradient of the unweighted mean over 2 samples x 2 elements: (p - target) / 2 = [[0, 1], [-0.5, 0.5]].


def test_raft_loss_hand_computed():
    pred = torch.tensor([[1.0, 3.0], [0.0, 0.0]], requires_grad=True)
    target = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    out = raft_loss(pred, target)
    torch.testing.assert_close(out.per_sample, torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(out.loss, torch.tensor(1.5))
    out.loss.backward()
    torch.testing.assert_close(pred.grad, torch.tensor([[0.0, 1.0], [-0.5, 0.5]]))
    weighted = raft_loss(pred, target, torch.tensor([0.5, 4.0]))
    torch.testing.assert_close(weighted.per_sample, torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(weighted.loss, torch.tensor(2.5))
    torch.testing.assert_close(weighted.mse, torch.tensor(1.5))


def test_flow_matching_loss_is_the_velocity_error():
    # x0 = [0.2, -0.4], eps = [1, 0], t = 0.25: x_t = 0.75 x0 + 0.25 eps = [0.4, -0.3]; v = eps - x0 = [0.8, 0.4].
    # A prediction of [0.8, 0.4] scores 0; [1.8, 0.4] scores (1 + 0) / 2.
    adapter = load_adapter("tiny:shapes")
    x0, eps, t = torch.tensor([[[0.2, -0.4]]]), torch.tensor([[[1.0, 0.0]]]), torch.tensor([0.25])
    torch.testing.assert_close(add_noise(adapter, x0, eps, t), torch.tensor([[[0.4, -0.3]]]))
    target = denoising_target(adapter, x0, eps)
    assert float(raft_loss(torch.tensor([[[0.8, 0.4]]]), target).loss) == pytest.approx(0.0, abs=1e-7)
    assert float(raft_loss(torch.tensor([[[1.8, 0.4]]]), target).loss) == pytest.approx(0.5)
    assert pretraining_loss_weight(adapter, t) is None and scheduler_shift(adapter) == 2.0  # the shapes pretraining shift


def test_v_prediction_weight_gives_the_models_own_loss():
    """A v-prediction UNet's adapter predicts epsilon; weighted by 1 / abar_t its squared error is
    the v error: ``|eps_hat - eps|^2 / abar = |v_hat - v|^2``."""
    a = load_adapter("tiny:sd15")
    assert pretraining_loss_weight(a, torch.tensor([10.0])) is None and scheduler_shift(a) == 1.0
    a.model_prediction_type = "v_prediction"
    gen = torch.Generator().manual_seed(0)
    x0, eps, v_hat = (torch.randn(2, 4, 8, 8, generator=gen) for _ in range(3))
    t = torch.tensor([900.0, 100.0])
    x_t = add_noise(a, x0, eps, t)
    abar = a.alpha_cumprod_at(t).reshape(-1, 1, 1, 1)
    v = abar.sqrt() * eps - (1 - abar).sqrt() * x0  # the v-prediction target
    eps_hat = a._as_epsilon(v_hat, x_t, t)  # what the adapter's predict returns for a v output
    weighted = raft_loss(eps_hat, denoising_target(a, x0, eps), pretraining_loss_weight(a, t))
    torch.testing.assert_close(weighted.per_sample, ((v_hat - v) ** 2).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-5)


def test_noise_levels():
    u = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(shift_noise_levels(u, 2.0), torch.tensor([0.0, 2 / 3, 1.0]))
    torch.testing.assert_close(shift_noise_levels(u, 3.0), torch.tensor([0.0, 0.75, 1.0]))
    gen = torch.Generator().manual_seed(0)
    tau = sample_noise_levels(20000, shift=2.0, generator=gen)
    assert float(tau.min()) >= 0 and float(tau.max()) <= 1
    assert float(tau.mean()) == pytest.approx(2 * (1 - math.log(2)), abs=0.01)  # E[2u / (1 + u)], u ~ U(0, 1)
    tau = sample_noise_levels(20000, distribution="logit_normal", generator=gen)
    assert float(tau.median()) == pytest.approx(0.5, abs=0.02) and float((tau < 0.2).float().mean()) == pytest.approx(0.0828, abs=0.01)  # Phi(logit(0.2))
    with pytest.raises(ValueError, match="distribution"):
        sample_noise_levels(2, distribution="beta")


# ---- end to end ----------------------------------------------------------------------------


def test_raft_is_registered_and_its_configs_load(tmp_path):
    assert "raft" in available()
    shapes = load_config(ROOT / "configs/shapes/raft.yaml", [f"output_dir={tmp_path / 'x'}"])
    grpo = load_config(ROOT / "configs/shapes/flow_grpo.yaml", [f"output_dir={tmp_path / 'y'}"])
    # the Flow-GRPO recipe's budget, prompts, reward and evaluation
    for section in ("rollout", "reward", "prompts", "eval"):
        assert getattr(shapes, section) == getattr(grpo, section), section
    assert shapes.max_iterations == grpo.max_iterations and shapes.sampling.num_steps == grpo.sampling.num_steps
    assert not shapes.lora.enabled and shapes.sampling.noise_level == 0.0
    assert shapes.derived()["micro_batches_per_iteration"] == 4  # 16 kept images (one micro-batch) x 4 draws


def test_one_iteration_trains_exactly_the_kept_images(tmp_path, monkeypatch):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", *FAST])
    tr = build_trainer(cfg)
    assert isinstance(tr, RaftTrainer)
    tr.setup()
    rollouts, noised = [], []
    rollout = tr.rollout

    def recording_rollout(iteration):
        rollouts.append(rollout(iteration))
        return rollouts[-1]

    def recording_add_noise(adapter, x0, noise, t):
        noised.append(x0.detach().cpu().clone())
        return add_noise(adapter, x0, noise, t)

    monkeypatch.setattr(tr, "rollout", recording_rollout)
    monkeypatch.setattr(raft_recipe, "add_noise", recording_add_noise)
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    (ro,) = rollouts
    sel = select_kept(ro.rewards, 4, keep_top=1)  # 2 prompts x 4 images, the best of each
    assert sel.kept == 2 and rec["kept_images"] == 2 and rec["kept_frac"] == pytest.approx(0.25)
    assert rec["reward_kept_mean"] == pytest.approx(float(ro.rewards[sel.keep].mean()))
    assert rec["reward_mean"] == pytest.approx(float(ro.rewards.mean()))
    assert rec["reward_kept_mean"] >= rec["reward_mean"]
    # trained: each kept image's final latent, noise_draws = 2 times; no other image
    trained = torch.cat(noised)
    assert trained.shape[0] == 2 * 2
    for row in ro.x0[sel.keep]:
        assert sum(bool(torch.equal(row, x)) for x in trained) == 2
    assert rec["optimizer_steps"] == 1 and math.isfinite(rec["loss"]) and rec["loss"] == pytest.approx(rec["mse"])
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before))
    assert moved > 0


def test_one_iteration_on_an_epsilon_model(tmp_path, monkeypatch):
    """tiny SD1.5: DDIM (eta 0) rollouts, x_t = sqrt(abar) x0 + sqrt(1 - abar) eps at uniform DDPM
    timesteps, the epsilon target."""
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", "max_iterations=1", "model.id=tiny:sd15",
                                      "sampling.kernel=ddim", "lora.rank=4", "lora.alpha=4", *FAST])
    tr = build_trainer(cfg)
    tr.setup()
    times = []

    def recording_add_noise(adapter, x0, noise, t):
        times.append(t.cpu())
        return add_noise(adapter, x0, noise, t)

    monkeypatch.setattr(raft_recipe, "add_noise", recording_add_noise)
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    t = torch.cat(times)
    assert len(t) == 4 and bool((t == t.round()).all()) and 0 <= float(t.min()) and float(t.max()) <= 999  # DDPM indices
    assert rec["kept_images"] == 2 and rec["optimizer_steps"] == 1 and math.isfinite(rec["loss"])
    assert sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before)) > 0


def test_resume_matches_uninterrupted_run(tmp_path):
    common = ["max_iterations=2", "checkpoint.every=1", "train.ema.every=1", *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli("train", CONFIG, f"output_dir={full}", *common) == 0
    assert run_cli("train", CONFIG, f"output_dir={part}", *common, "max_iterations=1") == 0
    assert run_cli("resume", str(part), "max_iterations=2") == 0
    assert_resumed_equals_uninterrupted(full, part, ("reward_mean", "reward_kept_mean", "loss"))


@pytest.mark.parametrize("override, key", [("algorithm.keep_fraction=1.5", "algorithm.keep_fraction"),
                                           ("algorithm.keep_top=5", "algorithm.keep_top"),
                                           ("algorithm.timestep_shift=0", "algorithm.timestep_shift")])
def test_bad_value_exits_2_with_one_line_naming_the_key(tmp_path, capsys, override, key):
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'bad'}", override, *FAST) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and f"config key '{key}'" in err[0], err
    assert not (tmp_path / "bad").exists()


def test_train_cli_with_a_pairwise_reward_and_schedule_noise_levels(tmp_path):
    """A reward that compares the images of a prompt group (win rates) ranks RAFT's groups too."""
    out = tmp_path / "run"
    judge = "reward.kwargs={judge: bradley_terry, judge_kwargs: {reward: brightness, temperature: 0.01}}"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "algorithm.keep_fraction=0.5",
                   "algorithm.timestep_distribution=schedule", "reward.name=pairwise", judge, *FAST) == 0
    (rec,) = train_records(out)
    assert rec["kept_images"] == 4 and rec["kept_frac"] == 0.5 and rec["optimizer_steps"] == 1
    # win rates within a group of 4 average 0.5; the kept half won more
    assert rec["reward_mean"] == pytest.approx(0.5) and rec["reward_kept_mean"] > 0.5
    assert rec["nonfinite_dropped"] == 0 and rec["empty_groups"] == 0
