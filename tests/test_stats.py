"""diffalign.stats: the stratified prompt bootstrap and paired differences, on hand-computed cases.

Every expected value is an exact rational or holds with a tolerance far above floating-point
rounding; the bootstrap's draws are seeded, and the distribution checks allow many standard
errors."""

import numpy as np
import pytest

from diffalign import stats
from diffalign.stats import Difference, Interval


def recs(family, prompt, outcomes):
    """Records of one prompt: ``outcomes`` = [(passed, score), ...], one per image."""
    return [{"prompt": prompt, "family": family, "passed": p, "score": s} for p, s in outcomes]


def assert_point(iv, value):
    assert iv.value == pytest.approx(value, abs=1e-12)
    assert iv.lo == pytest.approx(value, abs=1e-12) and iv.hi == pytest.approx(value, abs=1e-12)


def test_point_estimates_overall_is_the_family_mean_not_the_image_mean():
    records = recs("a", "p1", [(True, 1.0)] * 4) + recs("b", "q1", [(False, 0.5)] * 6) + recs("b", "q2", [(False, 0.0)] * 6)
    m = stats.point_estimates(records)
    assert m["acc/a"] == 1.0 and m["acc/b"] == 0.0
    assert m["acc/overall"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert m["acc/images"] == pytest.approx(4 / 16)
    assert m["partial"] == pytest.approx((4 * 1.0 + 6 * 0.5) / 16)
    assert stats.metric_keys(records) == ["acc/a", "acc/b", "acc/overall", "acc/images", "partial"]


def test_identical_prompts_give_a_zero_width_interval_at_the_value():
    records = []
    for i in range(4):  # every prompt of family a: one of two images passes, partial credit 1 and 0.5
        records += recs("a", f"a{i}", [(True, 1.0), (False, 0.5)])
    for i in range(3):
        records += recs("b", f"b{i}", [(True, 1.0), (True, 1.0)])
    ivs = stats.bootstrap_intervals(records)
    assert_point(ivs["acc/a"], 0.5)
    assert_point(ivs["acc/b"], 1.0)
    assert_point(ivs["acc/overall"], 0.75)
    assert_point(ivs["acc/images"], 10 / 14)
    assert_point(ivs["partial"], (4 * 1.5 + 6 * 1.0) / 14)


def test_bootstrap_distribution_of_two_prompts_matches_the_exact_one():
    # Two prompts, one image each, one passes: a resample draws two prompts with replacement, so
    # the accuracy is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4.
    records = recs("f", "pass", [(True, 1.0)]) + recs("f", "fail", [(False, 0.0)])
    reps = stats.bootstrap_replicates(records, resamples=4000, seed=7)["acc/f"]
    assert reps.shape == (4000,)
    values, counts = np.unique(np.round(reps * 2).astype(int), return_counts=True)
    assert values.tolist() == [0, 1, 2]
    freq = counts / counts.sum()
    assert freq == pytest.approx([0.25, 0.5, 0.25], abs=0.04)  # ~6 standard errors
    # 2.5 % / 97.5 % quantiles of that distribution are its extremes
    iv = stats.bootstrap_intervals(records, resamples=4000, seed=7)["acc/f"]
    assert (iv.value, iv.lo, iv.hi) == (0.5, 0.0, 1.0)


def test_bootstrap_distribution_of_three_prompts_matches_the_binomial():
    # One of three prompts passes: the number of times it is drawn is Binomial(3, 1/3).
    records = recs("f", "x", [(True, 1.0)]) + recs("f", "y", [(False, 0.0)]) + recs("f", "z", [(False, 0.0)])
    reps = stats.bootstrap_replicates(records, resamples=6000, seed=1)["acc/f"]
    k = np.round(reps * 3).astype(int)
    assert np.allclose(reps * 3, k, atol=1e-9)  # support: 0, 1/3, 2/3, 1
    freq = np.bincount(k, minlength=4) / k.size
    assert freq == pytest.approx([8 / 27, 12 / 27, 6 / 27, 1 / 27], abs=0.03)


def test_percentile_interval_interpolates_linearly():
    assert stats.percentile_interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    assert stats.percentile_interval(np.arange(11.0) / 10, level=0.8) == pytest.approx((0.1, 0.9))
    assert stats.percentile_interval(np.full(7, 0.25)) == (0.25, 0.25)
    with pytest.raises(ValueError):
        stats.percentile_interval(np.arange(3.0), level=1.0)


def test_stratification_keeps_every_family_size_fixed():
    # Family a always passes, family b never: with prompts resampled within each family the
    # image count of each family never changes, so even the per-image pass rate is fixed.
    records = []
    for i in range(3):
        records += recs("a", f"a{i}", [(True, 1.0)] * 2)
    for i in range(5):
        records += recs("b", f"b{i}", [(False, 0.0)] * 2)
    ivs = stats.bootstrap_intervals(records)
    assert_point(ivs["acc/overall"], 0.5)
    assert_point(ivs["acc/images"], 6 / 16)
    # a pooled (unstratified) resample of the 8 prompts would move the pass rate
    rng = np.random.default_rng(0)
    pooled = rng.integers(0, 8, size=(2000, 8)) < 3
    assert pooled.mean(axis=1).std() > 0.1


def test_unequal_images_per_prompt_weigh_by_images():
    records = recs("f", "big", [(True, 1.0)] * 3) + recs("f", "small", [(False, 0.0)])
    assert stats.point_estimates(records)["acc/f"] == pytest.approx(0.75)
    reps = stats.bootstrap_replicates(records, resamples=500, seed=0)["acc/f"]
    # possible resamples: {big, big} 1, {big, small} 3/4, {small, small} 0
    assert set(np.round(reps * 4).astype(int).tolist()) <= {0, 3, 4}


def test_paired_difference_of_identical_models_is_zero_with_zero_width():
    records = []
    for i in range(6):
        records += recs("f", f"p{i}", [(i % 2 == 0, i / 6), (i % 3 == 0, 0.5)])
    records += recs("g", "q", [(True, 1.0), (False, 0.0)])
    diffs = stats.paired_difference(records, [dict(r) for r in records])
    for k, d in diffs.items():
        assert isinstance(d, Difference)
        assert (d.value, d.lo, d.hi) == (0.0, 0.0, 0.0), k
        assert not d.outside_noise
    # the unpaired intervals of the same records are not degenerate
    assert stats.bootstrap_intervals(records)["acc/f"].width > 0


def test_paired_interval_is_narrower_than_unpaired_for_correlated_models():
    # Prompt i: model a passes i of 10 images, model b one more. Prompt difficulty varies a lot,
    # the gain is the same on every prompt.
    a, b = [], []
    for i in range(10):
        a += recs("f", f"p{i}", [(j < i, 0.0) for j in range(10)])
        b += recs("f", f"p{i}", [(j < i + 1, 0.0) for j in range(10)])
    d = stats.paired_difference(a, b)["acc/f"]
    assert d.value == pytest.approx(0.1)
    assert d.lo == pytest.approx(0.1) and d.hi == pytest.approx(0.1)
    assert d.outside_noise
    ra = stats.bootstrap_replicates(a, seed=1)["acc/f"]
    rb = stats.bootstrap_replicates(b, seed=2)["acc/f"]
    lo, hi = stats.percentile_interval(rb - ra)
    assert lo < 0 < hi  # unpaired, the same gain is lost in the noise
    assert hi - lo > 0.1

    # a less regular case: b gains on some prompts and loses on one
    b2 = []
    for i in range(10):
        extra = {0: 2, 3: 1, 5: -1, 7: 2}.get(i, 0)
        b2 += recs("f", f"p{i}", [(j < i + extra, 0.0) for j in range(10)])
    d2 = stats.paired_difference(a, b2)["acc/f"]
    rb2 = stats.bootstrap_replicates(b2, seed=2)["acc/f"]
    lo2, hi2 = stats.percentile_interval(rb2 - ra)
    assert d2.width < (hi2 - lo2) / 3


def test_paired_needs_the_same_prompts():
    a = recs("f", "p", [(True, 1.0)]) + recs("f", "q", [(False, 0.0)])
    with pytest.raises(ValueError, match="same prompts"):
        stats.paired_difference(a, recs("f", "p", [(True, 1.0)]) + recs("f", "r", [(False, 0.0)]))
    with pytest.raises(ValueError, match="same families"):
        stats.paired_difference(a, recs("g", "p", [(True, 1.0)]) + recs("g", "q", [(False, 0.0)]))
    with pytest.raises(ValueError, match="no 'score'"):
        stats.point_estimates([{"prompt": "p", "family": "f", "passed": True}])


def test_seeded_and_reproducible():
    records = []
    for i in range(8):
        records += recs("f", f"p{i}", [(i % 3 == 0, 0.3 * (i % 4))] * 2)
    one = stats.bootstrap_intervals(records, seed=3)
    assert stats.bootstrap_intervals(records, seed=3) == one
    assert one["acc/f"].lo <= one["acc/f"].value <= one["acc/f"].hi


def test_interval_formatting():
    assert Interval(0.198, 0.158, 0.243).format() == "0.198 [0.158, 0.243]"
    assert Difference(0.03, 0.003, 0.061).format() == "+0.030 [+0.003, +0.061] *"
    assert Difference(0.01, -0.02, 0.04).format() == "+0.010 [-0.020, +0.040]"
    assert Difference(-0.05, -0.08, -0.01).outside_noise
    assert not Difference(0.0, 0.0, 0.0).outside_noise
