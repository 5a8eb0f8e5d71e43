"""Coordinate input channels of the shipped model's UNet: two planes (column, row in ``[-1, 1]``)
appended to the image, so a convolution can tell where in the picture it is (positions of shapes)."""

from __future__ import annotations

import torch

COORDINATE_CHANNELS = 2  # x, y


def coordinate_planes(batch: int, height: int, width: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """``(batch, 2, height, width)``: channel 0 is the pixel's column, channel 1 its row, each
    mapped linearly to ``[-1, 1]`` (left / top edge -1)."""
    ys = torch.linspace(-1.0, 1.0, height, device=device, dtype=torch.float32)
    xs = torch.linspace(-1.0, 1.0, width, device=device, dtype=torch.float32)
    planes = torch.stack([xs.expand(height, width), ys[:, None].expand(height, width)])
    return planes.to(dtype).expand(batch, -1, -1, -1)


def uses_coordinates(unet) -> bool:
    """Whether ``unet`` takes the coordinate planes beside the image (``in_channels = out + 2``)."""
    return int(unet.config.in_channels) == int(unet.config.out_channels) + COORDINATE_CHANNELS


def _append_coordinates(module, args, kwargs):
    """Forward pre-hook of a coordinate UNet: ``sample`` (B, 3, H, W) -> (B, 5, H, W)."""
    if args:
        sample, rest = args[0], args[1:]
    else:
        sample, rest = kwargs.pop("sample"), ()
    if sample.shape[1] == module.config.out_channels:
        b, _, h, w = sample.shape
        sample = torch.cat([sample, coordinate_planes(b, h, w, device=sample.device, dtype=sample.dtype)], dim=1)
    return (sample, *rest), kwargs


def attach_coordinates(unet) -> None:
    """Make a coordinate UNet (see :func:`uses_coordinates`) append the coordinate planes to its
    input itself, so every caller (pipeline, adapter, trainers, peft-wrapped copies) passes the
    3-channel image as for any other UNet. Idempotent; a no-op for a plain UNet."""
    if uses_coordinates(unet) and not getattr(unet, "_diffalign_coordinates", False):
        unet.register_forward_pre_hook(_append_coordinates, with_kwargs=True)
        unet._diffalign_coordinates = True


def widen_for_coordinates(unet, source) -> None:
    """Copy a plain UNet's weights (``source``) into the coordinate UNet ``unet`` of the same
    widths; the input convolution's two new channels start at zero, so ``unet`` computes exactly
    what ``source`` does until training moves them."""
    state = {k: v.clone() for k, v in source.state_dict().items()}
    weight = state["conv_in.weight"]
    pad = torch.zeros(weight.shape[0], COORDINATE_CHANNELS, *weight.shape[2:], dtype=weight.dtype)
    state["conv_in.weight"] = torch.cat([weight, pad], dim=1)
    unet.load_state_dict(state)
