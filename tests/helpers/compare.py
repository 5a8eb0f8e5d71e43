"""The weights of two runs compared in units of their update (how far they moved from the same
initial weights), as the multi-process, ZeRO and FSDP tests compare them.

Those tests train with ``COMPARABLE``, under which two correct runs differ by rounding only:
- plain SGD: its step is linear in the gradients, so the rounding differences of another summation
  order across processes stay rounding-sized in the weights. AdamW divides every gradient element
  by its running RMS: an element whose gradient is rounding noise (a LoRA A element while B is
  still near zero) takes a step of the order of the learning rate in a direction the noise picks,
  so two correct runs may end lr apart on it, on any CPU;
- a reward continuous in the images (brightness): a JPEG size jumps by a byte where rounding moves
  a pixel across a quantisation step, and advantages normalised by a small group spread turn that
  byte into differences of percents."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.tiny_run import FAST

# momentum: an optimizer state that checkpoints must carry
COMPARABLE = ["optim.name=sgd", "optim.momentum=0.9", "reward.name=brightness", "reward.kwargs={}"]
LORA = "final/pytorch_lora_weights.safetensors"
REL = 1e-3  # largest weight difference from the one-process run allowed, in units of the update

# Flow-GRPO on tiny SD3, the runs of tests/test_distributed.py and tests/test_fsdp.py that the conftest
# fixture flow_grpo_reference trains once: lr 50 moves the weights by about 1e-2 in two iterations
# (SGD steps are lr x gradient, and Flow-GRPO's gradients are ~1e-4); prompts_per_iteration is set per run
FLOW_GRPO = ["configs/tiny/flow_grpo_sd3.yaml", "max_iterations=2", "log.progress_bar=false", "log.report=false",
             "eval.at_start=false", "sampling.eval_num_steps=2", "train.ema.enabled=false", "optim.lr=50",
             "train.batch_size=64", *COMPARABLE]

# the other recipes' comparisons (tests/test_distributed.py, tests/test_fsdp.py): two iterations, no evaluations, no checkpoints
SHORT_RUN = [*FAST, "train.ema.enabled=false", "max_iterations=2", "eval.every=0", "checkpoint.every=0", *COMPARABLE, "--overwrite"]
# (config, overrides for both, one process, two processes): the same global batch either way
SPLIT_PROMPTS = (["rollout.prompts_per_iteration=2"], ["rollout.prompts_per_iteration=1"])  # two prompts, one per process
OTHER_ALGORITHMS = {
    "stepwise_flow_grpo": ("configs/tiny/stepwise_flow_grpo_sd3.yaml", ["optim.lr=1", "train.batch_size=64"], *SPLIT_PROMPTS),
    "branch_grpo": ("configs/tiny/branch_grpo_sd3.yaml", ["optim.lr=20", "train.batch_size=64"], *SPLIT_PROMPTS),
    "diffusion_nft": ("configs/tiny/diffusion_nft_sd3.yaml", ["optim.lr=2", "train.batch_size=64"], *SPLIT_PROMPTS),
    "awm": ("configs/tiny/awm.yaml", ["optim.lr=2", "train.batch_size=64"], *SPLIT_PROMPTS),
    "dgpo": ("configs/tiny/dgpo_sd3.yaml", ["optim.lr=2", "train.batch_size=64"], *SPLIT_PROMPTS),
    "raft": ("configs/tiny/raft_sd3.yaml", ["optim.lr=2", "train.batch_size=64"], *SPLIT_PROMPTS),
    "opd": ("configs/tiny/opd_sd3.yaml", ["optim.lr=20", "train.batch_size=64"], *SPLIT_PROMPTS),
    "flow_grpo_guard": ("configs/tiny/flow_grpo_guard.yaml", ["optim.lr=5", "train.batch_size=64"], *SPLIT_PROMPTS),
    "spo": ("configs/tiny/spo_sd15.yaml", ["optim.lr=0.5", "train.batch_size=64"], *SPLIT_PROMPTS),
    "diffusion_dpo": ("configs/shapes/diffusion_dpo.yaml",
                      ["optim.lr=1e-2", "model.id=tiny:shapes", "prompts.families=[single_object]",
                       "algorithm.generate_images_per_prompt=2", "train.optimizer_steps_per_iteration=2"],
                      ["train.batch_size=4"], ["train.batch_size=2"]),
}


def weights(run_dir: Path, name: str = LORA) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / name))


def update_size(initial: dict, final: dict) -> float:
    """The largest change of any weight element from ``initial`` to ``final``."""
    return max(float((final[k].float() - initial[k].float()).abs().max()) for k in initial)


def assert_same_update(initial: dict, a: dict, b: dict, rel: float, min_update: float) -> None:
    """Runs ``a`` and ``b`` (state dicts) that started at ``initial`` moved by at least
    ``min_update`` and end at most ``rel`` times the larger of their updates apart (largest element
    difference)."""
    assert initial.keys() == a.keys() == b.keys()
    update = max(update_size(initial, a), update_size(initial, b))
    assert update >= min_update, f"the weights moved by {update:.3g} only: no real update to compare"
    gap = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert gap <= rel * update, f"the runs end {gap:.3g} apart: {gap / update:.3g} of the update {update:.3g} (> {rel:g})"


def assert_resumed_equals_uninterrupted(full: Path, resumed: Path, keys: tuple[str, ...], iterations: int = 2) -> None:
    """A run resumed from a checkpoint ended where the uninterrupted one did: the same final LoRA,
    bit for bit, and the same values of ``keys`` in every training record."""
    from tests.helpers.tiny_run import train_records

    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = train_records(full), train_records(resumed)
    assert [r["iteration"] for r in rb] == list(range(iterations))
    for key in keys:
        assert [r[key] for r in ra] == [r[key] for r in rb], key
