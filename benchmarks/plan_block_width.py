"""Does a block's activation memory per token grow with width only linearly? The planner's premise.

    python benchmarks/plan_block_width.py

The planner measures activations per row x token x width on tiny builds (width 16-32) and scales
them to published widths (diffalign/planner/activations.json, docs/memory.md). This builds one
SD3 joint-attention block (diffusers' ``JointTransformerBlock``, with and without SD3.5's dual
attention) at widths from 16 to SD3.5 Medium's 1,536, runs its forward on CPU with gradients at two
token counts under the planner's allocation tracker, and prints the marginal bytes per extra token
in elements per row x token x width (the part that scales with tokens) and the rest (constant in
tokens). About a minute on two cores.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import JointTransformerBlock

from diffalign.planner.measure import AllocationTracker

WIDTHS = ((16, 2), (64, 2), (256, 4), (1536, 24))  # (width, heads); 1,536 = SD3.5 Medium's 24 x 64
ROWS, TEXT = 2, 64
TOKENS = (256, 512)  # image tokens of the two forwards


def retained(block: torch.nn.Module, width: int, tokens: int) -> int:
    """Bytes the block's forward leaves alive (saved for backward, and its outputs)."""
    h = torch.randn(ROWS, tokens, width, requires_grad=True)
    e = torch.randn(ROWS, TEXT, width, requires_grad=True)
    temb = torch.randn(ROWS, width, requires_grad=True)
    with AllocationTracker() as tracker:
        out = block(hidden_states=h, encoder_hidden_states=e, temb=temb)
        kept = tracker.current
    del out
    return kept


def main() -> None:
    torch.manual_seed(0)
    print("block                      width  marginal elements per row x token x width  constant MB  weights MB")
    for dual in (False, True):
        for width, heads in WIDTHS:
            block = JointTransformerBlock(dim=width, num_attention_heads=heads, attention_head_dim=width // heads,
                                          context_pre_only=False, qk_norm="rms_norm", use_dual_attention=dual)
            a, b = (retained(block, width, n) for n in TOKENS)
            marginal = (b - a) / (TOKENS[1] - TOKENS[0])  # bytes per extra image token
            constant = a - marginal * (TOKENS[0] + TEXT)
            weights = sum(p.numel() * p.element_size() for p in block.parameters())
            print(f"{'joint, dual attention' if dual else 'joint':<26} {width:>5}  {marginal / (ROWS * width * 4):>42.2f}"
                  f"  {constant / 1e6:>11.1f}  {weights / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
