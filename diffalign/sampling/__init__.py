"""Samplers (the rollout axis): they call ``adapter.predict`` and a pure step from :mod:`schedulers`.

- :mod:`diffalign.sampling.linear`: a kernel bound to an adapter's time convention, SDE windows,
  linear rollouts (:func:`sample_linear`) and plain image sampling (:func:`sample_images`);
- :mod:`diffalign.sampling.seeded`: one integer seed per sample fixes its noise (Sol-RL,
  DiffusionNFT);
- :mod:`diffalign.sampling.dense`: a linear rollout that also returns a clean estimate of every
  visited state (Stepwise-Flow-GRPO);
- :mod:`diffalign.sampling.tree`: tree rollouts with shared prefixes (BranchGRPO).

Method-specific samplers live with their method: SPO's step-wise resampler in
:mod:`diffalign.spm.sampling`, the DRM's k-candidate sampler in :mod:`diffalign.drm.sampling`.
"""

from diffalign.sampling.linear import (
    FLOW_KERNELS,
    Kernel,
    LinearStep,
    Trajectory,
    build_kernel,
    draw_noise,
    SampleSpec,
    sample_images,
    sample_linear,
    sde_window_mask,
)
from diffalign.sampling.seeded import SEED_HIGH, ode_kernel, sample_seeded, seed_noise
from diffalign.sampling.dense import MAX_SUBSTEPS, DenseTrajectory, refine_x0, sample_linear_dense
from diffalign.sampling.tree import TreeTrajectory, expected_forwards, sample_tree

__all__ = [
    "FLOW_KERNELS", "Kernel", "LinearStep", "Trajectory", "build_kernel", "draw_noise", "SampleSpec", "sample_images",
    "sample_linear", "sde_window_mask",
    "SEED_HIGH", "ode_kernel", "sample_seeded", "seed_noise",
    "MAX_SUBSTEPS", "DenseTrajectory", "refine_x0", "sample_linear_dense",
    "TreeTrajectory", "expected_forwards", "sample_tree",
]
