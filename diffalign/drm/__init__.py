"""Diffusion-based reward model (DRM): a denoiser backbone that scores noisy latents.

- :mod:`diffalign.drm.model`: :class:`~diffalign.drm.model.DiffusionRewardModel` (cut backbone +
  head), save / load (noising and encoding are the shared :mod:`diffalign.forward_process`, its
  pairs :class:`diffalign.pairs.LatentPairs`);
- :mod:`diffalign.drm.train`: Bradley-Terry training (``diffalign train-reward``) and pairwise
  accuracy against t;
- :mod:`diffalign.drm.sampling`: k-candidate branching and step-wise sampling
  (``diffalign sample``).

The DRM as a reward is ``reward_models.build("drm", path=DIR)``; DRM Step-GRPO is the recipe
``diffalign.recipes.drm_step_grpo``. Submodules import torch / diffusers; this package does not.
"""
