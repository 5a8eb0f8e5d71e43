"""Reward factories used by the tests through dotted paths (``tests.helpers.rewards:...``)."""

import torch


def nan_reward(device="cpu"):
    def reward(images, prompts, metadata):
        out = images.mean(dim=(1, 2, 3)).float()
        out[0] = float("nan")
        return out

    return reward


def wrong_shape_reward(device="cpu"):
    def reward(images, prompts, metadata):
        return torch.zeros(len(prompts) + 1)

    return reward


CALLS: list[int] = []  # batch sizes of the calls of the last counting_reward built


def counting_reward(fail_calls=(), differentiable=False, device="cpu"):
    """Brightness (mean pixel value) that raises a RewardError on the calls numbered in ``fail_calls``
    (0-based over the reward's life) and records every call's batch size in ``CALLS``;
    ``differentiable``: declared so (its graph runs back to the images), for DRaFT / ReFL."""
    from diffalign.errors import RewardError

    CALLS.clear()

    def reward(images, prompts, metadata):
        CALLS.append(len(prompts))
        if len(CALLS) - 1 in fail_calls:
            raise RewardError(f"counting reward: call {len(CALLS) - 1} fails")
        return images.mean(dim=(1, 2, 3)).float()

    reward.differentiable = bool(differentiable)
    return reward


def logit_judge(device="cpu"):
    """A pairwise judge that returns a logit: 100 x the brightness difference of a over b."""

    def judge(images_a, images_b, prompts):
        return 100.0 * (images_a.mean(dim=(1, 2, 3)) - images_b.mean(dim=(1, 2, 3))).float()

    judge.output = "logit"
    return judge


class Darkness:
    """A judge made to disagree with the ``brightness`` verifier: ``1 - brightness`` (it prefers dark,
    eventually blank, images), differentiable, so that DRaFT climbs it while the verifier falls."""

    differentiable = True

    def __call__(self, images, prompts, metadata):
        return 1.0 - images.mean(dim=(1, 2, 3)).float()


def darkness(device="cpu"):
    return Darkness()
