"""Pairwise preference rewards (Pref-GRPO): win rates on hand-computed numbers, the judges, and
GRPO-family recipes training on them through the shared reward path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reward_models
from diffalign.errors import RewardError
from diffalign.shapes.scenes import render, sample_scene
from diffalign.shapes.world import parse_prompt
from reward_models.pairwise import group_pairs, preference_from_scores, win_rates
from tests.helpers.tiny_run import FAST, run_cli, train_records


def _grey(levels) -> torch.Tensor:
    """Images (B, 3, 4, 4) of constant brightness ``levels``."""
    return torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()


def test_win_rates_of_a_group_of_three_by_hand():
    pairs = group_pairs(["g", "g", "g"])
    assert pairs.tolist() == [[0, 1], [0, 2], [1, 2]]
    # p01 = 0.7, p02 = 0.2, p12 = 0.5: w0 = (0.7 + 0.2) / 2, w1 = (0.3 + 0.5) / 2, w2 = (0.8 + 0.5) / 2
    w = win_rates(torch.tensor([0.7, 0.2, 0.5]), pairs, 3)
    assert torch.allclose(w, torch.tensor([0.45, 0.40, 0.65])) and abs(float(w.mean()) - 0.5) < 1e-7
    assert win_rates(torch.tensor([0.5]), group_pairs([0, 0]), 2).tolist() == [0.5, 0.5]  # a tie
    assert win_rates(torch.empty(0), group_pairs([3]), 1).tolist() == [0.5]  # a group of one: no comparison
    nan = win_rates(torch.tensor([float("nan"), 1.0, 1.0]), pairs, 3)
    assert torch.isnan(nan[:2]).all() and nan[2] == 0.0  # a failed judgement spoils both images it compared


def test_hard_comparison_ties_at_one_half_and_bradley_terry_by_hand():
    a, b = torch.tensor([1.0, 0.5, 0.2, float("nan")]), torch.tensor([0.5, 0.5, 0.7, 0.0])
    hard = preference_from_scores(a, b, 0.0)
    assert hard[:3].tolist() == [1.0, 0.5, 0.0] and torch.isnan(hard[3])
    soft = preference_from_scores(torch.tensor([0.3]), torch.tensor([0.1]), 0.1)
    assert abs(float(soft) - 1 / (1 + np.exp(-2.0))) < 1e-6


def test_groups_come_from_metadata_not_from_order():
    """Two interleaved groups: each image competes with its own group only."""
    reward = reward_models.build("pairwise", judge="bradley_terry", judge_kwargs={"reward": "brightness", "temperature": 0})
    images = _grey([0.1, 0.9, 0.5, 0.2, 0.3, 0.4])
    groups = [{"group": g} for g in (7, 3, 7, 3, 7, 3)]  # group 7: 0.1, 0.5, 0.3; group 3: 0.9, 0.2, 0.4
    w = reward(images, ["p", "q", "p", "q", "p", "q"], groups)
    assert w.tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 0.5]
    assert reward.last_info["pairwise/judgements"] == 6 and reward.last_info["pairwise/ties"] == 0.0
    assert abs(reward.last_info["pairwise/score_mean"] - 0.4) < 1e-6
    assert reward(images[:2], ["p", "p"], [{}, {}]).tolist() == pytest.approx([0.1, 0.9])  # no group (evaluation): the score
    with pytest.raises(RewardError, match="mixes the prompts"):
        reward(images[:2], ["p", "q"], [{"group": 0}, {"group": 0}])
    with pytest.raises(RewardError, match="some images have a group"):
        reward(images[:2], ["p", "p"], [{"group": 0}, {}])


def test_a_plain_pairwise_judge_matches_the_score_path_and_may_return_logits():
    """The generic path (one judge call per pair, here in batches of 2) gives the win rates that the
    Bradley-Terry judge's score path gives; a logit judge is read through a sigmoid."""
    images = _grey([0.30, 0.32, 0.25, 0.40])
    meta = [{"group": 0}] * 4
    fast = reward_models.build("pairwise", judge="bradley_terry", judge_kwargs={"reward": "brightness", "temperature": 0.01})
    plain = reward_models.build("pairwise", judge="bradley_terry", judge_kwargs={"reward": "brightness", "temperature": 0.01})
    bt = plain.judge
    plain.judge = lambda a, b, prompts: bt(a, b, prompts)  # hides score / prefer: the pair-by-pair path
    plain.batch_size = 2
    expected = fast(images, ["p"] * 4, meta)
    assert torch.allclose(plain(images, ["p"] * 4, meta), expected, atol=1e-6)
    logit = reward_models.build("pairwise", judge="tests.helpers.rewards:logit_judge", both_orders=True)
    assert torch.allclose(logit(images, ["p"] * 4, meta), expected, atol=1e-6)  # 100 x gap = gap / 0.01
    assert logit.last_info["pairwise/judgements"] == 12  # both orders: G (G - 1)


def test_shapes_verifier_prefers_the_image_that_meets_more_of_the_prompt():
    rng = np.random.default_rng(0)
    prompt = "a photo of a red circle"
    right = torch.from_numpy(render(sample_scene(parse_prompt(prompt), rng)))
    wrong = torch.from_numpy(render(sample_scene(parse_prompt("a photo of a blue square"), rng)))
    reward = reward_models.build("pairwise", judge="shapes_verifier")
    w = reward(torch.stack([right, wrong, right.clone()]), [prompt] * 3, [{"group": 0}] * 3)
    assert w.tolist() == [0.75, 0.0, 0.75]  # beats the wrong image, ties its twin
    assert reward.last_info["acc/images"] == pytest.approx(2 / 3)


