"""The reward-hacking guard (train.guard): the trend and divergence test on hand-made sequences
(diffalign.trends), the guard's bookkeeping (diffalign.training.guard), its config errors, and
tiny DRaFT runs whose judge is made to disagree with the verifier (darkness against brightness)
where the guard stops the run or lowers the learning rate."""

import json
import math
import random

import pytest
import torch

from diffalign.config import RewardGuardConfig
from diffalign.report import curve_figure, guard_summary, write_report
from diffalign.training.guard import RewardGuard
from diffalign.trends import divergence, t_cdf, t_quantile, trend
from tests.helpers.tiny_run import FAST_ONE_PROMPT, run_cli, train_records

# ---- the pure rule --------------------------------------------------------------------------------


def test_trend_on_hand_computed_points():
    # x 0..3, y 0 1 1 2: Sxx = 5, Sxy = 3 -> slope 0.6; residuals -0.1 0.3 -0.3 0.1 -> SS 0.2, se sqrt(0.2 / 2 / 5)
    t = trend([0, 1, 2, 3], [0, 1, 1, 2])
    assert t.slope == pytest.approx(0.6) and t.se == pytest.approx(math.sqrt(0.02))
    assert (t.n, t.first, t.last) == (4, 0, 3) and t.change == pytest.approx(1.8)
    exact = trend([2, 4, 6], [1.0, 0.0, -1.0])  # on a line: no scatter
    assert exact.slope == pytest.approx(-0.5) and exact.se == pytest.approx(0.0)
    # known sampling errors of the points bound the slope's error from below: sqrt(mean(e^2) / Sxx)
    assert trend([2, 4, 6], [1.0, 0.0, -1.0], errors=[0.2, 0.2, 0.2]).se == pytest.approx(0.2 / math.sqrt(8))
    assert trend([2, 4, 6], [1.0, 0.0, -1.0], errors=[0.2, math.nan, 0.2]).se == pytest.approx(0.2 / math.sqrt(8))
    with pytest.raises(ValueError):
        trend([1, 1, 1], [0, 1, 2])


def test_t_quantile_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 6, 9, 30):
        for p in (0.9, 0.95, 0.99):
            assert t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-9)
        assert t_cdf(-1.3, df) == pytest.approx(scipy_stats.t.cdf(-1.3, df), rel=1e-12)


ITS = list(range(8))
RULE = dict(window=8, min_drop=0.05, confidence=0.95)


def test_agreeing_curves_do_not_diverge():
    learned = [0.30 + 0.02 * i for i in ITS]
    verifier = [0.40 + 0.01 * i + (0.005 if i % 2 else -0.005) for i in ITS]
    test = divergence(ITS, learned, verifier, **RULE)
    assert test.learned_rises and not test.verifier_falls and not test.diverged


def test_diverging_curves_diverge_and_the_message_names_both_trends():
    learned = [0.30 + 0.02 * i + (0.004 if i % 3 == 0 else -0.002) for i in ITS]
    verifier = [0.60 - 0.02 * i + (0.003 if i % 2 else -0.003) for i in ITS]
    test = divergence(ITS, learned, verifier, **RULE)
    assert test.diverged and test.verifier.change == pytest.approx(-0.14, abs=0.01)
    line = test.describe("the learned reward (drm_score_mean)", "the verifier (shapes_eval)")
    assert "(drm_score_mean) rose +0.0198/iteration" in line and "(shapes_eval) fell -0.0197/iteration" in line
    assert "-0.138 over iterations 0-7" in line and "\n" not in line


def test_a_fall_smaller_than_min_drop_or_within_noise_is_not_a_divergence():
    learned = [0.3 + 0.02 * i for i in ITS]
    small = [0.5 - 0.005 * i for i in ITS]  # steady, certain, but 0.035 over the window
    assert not divergence(ITS, learned, small, **RULE).diverged
    assert divergence(ITS, learned, small, **{**RULE, "min_drop": 0.03}).diverged
    # a fall of 0.07 among per-point sampling errors of 0.06 (64 images): the known errors hold it back
    falling = [0.5 - 0.01 * i for i in ITS]
    assert divergence(ITS, learned, falling, **RULE).diverged
    assert not divergence(ITS, learned, falling, **RULE, verifier_errors=[0.06] * 8).diverged


def test_noisy_but_flat_verifier_rarely_fires():
    """A verifier that only scatters (the sd of a 64-image mean of pass / fail, 0.06) while the learned
    reward rises: the rule fires in about 1 - confidence of windows, not on every dip."""
    rng = random.Random(0)
    learned = [0.3 + 0.02 * i for i in ITS]
    fired = sum(divergence(ITS, learned, [0.5 + rng.gauss(0, 0.06) for _ in ITS], **RULE).diverged for _ in range(400))
    assert fired / 400 < 0.06
    # the same scatter around a real fall of 0.03 per iteration (0.21 over the window) is found
    found = sum(divergence(ITS, learned, [0.5 - 0.03 * i + rng.gauss(0, 0.06) for i in ITS], **RULE).diverged
                for _ in range(400))
    assert found / 400 > 0.5


