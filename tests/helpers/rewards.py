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
