"""Tree (BranchGRPO) vs linear rollouts: NFE per final image and wall-clock per iteration.

    python benchmarks/branch_rollout.py [--model sd3-small] [--steps 10] [--splits 0,2,4] [--branch 2]
                                        [--prompts 4] [--chunk 16] [--guidance 4.5] [--repeats 5] [--threads 1]
                                        [--out DIR]

Both sides produce the same final images (``prompts x branch^len(splits)``) in one process, with
the same adapter, kernel (Flow-GRPO SDE, a = 0.7), schedule, CFG and chunk size (nodes or samples
per batched forward; CFG doubles the rows):

- **tree**: :func:`diffalign.sampling.tree.sample_tree`, one tree per prompt, all nodes of a depth
  across all trees batched in chunks of ``--chunk`` nodes;
- **linear**: :func:`diffalign.sampling.sample_linear` on the same number of independent samples
  in chunks of ``--chunk``.

What is timed is one rollout iteration: prompt encoding, every denoising step, decoding the final
images (rewards and training are not part of it). A forward pre-hook on the denoiser counts the
forwards and their rows; the NFE of each side is *counted*, and must equal the formula
(tree: ``sum_d width_d`` per tree; linear: ``num_steps`` per image) or the benchmark stops.

Repetitions alternate (tree, linear), (linear, tree), ... after one warm-up of each; the table
shows the median wall and CPU time per iteration. The goal: the wall-clock ratio tree / linear
within 10 % of the NFE ratio (the tree realises its theoretical saving); otherwise the script
prints ``SAVING NOT REALISED`` (exit code 0 either way: a measurement, not a test).

Models: ``sd3-tiny`` / ``sd3-small`` / ``sd3-medium`` are the SD3 transformers of
``benchmarks/overhead.py`` built in code (``small``: 2 joint blocks of width 128 at 64 px); any
other value goes to ``load_adapter`` (``tiny:shapes``, ``shapes``, a hub id or folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GOAL = 0.10  # |wall ratio / NFE ratio - 1| we aim to stay under
PROMPTS = ["a cat", "a dog", "a red car", "a tree on a hill", "a blue house", "two small stars", "a green boat", "an old clock"]


def build_adapter(name: str, resolution: int | None):
    """(adapter, resolution) for ``name`` (see the module docstring)."""
    if name.startswith("sd3-") and name[4:] in ("tiny", "small", "medium"):
        spec = importlib.util.spec_from_file_location("benchmarks_overhead", ROOT / "benchmarks" / "overhead.py")
        overhead = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = overhead
        spec.loader.exec_module(overhead)
        from diffalign.adapters.sd3 import SD3Adapter

        size = overhead.SIZES[name[4:]]
        return SD3Adapter(overhead.build_sd3_pipeline(size)), resolution or size.resolution
    from diffalign.adapters import load_adapter

    adapter = load_adapter(name)
    return adapter, resolution or adapter.default_resolution


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Side:
    name: str
    nfe: int = 0  # node / sample evaluations per iteration (one CFG-guided prediction each)
    forwards: int = 0  # batched denoiser forwards per iteration
    rows: int = 0  # rows through the denoiser per iteration
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def main(argv=None) -> dict:
    from diffalign.algorithms.branch_grpo import TreeStructure
    from diffalign.sampling import build_kernel, sample_linear
    from diffalign.sampling.tree import expected_forwards, sample_tree

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sd3-small")
    p.add_argument("--resolution", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--splits", default="0,2,4", help="comma-separated split steps")
    p.add_argument("--branch", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="trees (prompts) per iteration")
    p.add_argument("--chunk", type=int, default=16, help="nodes / samples per batched forward")
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_branch_rollout"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    adapter, res = build_adapter(args.model, args.resolution)
    tree = TreeStructure(args.steps, tuple(int(s) for s in args.splits.split(",") if s.strip()), args.branch)
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo",
                          1.0 if adapter.prediction_type == "epsilon" else 0.7)
    schedule = adapter.make_schedule(args.steps, res, res)
    mask = torch.ones(args.steps, dtype=torch.bool)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    n_images = args.prompts * tree.num_leaves
    rows_log: list[int] = []

    def hook(module, a, kw):
        x = kw["hidden_states"] if "hidden_states" in kw else (kw["sample"] if "sample" in kw else a[0])
        rows_log.append(x.shape[0])

    handle = adapter.denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    adapter.denoiser.eval()

    def run_tree(seed: int) -> int:
        embeds = adapter.encode_prompts(prompts, with_uncond=args.guidance > 1)
        traj = sample_tree(adapter, kernel, embeds, schedule, tree, mask, guidance_scale=args.guidance,
                           max_nodes_per_forward=args.chunk, height=res, width=res, generator=torch.Generator().manual_seed(seed))
        return traj.nfe

    def run_linear(seed: int) -> int:
        gen = torch.Generator().manual_seed(seed)
        embeds = adapter.encode_prompts(prompts, with_uncond=args.guidance > 1).repeat_interleave(tree.num_leaves)
        for start in range(0, n_images, args.chunk):
            sample_linear(adapter, kernel, embeds.select(slice(start, start + args.chunk)), schedule, mask,
                          guidance_scale=args.guidance, height=res, width=res, generator=gen)
        return n_images * args.steps

    sides = {"tree": Side("tree"), "linear": Side("linear")}
    runners = {"tree": run_tree, "linear": run_linear}
    cfg_rows = 2 if args.guidance > 1 else 1
    expected = {
        "tree": (args.prompts * tree.nfe, expected_forwards(tree, args.prompts, args.chunk)),
        "linear": (n_images * args.steps, args.steps * -(-n_images // args.chunk)),
    }

    def measure(name: str, seed: int, record: bool) -> None:
        rows_log.clear()
        w0, c0 = time.perf_counter(), cpu_seconds()
        with torch.no_grad():
            nfe = runners[name](seed)
        wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
        side = sides[name]
        side.nfe, side.forwards, side.rows = nfe, len(rows_log), sum(rows_log)
        want_nfe, want_forwards = expected[name]
        if (nfe, len(rows_log), sum(rows_log)) != (want_nfe, want_forwards, cfg_rows * want_nfe):
            raise SystemExit(f"{name}: counted NFE {nfe}, forwards {len(rows_log)}, rows {sum(rows_log)}; expected "
                             f"{want_nfe}, {want_forwards}, {cfg_rows * want_nfe}")
        if record:
            side.wall.append(wall)
            side.cpu.append(cpu)

    print(f"model {args.model} ({adapter.family}, {res}px), {args.steps} steps, CFG {args.guidance}, chunk {args.chunk}, "
          f"{args.threads} thread(s); {args.prompts} prompts x {tree.num_leaves} images = {n_images} images per iteration")
    print(f"tree: {tree.describe()}", flush=True)
    measure("tree", 0, False)  # warm-up
    measure("linear", 0, False)
    for r in range(args.repeats):
        order = ("tree", "linear") if r % 2 == 0 else ("linear", "tree")
        for name in order:
            measure(name, r + 1, True)
    handle.remove()

    med = {n: (statistics.median(s.wall), statistics.median(s.cpu)) for n, s in sides.items()}
    nfe_ratio = sides["tree"].nfe / sides["linear"].nfe
    wall_ratio = med["tree"][0] / med["linear"][0]
    cpu_ratio = med["tree"][1] / med["linear"][1]
    lines = [f"{'':8} {'NFE/image':>10} {'forwards':>9} {'rows':>7} {'wall s/iter':>12} {'cpu s/iter':>11}"]
    for n, s in sides.items():
        lines.append(f"{n:8} {s.nfe / n_images:10.3f} {s.forwards:9d} {s.rows:7d} {med[n][0]:12.3f} {med[n][1]:11.3f}")
    lines.append(f"{'ratio':8} {nfe_ratio:10.3f} {'':9} {'':7} {wall_ratio:12.3f} {cpu_ratio:11.3f}   (tree / linear)")
    print("\n".join(lines))
    gap = wall_ratio / nfe_ratio - 1
    print(f"wall-clock ratio / NFE ratio - 1 = {gap:+.1%} (goal: within +-{GOAL:.0%})")
    if abs(gap) > GOAL:
        print("SAVING NOT REALISED: the wall-clock ratio is more than 10 % away from the NFE ratio")
    result = {"args": vars(args), "tree": tree.describe(), "images_per_iteration": n_images,
              "sides": {n: asdict(s) for n, s in sides.items()}, "nfe_ratio": nfe_ratio, "wall_ratio": wall_ratio,
              "cpu_ratio": cpu_ratio, "gap": gap}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "branch_rollout.json").write_text(json.dumps(result, indent=2))
    _plot(result, out / "branch_rollout.png")
    print(f"saved {out / 'branch_rollout.json'} and {out / 'branch_rollout.png'}")
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result["sides"]
    n = result["images_per_iteration"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    names = list(sides)
    axes[0].bar(names, [sides[s]["nfe"] / n for s in names], color=["C0", "C1"])
    axes[0].set_title("NFE per final image")
    for s, c in zip(names, ["C0", "C1"]):
        axes[1].scatter([s] * len(sides[s]["wall"]), sides[s]["wall"], color=c, alpha=0.6)
        axes[1].hlines(statistics.median(sides[s]["wall"]), names.index(s) - 0.25, names.index(s) + 0.25, color=c)
    axes[1].set_title(f"wall s / iteration (ratio {result['wall_ratio']:.2f}, NFE ratio {result['nfe_ratio']:.2f})")
    axes[1].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