def test_window_and_non_finite_points():
    learned = [0.3 + 0.02 * i for i in ITS]
    verifier = [0.6 - 0.03 * i for i in ITS]
    assert divergence(ITS[:7], learned[:7], verifier[:7], **RULE) is None  # the window is not full yet
    holed = list(verifier)
    holed[3] = float("nan")
    assert divergence(ITS, learned, holed, **RULE) is None  # 7 finite points
    test = divergence([*ITS, 8], [*learned, 0.46], [*holed, 0.36], **RULE)  # a ninth point fills the window
    assert test.diverged and test.learned.n == 8
    with pytest.raises(ValueError):
        divergence(ITS, learned, verifier, window=3, min_drop=0.0, confidence=0.95)


# ---- the guard's bookkeeping ---------------------------------------------------------------------


def scored(values):
    """A verifier returning ``values`` (in order) for the images it is handed."""
    it = iter(values)
    return lambda images, prompts, metadata: torch.tensor([next(it) for _ in prompts])


def close_points(guard, learned, verifier, images=2):
    decisions = []
    for i, (a, b) in enumerate(zip(learned, verifier)):
        guard.begin()
        guard.observe(torch.zeros(images, 3, 4, 4), ["p"] * images)
        decisions.append(guard.close(i, a, guard.local_sums()))
    return decisions


def test_the_guard_warns_once_lowers_the_rate_at_most_k_times_and_counts_non_finite_scores():
    falling = [0.6 - 0.05 * i for i in range(12)]
    rising = [0.1 + 0.05 * i for i in range(12)]
    cfg = RewardGuardConfig(verifier="v", window=4, action="warn")
    guard = RewardGuard(cfg, scored([v for v in falling for _ in range(2)]), "reward_mean")
    actions = [d.action for d in close_points(guard, rising, falling)]
    assert actions == ["", "", "", "warn"] + [""] * 8  # one warning for one divergence
    cfg = RewardGuardConfig(verifier="v", window=4, action="lower_lr", lr_factor=0.5, max_lr_drops=2)
    guard = RewardGuard(cfg, scored([v for v in falling for _ in range(2)]), "reward_mean")
    decisions = close_points(guard, rising, falling)
    assert [d.action for d in decisions] == ["", "", "", "lower_lr", "", "", "", "lower_lr", "", "", "", "warn"]
    assert guard.lr_drops == 2 and guard.lr_scale == 0.25  # each drop restarts the window; then only warnings
    first = decisions[3].record
    assert first["guard/verifier"] == pytest.approx(0.45) and first["guard/learned"] == pytest.approx(0.25)
    assert first["guard/diverged"] == 1 and first["guard/verifier_slope"] == pytest.approx(-0.05)

    nan = float("nan")
    guard = RewardGuard(RewardGuardConfig(verifier="v", window=4), scored([0.5, nan, nan, nan]), "reward_mean")
    one, two = close_points(guard, [0.1, nan], [0.5, nan])
    assert one.record["guard/verifier_images"] == 1 and two.record["guard/verifier_images"] == 0
    assert math.isnan(two.record["guard/verifier"]) and guard.nonfinite == 4  # 3 scores and 1 learned value
    assert guard.iterations == [0]  # the non-finite point is left out of the curves
    state = guard.state_dict()
    again = RewardGuard(guard.cfg, guard.verifier, "reward_mean")
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == state


# ---- config errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("train.guard.window=3", "train.guard.window"),
    ("train.guard.every=0", "train.guard.every"),
    ("train.guard.confidence=1.0", "train.guard.confidence"),
    ("train.guard.lr_factor=1.5", "train.guard.lr_factor"),
    ("train.guard.action=pause", "train.guard.action"),
    ("train.guard.verifier=no_such_reward", "train.guard.verifier"),
])
def test_bad_guard_keys_are_one_line_errors_naming_the_key(override, key, capsys):
    assert run_cli("config", "configs/shapes/drft.yaml", "train.guard.verifier=shapes_eval", override) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and key in err and "\n" not in err


def test_kwargs_without_a_verifier_and_a_method_without_rollouts_are_refused(capsys):
    assert run_cli("config", "configs/shapes/drft.yaml", "train.guard.verifier_kwargs={partial_credit: true}") == 2
    assert "train.guard.verifier_kwargs" in capsys.readouterr().err
    assert run_cli("config", "configs/shapes/diffusion_dpo.yaml", "train.guard.verifier=shapes_eval") == 2
    err = capsys.readouterr().err.strip()
    assert "train.guard.verifier" in err and "diffusion_dpo" in err and "\n" not in err


# ---- end to end: a judge that disagrees with the verifier ------------------------------------------

