"""SPO (step-aware preference optimisation): the method's own pieces, in one place.

- :mod:`diffalign.spm.model`: the step-aware preference model (SPM) that judges two noisy
  states at one noise level, its save / load;
- :mod:`diffalign.spm.train`: training the SPM on preference pairs (``diffalign train-spm``);
- :mod:`diffalign.spm.sampling`: the step-wise resampler that draws k candidates from one shared
  state and keeps the (best, worst) pair of each confident judgement.

The loss and pair selection are pure math in :mod:`diffalign.algorithms.spo`; the recipe is
:mod:`diffalign.recipes.spo`; the SPM as a reward is ``reward_models.build("spm", ...)``.
Submodules import torch / diffusers; this package does not.
"""
