"""Does a ShapesWorld model's prompt reach the noise levels where the layout is decided?

    python benchmarks/shapes_layout_probe.py [--model shapes] [--sigma 0.95] [--samples 128]
        [--renders 2000] [--threads 2]

At high noise a flow model's best guess of the clean image, ``x0_hat = x_t - sigma * v``, averaged
over the noise, is the mean image of what the prompt asks for: that mean is what the first
sampling steps steer towards, before any object exists. Prompts that ask for different layouts
have different mean images: "a circle left of a square" puts mass in a horizontal band, "a circle
above a square" in a vertical one, "four triangles" spreads more mass than "one triangle". The
probe compares, for pairs of training prompts that differ in one property, how far apart the
model's mean ``x0_hat`` at ``--sigma`` lies (the same noise for both prompts, ``x_t`` = ``sigma *
noise`` over a black image, so only the prompt differs) with how far apart the mean images of the
renders lie (RMS over the pixels of the mean brightness, in [-1, 1]):

- ``axis``: the same two shapes, a horizontal relation against a vertical one;
- ``side``: the same relation, the two shapes swapped (which one stands left or above);
- ``count``: one shape, two different counts (a control the shipped model learned);
- ``colour``: one shape, two different colours (a control).

``ratio`` = model / renders, averaged over the pairs of a kind: near 1 the model's first steps aim
at the layout the prompt asks for; near 0 the prompt does not change them, and the layout comes
out the same whatever the relation word says. A diagnostic of what pretraining taught, cheap
enough to run on every checkpoint; no intervals.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

KINDS = ("axis", "side", "count", "colour")
HORIZONTAL, VERTICAL = ("left of", "right of"), ("above", "below")


def contrast_pairs(prompts: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Pairs of ``prompts`` that differ in one property, by kind (see the module docstring)."""
    from diffalign.shapes.world import parse_prompt

    specs = {p: parse_prompt(p) for p in prompts}
    pairs: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    for a, b in itertools.combinations(sorted(prompts), 2):
        sa, sb = specs[a], specs[b]
        if sa.family != sb.family:
            continue
        shapes_a, shapes_b = [o.shape for o in sa.objects], [o.shape for o in sb.objects]
        if sa.family == "position":
            if shapes_a == shapes_b and (sa.relation in HORIZONTAL) != (sb.relation in HORIZONTAL):
                pairs["axis"].append((a, b))
            elif shapes_a == shapes_b[::-1] and sa.relation == sb.relation:
                pairs["side"].append((a, b))
        elif sa.family == "counting" and shapes_a == shapes_b and sa.objects[0].count != sb.objects[0].count:
            pairs["count"].append((a, b))
        elif sa.family == "colors" and shapes_a == shapes_b and sa.objects[0].color != sb.objects[0].color:
            pairs["colour"].append((a, b))
    return pairs


def render_mean(prompt: str, n: int, seed: int):
    """The mean brightness (mean over the colour channels) of ``n`` renders of ``prompt``, in
    [-1, 1] (H, W): colours the prompt leaves free average out faster than in each channel."""
    import numpy as np

    from diffalign.shapes.scenes import make_batch

    return 2 * make_batch([prompt] * n, np.random.default_rng(seed)).mean(dim=(0, 1)).numpy() - 1


def rms(a, b) -> float:
    import numpy as np

    return float(np.sqrt(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shapes", help="model id (default: the shipped shapes model)")
    p.add_argument("--sigma", type=float, default=0.95, help="noise level of the probe (1 = pure noise)")
    p.add_argument("--samples", type=int, default=128, help="noise samples per prompt")
    p.add_argument("--renders", type=int, default=2000, help="renders per prompt for its mean image")
    p.add_argument("--max-pairs", type=int, default=8, help="pairs per kind (the first in sorted order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not 0 < args.sigma <= 1:
        raise SystemExit(f"--sigma must be in (0, 1], got {args.sigma}")

    import numpy as np
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.shapes import split_prompts

    torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model)
    side_px = adapter.default_resolution
    pairs = {k: v[: args.max_pairs] for k, v in contrast_pairs(list(split_prompts().train)).items()}
    noise = torch.randn(args.samples, *adapter.latent_shape(side_px, side_px),
                        generator=torch.Generator().manual_seed(args.seed))
    x_t = args.sigma * noise - (1 - args.sigma)  # over a black image (-1): only the prompt differs
    t = torch.full((args.samples,), args.sigma)
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def means(prompt: str):
        if prompt not in cache:
            embeds = adapter.encode_prompts([prompt] * args.samples, with_uncond=False)
            with torch.no_grad():
                x0_hat = adapter.to_x0(adapter.predict(x_t, t, embeds), x_t, t)
            x0_hat = x0_hat.mean((0, 1)).numpy()  # over the noise and the colour channels
            cache[prompt] = (x0_hat, render_mean(prompt, args.renders, args.seed))
        return cache[prompt]

    print(f"{args.model}: mean x0 estimate at sigma {args.sigma} ({args.samples} noise samples, the same for every "
          f"prompt) against the mean of {args.renders} renders; RMS differences of the mean brightness in [-1, 1]")
    first = pairs["axis"][0][0] if pairs["axis"] else None
    if first is not None:  # what two independent sets of renders of one prompt differ by
        floor = rms(render_mean(first, args.renders, args.seed), render_mean(first, args.renders, args.seed + 1))
        print(f"noise floor of the renders column (two sets of renders of {first!r}): {floor:.4f}")
    print(f"{'kind':<8}{'pairs':>6}{'model':>9}{'renders':>9}{'ratio':>8}")
    for kind in KINDS:
        rows = []
        for a, b in pairs[kind]:
            (ma, ra), (mb, rb) = means(a), means(b)
            rows.append((rms(ma, mb), rms(ra, rb)))
        if not rows:
            print(f"{kind:<8}{0:>6}{'-':>9}{'-':>9}{'-':>8}")
            continue
        model_d, render_d = np.mean(rows, axis=0)
        ratio = float(np.mean([m / r for m, r in rows]))
        print(f"{kind:<8}{len(rows):>6}{model_d:>9.4f}{render_d:>9.4f}{ratio:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