# DRaFT on the tiny shapes model climbs `darkness` (1 - brightness) by its gradient: the images get
# darker every iteration, so the learned reward rises while the `brightness` verifier falls.
HACKED = ["configs/shapes/drft.yaml", "model.id=tiny:shapes", "rollout.prompts_per_iteration=1", "rollout.group_size=4",
          "train.batch_size=4", "sampling.num_steps=2", "eval.images_per_family=1", "eval.probe=false",
          "checkpoint.every=0", "train.mixed_precision=no", "train.channels_last=false", "optim.lr=3e-3",
          "reward.name=tests.helpers.rewards:darkness", "reward.kwargs={}", "train.guard.verifier=brightness",
          "train.guard.window=4", *FAST_ONE_PROMPT]


def test_the_guard_stops_a_run_whose_judge_disagrees_with_the_verifier(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", *HACKED, f"output_dir={out}", "max_iterations=8", "train.guard.action=stop") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: reward-hacking guard stopped the run after iteration 4: the learned reward (reward_mean) rose +")
    assert "(brightness) fell -" in err and "over iterations 1-4" in err and "checkpoint at iteration 4" in err
    records = train_records(out)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    for r in records:  # both scores on every iteration: the learned one is the reward, here 1 - the verifier
        assert r["guard/learned"] == pytest.approx(r["reward_mean"])
        assert r["guard/learned"] + r["guard/verifier"] == pytest.approx(1.0, abs=1e-5)
    assert records[-1]["guard/stop"] == 1 and records[-1]["guard/verifier_slope"] < 0 < records[-1]["guard/learned_slope"]
    assert (out / "checkpoints" / "iter-000004").is_dir()
    # resumed (here with the action relaxed), the run continues the same window: the curves are in the checkpoint
    assert run_cli("resume", out, "train.guard.action=warn", "max_iterations=5") == 0
    records = train_records(out)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3, 4]
    assert records[4]["guard/diverged"] == 1 and records[4]["guard/verifier_slope"] < 0


def test_the_guard_lowers_the_learning_rate_once(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", *HACKED, f"output_dir={out}", "max_iterations=5", "train.guard.action=lower_lr",
                   "train.guard.max_lr_drops=1", "train.guard.lr_factor=0.5") == 0
    assert "learning rate x 0.5 (drop 1 of train.guard.max_lr_drops=1)" in capsys.readouterr().err
    records = train_records(out)
    assert [r.get("guard/lr_drop") for r in records] == [None, None, None, 1, None]
    assert records[3]["guard/lr"] == pytest.approx(1.5e-3)  # the rate of the iterations that follow ...
    assert "lr" not in records[3] and records[4]["lr"] == pytest.approx(1.5e-3)  # ... as the next one ran with it
    assert [r["guard/lr_scale"] for r in records] == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert all(math.isfinite(r["guard/verifier"]) and math.isfinite(r["guard/learned"]) for r in records)
    text = write_report(out).read_text()  # the reward panel shows both curves; the paragraph says what the guard did
    assert "**Reward-hacking guard:** verifier `brightness`" in text and "lowered at 4." in text
    assert (out / "report" / "curves.png").is_file()


def test_the_report_panel_draws_the_learned_reward_and_the_verifier():
    records = [{"iteration": i, "reward_mean": 0.1 * i, "guard/learned": 0.1 * i, "guard/verifier": 0.5 - 0.1 * i,
                "guard/diverged": int(i == 3)} for i in range(4)]
    fig = curve_figure(records, [])
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert {"learned reward (trained on)", "verifier (right axis)", "diverged (guard)"} <= set(labels)
    config = {"train": {"guard": {"verifier": "shapes_eval"}}}
    assert "never diverged" not in guard_summary(records, config) and "at iterations 4." in guard_summary(records, config)
    assert guard_summary([{"iteration": 0, "reward_mean": 0.2}], config) is None


@pytest.mark.parametrize("config", ["flow_grpo_sd3", "branch_grpo_sd3", "stepwise_flow_grpo_sd3", "diffusion_nft_sd3", "awm",
                                    "sol_rl_sd3", "raft_sd3"])
def test_the_verifier_scores_the_final_images_the_reward_scores(config, tmp_path):
    """With the verifier equal to the reward, its mean is the iteration's reward_mean: each recipe hands
    the guard its rollouts' final images (the leaves of a tree, the real last sample of dense
    rollouts, the trained stage-two samples of Sol-RL), all of them and nothing else."""
    out = tmp_path / "run"
    assert run_cli("train", f"configs/tiny/{config}.yaml", f"output_dir={out}", "max_iterations=1", "reward.name=brightness",
                   "reward.kwargs={}", "train.guard.verifier=brightness", *FAST_ONE_PROMPT) == 0
    (record,) = train_records(out)
    assert record["guard/verifier"] == pytest.approx(record["reward_mean"], abs=1e-6)
    assert record["guard/learned"] == record["reward_mean"] and record["guard/verifier_images"] == 8
