"""``rollout.offload_samples`` (a rollout's samples in CPU memory until the update) and, on tiny SD3
(CLIP-L + CLIP-G + T5), the text-encoder placements: the same weights as a plain run."""

import pytest
import torch

from diffalign.adapters.base import PromptEmbeds
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.sampling import Trajectory
from diffalign.trainer import build_trainer
from diffalign.training import samples
from tests.helpers.compare import FLOW_GRPO, OTHER_ALGORITHMS, REL, SHORT_RUN, assert_same_update, weights
from tests.helpers.tiny_run import run_cli

# one iteration of Flow-GRPO on tiny SD3, checkpoint at the start (iteration 0) for the initial weights
RUN = [*FLOW_GRPO, "max_iterations=1", "sampling.num_steps=3", "eval.samples_per_prompt=1", "eval.num_prompts=1",
       "checkpoint.every=1"]


def test_to_device_moves_every_sample_tensor():
    traj = Trajectory(torch.zeros(2, 4, 3), torch.zeros(2, 3), torch.linspace(1, 0, 4), torch.ones(3, dtype=torch.bool),
                      torch.zeros(2, 3, 8, 8))
    mask = torch.ones(2, 5, dtype=torch.long)
    embeds = PromptEmbeds({"a": torch.zeros(2, 5), "mask": mask}, {"a": torch.ones(2, 5), "mask": mask})
    meta = torch.device("meta")
    moved_traj, moved_embeds, rest = samples.to_device((traj, embeds, {"ids": [torch.arange(3), "a cat", None]}), meta)
    assert all(getattr(moved_traj, f).device == meta for f in ("latents", "log_probs", "timesteps", "sde_mask", "images"))
    assert all(v.device == meta for part in (moved_embeds.cond, moved_embeds.uncond) for v in part.values())
    assert moved_embeds.cond["mask"].dtype == torch.long
    assert rest["ids"][0].device == meta and rest["ids"][1:] == ["a cat", None]
    assert traj.latents.device.type == "cpu"  # the originals are left as they are


def test_offload_samples_only_where_the_update_moves_micro_batches():
    cfg = load_config("configs/tiny/raft_sd3.yaml", ["rollout.offload_samples=true"])
    with pytest.raises(ConfigError, match="'rollout.offload_samples' is not supported by algorithm 'raft'"):
        build_trainer(cfg)
    assert load_config(None).rollout.offload_samples is False


def test_placements_and_sample_offload_train_the_same_weights(tmp_path, monkeypatch):
    """Offloaded encoders with offloaded samples: exactly the weights of a plain run. The cache:
    equal up to fp32 rounding, because SD3's pooled CLIP projection of a prompt moves in the last
    bit with the number of prompts encoded together (the cache encodes the whole set at once, a
    rollout its own prompts; a resident run's embeddings depend on their batch the same way)."""
    start, plain, offload, cache = (tmp_path / name for name in ("start", "plain", "offload", "cache"))
    assert run_cli("train", *RUN, "max_iterations=0", f"output_dir={start}") == 0  # the initial weights
    assert run_cli("train", *RUN, f"output_dir={plain}") == 0

    moves, depth = [], []  # every outer call of the one mover: (what, target device, devices of what it returns)
    real = samples.to_device

    def spy(item, device):
        depth.append(1)  # the mover calls itself for the parts of an item
        try:
            moved = real(item, device)
        finally:
            depth.pop()
        if not depth:
            moves.append((type(item).__name__, device, {t.device for t in _tensors(moved)}))
        return moved

    monkeypatch.setattr(samples, "to_device", spy)
    assert run_cli("train", *RUN, "rollout.offload_samples=true", "model.text_encoders=offload", f"output_dir={offload}") == 0
    monkeypatch.undo()
    cpu, device = torch.device("cpu"), torch.device(_device())
    # after the rollout: the trajectory and the embeddings to CPU memory; then each micro-batch's
    # embeddings to the training device (the trajectory's rows are moved where they are indexed)
    assert moves[:2] == [("Trajectory", cpu, {cpu}), ("PromptEmbeds", cpu, {cpu})]
    assert len(moves) > 2 and all(m == ("PromptEmbeds", device, {device}) for m in moves[2:])

    assert run_cli("train", *RUN, "model.text_encoders=cache", f"output_dir={cache}") == 0
    a, b, c = weights(plain), weights(offload), weights(cache)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_update(weights(start), a, c, rel=REL, min_update=1e-4)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(item):
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, PromptEmbeds):
        return [*item.cond.values(), *(item.uncond or {}).values()]
    if isinstance(item, Trajectory):
        return [item.latents, item.log_probs, item.images]
    return []


@pytest.mark.parametrize("algorithm", ["stepwise_flow_grpo", "diffusion_nft"])
def test_other_updates_with_offloaded_samples_train_the_same_weights(algorithm, tmp_path):
    """The transition update (Stepwise-Flow-GRPO, DRM Step-GRPO) and the matching update
    (DiffusionNFT, AWM, Sol-RL's NFT optimizer) with their samples in CPU memory."""
    config, overrides, one_process, _ = OTHER_ALGORITHMS[algorithm]
    run = [config, *SHORT_RUN, *overrides, *one_process, "max_iterations=1", "sampling.num_steps=3"]
    assert run_cli("train", *run, f"output_dir={tmp_path / 'plain'}") == 0
    assert run_cli("train", *run, "rollout.offload_samples=true", f"output_dir={tmp_path / 'offload'}") == 0
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "offload")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # the LoRA moved
