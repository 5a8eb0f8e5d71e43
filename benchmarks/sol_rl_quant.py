"""Sol-RL on a CPU: time split and rank fidelity of each low-precision format, side by side.

For every format that runs here (natively or emulated), one Sol-RL rollout of the same prompts and
seeds: re-sync of the copy, stage 1 (N seeds per prompt, the copy, few ODE steps), selection of K
(best / worst), stage 2 (the K at full precision, full steps). Once, as the reference, the whole
pool at full precision with full steps — the single-stage cost of exploring N seeds, and the
"true" rewards. Per format the table gives the seconds of each stage (wall and CPU), the speed-up
of the two stages over the single-stage pool, the copy's velocity error, and its rank fidelity:
Kendall tau of stage-1 vs full-precision rewards over the pool, top-(K/2) hit rate over the pool,
and the tau on the selected seeds only (what training logs as ``sol/kendall_tau``).

    python benchmarks/sol_rl_quant.py [--model shapes] [--formats full,bf16,int8,...] [--prompts 4]
        [--pool 32] [--select 8] [--stage1-steps 4] [--stage2-steps 10] [--out runs/bench_sol_rl_quant]

``--model``: ``shapes`` (the shipped model, ShapesEval partial credit as reward), any model id
(``tiny:sd3``, a hub id, a folder), or ``bench:sd3-small`` / ``bench:sd3-medium`` — the random SD3
pipelines of ``benchmarks/overhead.py`` (linear-heavy like the real transformers; their images are
noise, so the default reward there is ``brightness``: a rank-fidelity check of the mechanics, not
of an alignment reward). Writes ``result.json`` and ``sol_rl_quant.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT_PROMPTS = ["a red circle", "two blue squares", "a green triangle above a yellow circle", "three purple circles",
                   "a cyan square left of a red triangle", "a yellow triangle", "four red squares", "a blue circle below a green square"]


@contextmanager
def timed(out: dict, key: str):
    w, c = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        out[key] = time.perf_counter() - w
        out[key + "_cpu"] = time.process_time() - c


def load_model(name: str):
    from diffalign.adapters import load_adapter

    if name.startswith("bench:sd3-"):
        spec = importlib.util.spec_from_file_location("benchmarks_overhead", ROOT / "benchmarks" / "overhead.py")
        overhead = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = overhead
        spec.loader.exec_module(overhead)
        from diffalign.adapters.sd3 import SD3Adapter

        size = overhead.SIZES[name.split("-", 1)[1]]
        return SD3Adapter(overhead.build_sd3_pipeline(size)), size.resolution
    adapter = load_adapter(name)
    return adapter, adapter.default_resolution


def main(argv=None) -> dict:
    from diffalign.algorithms.sol_rl import kendall_tau, select_indices, topk_hit_rate
    from diffalign.sol_rl.fidelity import velocity_error
    from diffalign.sol_rl.policy_copy import LowPrecisionCopy
    from diffalign.sol_rl.quantize import QUANT_FORMATS, QuantConfig, UnsupportedFormatError, resolve_format
    from diffalign.sampling.seeded import sample_seeded, seed_noise

    import reward_models

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--reward", default=None, help="default: shapes_eval (partial credit) for shapes models, else brightness")
    p.add_argument("--formats", default=",".join(QUANT_FORMATS))
    p.add_argument("--on-unsupported", default="emulate", choices=["emulate", "error", "fallback"])
    p.add_argument("--skip", default="", help="comma-separated module-name substrings kept unquantised")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--pool", type=int, default=32, help="N seeds per prompt in stage 1")
    p.add_argument("--select", type=int, default=8, help="K seeds per prompt regenerated in stage 2")
    p.add_argument("--stage1-steps", type=int, default=4)
    p.add_argument("--stage2-steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=None, help="default: 4.0 for shapes models, 1.0 otherwise")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings steady on a shared CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_sol_rl_quant"))
    args = p.parse_args(argv)
    if args.stage1_steps < 1 or args.stage2_steps < 1:
        p.error("--stage1-steps and --stage2-steps must be >= 1")
    unknown = [f for f in args.formats.split(",") if f and f not in QUANT_FORMATS]
    if unknown:
        p.error(f"unknown formats {unknown}; known: {', '.join(QUANT_FORMATS)}")
    if not 1 <= args.select <= args.pool:
        p.error(f"--select ({args.select}) must be in [1, --pool ({args.pool})]")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    adapter, resolution = load_model(args.model)
    shapes = adapter.family == "shapes"
    reward_name = args.reward or ("shapes_eval" if shapes else "brightness")
    reward_fn = reward_models.build(reward_name, device="cpu", **({"partial_credit": True} if reward_name == "shapes_eval" else {}))
    g = args.guidance if args.guidance is not None else (4.0 if shapes else 1.0)
    prompts = (DEFAULT_PROMPTS * ((args.prompts + len(DEFAULT_PROMPTS) - 1) // len(DEFAULT_PROMPTS)))[: args.prompts]
    n, k = args.pool, args.select
    seeds = torch.randint(0, 2**31 - 1, (len(prompts), n), generator=torch.Generator().manual_seed(args.seed))
    pool_prompts = [x for x in prompts for _ in range(n)]
    embeds = adapter.encode_prompts(prompts, with_uncond=g > 1).repeat_interleave(n)

    def rollout(num_steps, seed_rows, emb, prompt_list):
        traj = sample_seeded(adapter, emb, seed_rows, num_steps=num_steps, guidance_scale=g, resolution=resolution,
                             batch_size=args.batch_size)
        return reward_models.check_reward_output(reward_name, reward_fn(traj.images, prompt_list, [{} for _ in prompt_list]),
                                                 len(prompt_list)).float()

    print(f"model {args.model} ({adapter.family}, {resolution}px, {sum(p.numel() for p in adapter.denoiser.parameters()):,} "
          f"denoiser params), reward {reward_name}, CFG {g}; {len(prompts)} prompts x {n} seeds -> {k} selected; "
          f"stage 1 {args.stage1_steps} steps, stage 2 {args.stage2_steps} steps; torch threads {args.threads}")
    reference: dict = {}
    with timed(reference, "pool_full"):  # single stage: the whole pool at full precision
        true_rewards = rollout(args.stage2_steps, seeds.flatten(), embeds, pool_prompts).reshape(len(prompts), n)
    print(f"single-stage pool at full precision: {reference['pool_full']:.1f} s wall, {reference['pool_full_cpu']:.1f} s CPU")

    rows = []
    for fmt in [f for f in args.formats.split(",") if f]:
        cfg = QuantConfig(format=fmt, on_unsupported=args.on_unsupported, skip=[s for s in args.skip.split(",") if s])
        try:
            resolved = resolve_format(cfg, "cpu")
        except UnsupportedFormatError as exc:
            rows.append({"format": fmt, "status": "skipped", "reason": str(exc)})
            print(f"{fmt}: skipped ({exc})")
            continue
        row: dict = {"format": fmt, "status": resolved.mode, "used": resolved.used}
        with timed(row, "build"):
            copy = LowPrecisionCopy(adapter.denoiser, cfg, resolved=resolved)
        with timed(row, "sync"):
            copy.sync()
        x, _ = seed_noise(seeds[:, 0], adapter.latent_shape(resolution, resolution))
        t0 = adapter.make_schedule(args.stage1_steps, resolution, resolution)[0].expand(len(prompts))
        row["velocity_rel_err"] = velocity_error(adapter, copy, x, t0, embeds.select(slice(0, n * len(prompts), n)), g)["rel_l2"]
        with timed(row, "stage1"), copy.swapped_into(adapter):
            r1 = rollout(args.stage1_steps, seeds.flatten(), embeds, pool_prompts).reshape(len(prompts), n)
        sel = torch.stack([select_indices(r1[i], k, "best_worst") for i in range(len(prompts))])
        sel_seeds = torch.gather(seeds, 1, sel).flatten()
        sel_prompts = [x for x in prompts for _ in range(k)]
        with timed(row, "stage2"):
            r2 = rollout(args.stage2_steps, sel_seeds, adapter.encode_prompts(prompts, with_uncond=g > 1).repeat_interleave(k),
                         sel_prompts).reshape(len(prompts), k)
        half = max(1, k // 2)
        row["pool_tau"] = _nanmean([kendall_tau(r1[i], true_rewards[i]) for i in range(len(prompts))])
        row["pool_topk_hit"] = _nanmean([topk_hit_rate(r1[i], true_rewards[i], half) for i in range(len(prompts))])
        r1_sel = torch.gather(r1, 1, sel)
        row["selected_tau"] = _nanmean([kendall_tau(r1_sel[i], r2[i]) for i in range(len(prompts))])
        row["stage2_reward_mean"] = float(r2.mean())
        row["quantized_param_fraction"] = copy.report.quantized_param_fraction
        row["mib"] = copy.report.bytes / 2**20
        for kind in ("", "_cpu"):
            row["total" + kind] = row["sync" + kind] + row["stage1" + kind] + row["stage2" + kind]
            row["speedup" + kind] = reference["pool_full" + kind] / max(row["total" + kind], 1e-9)
        rows.append(row)
        print(f"{fmt}: done ({row['total']:.1f} s)")

    print()
    print(format_table(rows, reference))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "reward": reward_name, "guidance": g, "resolution": resolution, "reference": reference, "rows": rows,
              "pool_reward_mean_full": float(true_rewards.mean())}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(rows, reference, out / "sol_rl_quant.png")
    print(f"\nwrote {out / 'result.json'} and {out / 'sol_rl_quant.png'}")
    return result


def _nanmean(values) -> float:
    v = torch.tensor(values, dtype=torch.float64)
    v = v[torch.isfinite(v)]
    return float(v.mean()) if v.numel() else float("nan")


def format_table(rows, reference) -> str:
    head = (f"{'format':<12} {'status':<9} {'vel err':>8} {'sync s':>7} {'stage1 s':>9} {'stage2 s':>9} {'total s':>8} "
            f"{'speedup':>8} {'CPU x':>6} {'pool tau':>9} {'top-k hit':>9} {'sel tau':>8} {'quant %':>8} {'MiB':>7}")
    lines = [head]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['format']:<12} skipped   {r['reason']}")
            continue
        lines.append(f"{r['format']:<12} {r['status']:<9} {r['velocity_rel_err']:>8.4f} {r['sync']:>7.2f} {r['stage1']:>9.2f} "
                     f"{r['stage2']:>9.2f} {r['total']:>8.2f} {r['speedup']:>8.2f} {r['speedup_cpu']:>6.2f} {r['pool_tau']:>9.3f} "
                     f"{r['pool_topk_hit']:>9.3f} {r['selected_tau']:>8.3f} {100 * r['quantized_param_fraction']:>8.0f} {r['mib']:>7.2f}")
    lines.append(f"(single stage, whole pool at full precision: {reference['pool_full']:.2f} s wall, {reference['pool_full_cpu']:.2f} s CPU; "
                 "speedup = that / total; CPU x = the same in CPU seconds)")
    return "\n".join(lines)


def plot(rows, reference, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] != "skipped"]
    if not done:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["format"] for r in done]
    bottom = [0.0] * len(done)
    for part, colour in (("sync", "#999999"), ("stage1", "#4c72b0"), ("stage2", "#dd8452")):
        vals = [r[part] for r in done]
        ax1.bar(names, vals, bottom=bottom, label=part, color=colour)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.axhline(reference["pool_full"], color="k", ls="--", label="single stage (pool, full precision)")
    ax1.set_ylabel("seconds per rollout")
    ax1.set_title("time split")
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", rotation=45)
    x = range(len(done))
    ax2.bar([i - 0.2 for i in x], [r["pool_tau"] for r in done], width=0.4, label="Kendall tau (pool)")
    ax2.bar([i + 0.2 for i in x], [r["pool_topk_hit"] for r in done], width=0.4, label="top-K/2 hit rate (pool)")
    ax2.set_xticks(list(x), names, rotation=45)
    ax2.set_ylim(-0.1, 1.05)
    ax2.set_title("rank fidelity vs full precision")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
    sys.exit(0)
