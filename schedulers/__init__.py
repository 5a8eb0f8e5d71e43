"""Pure reverse-step kernels with log-probabilities.

Each kernel maps explicit ``(model_output, x, s, s_next)`` to a :class:`StepOutput`
``(prev_sample, log_prob, mean, std)``; it samples when ``prev_sample`` is None and re-scores the
given ``prev_sample`` otherwise. See ``docs/algorithms.md``, "SDE kernels".

| kernel                   | models              | used by                                  |
|--------------------------|---------------------|------------------------------------------|
| flow_grpo_sde_step       | flow matching       | Flow-GRPO, BranchGRPO, DRM Step-GRPO     |
| cps_sde_step             | flow matching       | Flow-CPS, Stepwise-Flow-GRPO             |
| dance_sde_step           | flow matching       | DanceGRPO                                |
| ode_step                 | flow matching       | DiffusionNFT / Sol-RL rollouts, eval     |
| ddim_step_with_logprob   | eps / v prediction  | DDPO, SPO, SDPO (SD1.5, SDXL)            |
"""

from .common import StepOutput, gaussian_log_prob
from .ddim import ddim_step_with_logprob
from .flow_sde import cps_sde_step, dance_sde_step, flow_grpo_sde_step, ode_step
from .timesteps import shift_sigmas, shifted_sigmas

__all__ = [
    "StepOutput",
    "gaussian_log_prob",
    "flow_grpo_sde_step",
    "cps_sde_step",
    "dance_sde_step",
    "ode_step",
    "ddim_step_with_logprob",
    "shift_sigmas",
    "shifted_sigmas",
]
