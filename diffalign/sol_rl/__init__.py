"""Sol-RL's own pieces: the low-precision copy of the policy that ranks seeds in its first stage.

- :mod:`diffalign.sol_rl.quantize`: the formats (torchao, bitsandbytes, optimum-quanto, plain
  casts), what runs where, and quantising one linear layer;
- :mod:`diffalign.sol_rl.policy_copy`: :class:`~diffalign.sol_rl.policy_copy.LowPrecisionCopy`,
  built from the live denoiser and re-synchronised after every update;
- :mod:`diffalign.sol_rl.fidelity`: the copy's velocity error, size and speed per format.

The selection math is :mod:`diffalign.algorithms.sol_rl`; the recipe is :mod:`diffalign.recipes.sol_rl`.
"""
