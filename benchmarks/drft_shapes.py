"""DRaFT on the shipped ShapesWorld model: the reward curve of a run, and what per-step
checkpointing saves.

    python benchmarks/drft_shapes.py curve RUN_DIR [--out benchmarks/results/drft/curve.json]
        mean training reward (ShapesSoft and its two terms) per block of --every iterations from RUN_DIR/metrics.jsonl,
        the held-out ShapesEval pass rate before and after, as a markdown table and a small JSON
    python benchmarks/drft_shapes.py memory [--batch 4] [--out benchmarks/results/drft/memory.json]
        bytes autograd keeps for the backward through the last K steps of a 10-step ODE rollout of
        the shipped model (CFG 4), with and without ``algorithm.checkpoint_steps``; the gradients
        of both agree

The run of docs/drft.md: ``diffalign train configs/shapes/drft.yaml`` then ``curve runs/shapes_drft``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def curve(run_dir: Path, every: int = 10) -> dict:
    """Training records averaged over blocks of ``every`` iterations (each iteration draws other
    prompts, so single iterations are noisy), and the evaluations."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    rows = []
    for start in range(0, len(train), every):
        block = train[start : start + every]

        def mean(key):
            return round(sum(r.get(key, float("nan")) for r in block) / len(block), 4)

        rows.append({"iterations": f"{block[0]['iteration']}-{block[-1]['iteration']}", "reward": mean("reward_mean"),
                     "color": mean("reward/soft/color"), "mass": mean("reward/soft/mass"),
                     "seconds": round(sum(r["seconds"] for r in block), 1)})
    keys = ("eval/acc/images", "eval/acc/overall", "eval/partial", "eval/reward_mean")
    held = [{"iteration": r["iteration"], **{k[5:]: round(r[k], 4) for k in keys if k in r},
             **{f"{k[5:]}_ci": [round(r[f"{k}_lo"], 4), round(r[f"{k}_hi"], 4)] for k in keys if f"{k}_lo" in r},
             "num_images": r.get("eval/num_images")} for r in evals]
    return {"run": run_dir.name, "train": rows, "eval": held}


def curve_markdown(result: dict) -> str:
    lines = ["| iterations | mean ShapesSoft | colour | mass | s |", "|---|---|---|---|---|"]
    lines += [f"| {r['iterations']} | {r['reward']:.3f} | {r['color']:.3f} | {r['mass']:.3f} | {r['seconds']:.0f} |"
              for r in result["train"]]
    lines += ["", "| eval at iteration | ShapesEval pass rate (images) [95 % CI] | partial credit | ShapesSoft | images |",
              "|---|---|---|---|---|"]
    for r in result["eval"]:
        ci = r.get("acc/images_ci", [float("nan")] * 2)
        lines.append(f"| {r['iteration']} | {r.get('acc/images', float('nan')):.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | "
                     f"{r.get('partial', float('nan')):.3f} | {r.get('reward_mean', float('nan')):.3f} | {r['num_images']} |")
    return "\n".join(lines)


def memory(batch: int, ks=(1, 2, 4), num_steps: int = 10, guidance: float = 4.0) -> dict:
    import torch

    from diffalign.adapters import load_adapter
    from diffalign.algorithms.drft import truncated_rollout
    from diffalign.sampling import build_kernel
    from reward_models.shapes_soft import ShapesSoft

    torch.manual_seed(0)
    adapter = load_adapter("shapes")
    adapter.denoiser.requires_grad_(True).train()
    kernel = build_kernel(adapter, "flow_grpo", 0.0)
    prompts = ["a photo of a red circle and a blue triangle"] * batch
    embeds = adapter.encode_prompts(prompts, with_uncond=True)
    schedule = adapter.make_schedule(num_steps, 32, 32)
    x = torch.randn(batch, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    reward = ShapesSoft()

    def step(i, xi):
        t, t_next = schedule[i].expand(batch), schedule[i + 1].expand(batch)
        return kernel.step(adapter.predict(xi, t, embeds, guidance), xi, t, t_next, sde=False).prev_sample.float()

    rows = []
    for k in ks:
        sizes, grads = {}, {}
        for checkpointed in (False, True):
            saved = 0

            def pack(t):
                nonlocal saved
                saved += t.numel() * t.element_size()
                return t

            adapter.denoiser.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x0 = truncated_rollout(step, x, num_steps, k, checkpoint_steps=checkpointed)
                loss = -reward(adapter.decode_with_grad(x0), prompts).mean()
            loss.backward()
            sizes[checkpointed] = saved
            grads[checkpointed] = torch.cat([p.grad.flatten() for p in adapter.denoiser.parameters() if p.grad is not None])
        rel = float((grads[True] - grads[False]).norm() / grads[False].norm())
        rows.append({"K": k, "saved_MiB": round(sizes[False] / 2**20, 2), "saved_MiB_checkpointed": round(sizes[True] / 2**20, 2),
                     "grad_rel_diff": rel})
        print(f"K={k}: kept for backward {sizes[False] / 2**20:.1f} MiB, with checkpoint_steps {sizes[True] / 2**20:.2f} MiB; "
              f"gradient relative difference {rel:.1e}", flush=True)
    return {"batch": batch, "guidance_scale": guidance, "num_steps": num_steps, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curve")
    c.add_argument("run_dir", type=Path)
    c.add_argument("--every", type=int, default=10, help="iterations per row (their mean)")
    c.add_argument("--out", type=Path)
    m = sub.add_parser("memory")
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.what == "curve":
        result = curve(args.run_dir, args.every)
        print(curve_markdown(result))
    else:
        result = memory(args.batch)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
