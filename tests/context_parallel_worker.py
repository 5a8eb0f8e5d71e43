"""Run by tests/test_context_parallel.py under torch.distributed.run (gloo, CPU): for each family
named, one training loss and its gradients through the family's adapter, first on every process
without context parallelism over the whole global batch (the one-process reference), then with
diffusers' context parallelism of degree ``degree`` (``diffalign.distributed.enable_context_parallel``)
where each data-parallel group takes its slice of the batch. Writes ``RUN_DIR/rank{R}.json``: the
losses, the largest gradient difference (over the largest gradient element), and the largest
difference of a no-grad forward (a rollout's) from the reference forward."""

import json
import sys

import torch
import torch.distributed as dist

from diffalign import distributed
from diffalign.adapters import load_adapter

RESOLUTION = 32
PROMPTS = ["a red cube", "a blue ball on a green table", "two cats", "a yellow star"]
TIMES = [0.8, 0.2, 0.7, 0.3]  # sigma; with Wan2.2's boundary at 0.5 each group's two samples go to its two experts
# a name of this table stands for a tiny model with options: Wan2.2's two experts
MODELS = {"wan22": ("tiny:wan", {"boundary_ratio": 0.5})}


def batch(adapter, n: int):
    """A global batch of ``n`` samples drawn the same on every process: latents, times, prompts
    and flow targets."""
    g = torch.Generator().manual_seed(7)
    shape = adapter.latent_shape(RESOLUTION, RESOLUTION)
    x = torch.randn((n, *shape), generator=g)
    t = torch.tensor(TIMES[:n])
    target = torch.randn((n, *shape), generator=g)
    return x, t, PROMPTS[:n], target


def loss_and_grads(adapter, denoiser, x, t, prompts, target, n_global: int):
    """The sum over ``x``'s samples of each one's mean squared velocity error, over ``n_global``
    (the trainer's losses are divided by the global number of terms), and the gradients."""
    denoiser.zero_grad(set_to_none=True)
    embeds = adapter.encode_prompts(prompts, with_uncond=False)
    out = adapter.predict(x, t, embeds, 1.0)
    loss = ((out - target) ** 2).flatten(1).mean(1).sum() / n_global
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in denoiser.named_parameters() if p.grad is not None}


def check_family(family: str, layout: distributed.ProcessLayout) -> dict:
    model_id, options = MODELS.get(family, (f"tiny:{family}", {}))
    adapter = load_adapter(model_id, device="cpu", dtype=torch.float32, **options)
    denoiser = adapter.denoiser.requires_grad_(True)
    n_global = 2 * layout.dp_world
    x, t, prompts, target = batch(adapter, n_global)
    ref_loss, ref_grads = loss_and_grads(adapter, denoiser, x, t, prompts, target, n_global)
    with torch.inference_mode():
        ref_out = adapter.predict(x, t, adapter.encode_prompts(prompts, with_uncond=False), 1.0)

    distributed.enable_context_parallel(list(adapter.denoiser_parts().values()), layout, torch.device("cpu"))
    mine = slice(2 * layout.dp_rank, 2 * layout.dp_rank + 2)  # this data-parallel group's samples
    loss, grads = loss_and_grads(adapter, denoiser, x[mine], t[mine], prompts[mine], target[mine], n_global)
    dist.all_reduce(loss)  # every process of a group holds its group's loss: count each group once
    loss /= layout.degree
    for grad in grads.values():  # each process's gradient flows through its own tokens: a sum
        dist.all_reduce(grad)
    with torch.inference_mode():
        out = adapter.predict(x[mine], t[mine], adapter.encode_prompts(prompts[mine], with_uncond=False), 1.0)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    return {
        "loss": float(loss), "reference_loss": float(ref_loss),
        "grad_rel": max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale,
        "same_parameters": sorted(grads) == sorted(ref_grads),
        "parts": len(adapter.denoiser_parts()),
        "forward_max_diff": float((out - ref_out[mine]).abs().max()),
    }


def main(run_dir: str, degree: str, *families: str) -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    layout = distributed.process_layout(dist.get_rank(), dist.get_world_size(), int(degree))
    results = {family: check_family(family, layout) for family in families}
    with open(f"{run_dir}/rank{layout.rank}.json", "w") as f:
        json.dump({"dp_rank": layout.dp_rank, "cp_rank": layout.cp_rank, **results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