def test_bad_judges_are_named():
    with pytest.raises(RewardError, match="unknown judge 'nope'.*bradley_terry"):
        reward_models.check_name("pairwise", {"judge": "nope"})
    with pytest.raises(RewardError, match="temperature"):
        reward_models.build("pairwise", judge="bradley_terry", judge_kwargs={"reward": "brightness", "temperature": -1})
    out = reward_models.build("pairwise", judge="tests.helpers.rewards:logit_judge")
    out.judge.output = "probability"  # logits read as probabilities: out of range
    with pytest.raises(RewardError, match="outside \\[0, 1\\]"):
        out(_grey([0.0, 0.9]), ["p", "p"], [{"group": 0}] * 2)


def pref_grpo_advantages(win_rates: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pref-GRPO's advantages, transcribed: each group's win rates minus their mean, over torch.std's
    default (unbiased) std of the group plus 1e-8."""
    groups = win_rates.view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-8)).flatten()


def test_a_pairwise_reward_takes_pref_grpo_advantages_unless_the_config_sets_them():
    from diffalign.algorithms.flow_grpo import group_advantages
    from diffalign.recipes import config_class

    rates = torch.tensor([0.2, 0.6, 0.7, 0.5, 0.9, 0.1, 0.4, 0.6])  # two groups of 4
    for name in ("flow_grpo", "diffusion_nft", "awm"):
        cfg = config_class(name)()
        cfg.apply_reward_defaults(groupwise=True)
        assert (cfg.advantage_std, cfg.advantage_unbiased_std, cfg.advantage_eps) == ("group", True, 1e-8), name
        adv = group_advantages(rates, torch.arange(8) // 4, std_mode=cfg.advantage_std, unbiased=cfg.advantage_unbiased_std,
                               eps=cfg.advantage_eps, clip=cfg.advantage_clip)
        torch.testing.assert_close(adv.advantages, pref_grpo_advantages(rates, 4))
    pointwise = config_class("flow_grpo")()
    pointwise.apply_reward_defaults(groupwise=False)  # Flow-GRPO's batch std, as before
    assert (pointwise.advantage_std, pointwise.advantage_unbiased_std, pointwise.advantage_eps) == ("global", False, 1e-4)
    explicit = config_class("flow_grpo")(advantage_std="global", advantage_eps=1e-4)
    explicit.apply_reward_defaults(groupwise=True)  # a key set in the config keeps its value
    assert (explicit.advantage_std, explicit.advantage_unbiased_std, explicit.advantage_eps) == ("global", True, 1e-4)
    nested = config_class("sol_rl")()
    nested.apply_reward_defaults(groupwise=True)
    assert nested.flow_grpo.advantage_std == nested.diffusion_nft.advantage_std == "group"


def test_flow_grpo_trains_on_win_rates(tmp_path):
    """configs/tiny/flow_grpo_pairwise.yaml trains an iteration; the win rates average 0.5 in every group,
    and the run's config records Pref-GRPO's normalisation, which the config leaves to the reward."""
    import yaml

    torch.set_num_threads(1)
    out = tmp_path / "run"
    assert run_cli("train", "configs/tiny/flow_grpo_pairwise.yaml", f"output_dir={out}", *FAST, "max_iterations=1",
                   "checkpoint.every=0") == 0
    [record] = train_records(out)
    assert record["reward_mean"] == pytest.approx(0.5) and record["reward_std"] > 0 and record["optimizer_steps"] == 1
    assert record["reward/pairwise/judgements"] == 6  # 4 x 3 / 2 per group, one group per chunk
    algorithm = yaml.safe_load((out / "config.yaml").read_text())["algorithm"]
    assert (algorithm["advantage_std"], algorithm["advantage_unbiased_std"], algorithm["advantage_eps"]) == ("group", True, 1e-8)


@pytest.mark.parametrize("config", ["configs/tiny/branch_grpo_sd3.yaml", "configs/tiny/diffusion_nft_sd3.yaml"])
def test_other_group_recipes_take_the_pairwise_reward(config, tmp_path):
    """BranchGRPO (a group is a prompt's tree) and DiffusionNFT, with chunks that split groups."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    args = [f"output_dir={out}", *FAST, "max_iterations=1", "checkpoint.every=0", "rollout.sample_batch_size=3",
            "reward.name=pairwise", "reward.kwargs={judge: bradley_terry, judge_kwargs: {reward: brightness, temperature: 0.01}}"]
    assert run_cli("train", config, *args) == 0
    [record] = train_records(out)
    assert record["reward_mean"] == pytest.approx(0.5) and record["reward_std"] > 0


def test_a_recipe_without_groups_refuses_the_pairwise_reward(tmp_path, capsys):
    args = [f"output_dir={tmp_path / 'run'}", *FAST, "reward.name=pairwise", "reward.kwargs={judge: shapes_verifier}"]
    assert run_cli("train", "configs/tiny/stepwise_flow_grpo_sd3.yaml", *args) == 2
    assert "compares the images of a prompt group" in capsys.readouterr().err.strip().splitlines()[-1]
