"""Sol-RL stage 1 on one GPU: throughput, memory and rank fidelity of FP8 (and other formats) versus BF16.

Runs in a few minutes on one H100 / H200 (Hopper: FP8 native; NVFP4 needs Blackwell and is
reported as skipped there unless ``--on-unsupported emulate``). No download: the denoiser is an
SD3 MMDiT built in code with random weights at SD3.5-Medium scale (24 joint blocks of width 1536,
~2B parameters; ``--size sd35l`` = SD3.5-Large scale, 38 x 2432, ~8B) with 1,024 image tokens per
sample (the token count of a 512 px SD3 image), plus a rank-32 LoRA with non-zero B so that the
merge matters. Throughput does not depend on the weights' values; rank fidelity does, so it is
measured with a plain image statistic (mean brightness of the decoded samples) and is a check of
the numerics of each format on this architecture, not of an alignment reward.

Per format, after a warm-up (which also absorbs ``--compile``):

- ``stage-1 img/s``: samples of the pool per second with ``--stage1-steps`` ODE steps (no CFG);
- ``peak GiB``: peak CUDA memory during stage 1; ``copy GiB``: the copy's weights;
- ``vel err``: relative L2 error of the velocity against the BF16 policy on pool states;
- ``tau`` / ``top-k hit``: Kendall tau and top-(K/2) hit rate of the stage-1 ranking of each
  prompt's pool against the BF16 policy with ``--stage2-steps`` steps on the same seeds.

Rows: ``peft`` (the live BF16 policy with its LoRA un-merged — what a single-stage trainer samples
with), ``bf16`` (merged BF16 copy), then the quantised formats.

    python benchmarks/gpu/sol_rl_stage1.py [--size sd35m] [--formats bf16,fp8,int8,nvfp4] [--compile]
        [--prompts 2] [--pool 48] [--select 12] [--batch 16] [--out runs/bench_gpu_sol_rl]
    python benchmarks/gpu/sol_rl_stage1.py --device cpu --size tiny --prompts 1 --pool 4 --select 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _overhead():
    spec = importlib.util.spec_from_file_location("benchmarks_overhead", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(size: str, device: str, dtype: torch.dtype, lora_rank: int, seed: int):
    from peft import LoraConfig

    from diffalign.adapters.sd3 import FLOW_GRPO_LORA_TARGETS, SD3Adapter

    oh = _overhead()
    sizes = {
        "tiny": oh.SIZES["tiny"],
        "small": oh.SIZES["small"],
        # width 1536 = 24 heads x 64 like SD3.5-Medium's MMDiT; 128 px here = 1,024 image tokens (tiny VAE 2x, patch 2)
        "sd35m": oh.ModelSize(layers=24, heads=24, head_dim=64, resolution=128, text_len=16),
        "sd35l": oh.ModelSize(layers=38, heads=38, head_dim=64, resolution=128, text_len=16),
    }
    spec = sizes[size]
    with torch.device("cpu"):
        pipe = oh.build_sd3_pipeline(spec, seed=seed)
    adapter = SD3Adapter(pipe, device=device, dtype=dtype)
    adapter.denoiser.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, init_lora_weights="gaussian",
                                            target_modules=FLOW_GRPO_LORA_TARGETS))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in adapter.denoiser.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))
    return adapter, spec


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    import reward_models
    from diffalign.algorithms.sol_rl import kendall_tau, topk_hit_rate
    from diffalign.sol_rl.fidelity import velocity_error
    from diffalign.sol_rl.policy_copy import LowPrecisionCopy
    from diffalign.sol_rl.quantize import QuantConfig, UnsupportedFormatError, module_bytes, resolve_format
    from diffalign.sampling.seeded import sample_seeded, seed_noise

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="sd35m", choices=["tiny", "small", "sd35m", "sd35l"])
    p.add_argument("--formats", default="bf16,fp8,int8,nvfp4")
    p.add_argument("--on-unsupported", default="error", choices=["error", "emulate", "fallback"],
                   help="formats the GPU cannot run: skip them (error), or run the weight-only emulation")
    p.add_argument("--skip", default="pos_embed,context_embedder,time_text_embed,norm_out,norm1,ff_context",
                   help="module-name substrings kept in BF16 (Sol-RL's SD3 list)")
    p.add_argument("--min-dim", type=int, default=0, help="keep linears with max(in, out) <= this (Sol-RL SD3.5-L: 2432)")
    p.add_argument("--compile", action="store_true", help="torch.compile every denoiser (copies and the peft policy)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--pool", type=int, default=48, help="seeds per prompt")
    p.add_argument("--select", type=int, default=12, help="K (the top-K/2 hit rate uses K/2)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--stage1-steps", type=int, default=6)
    p.add_argument("--stage2-steps", type=int, default=10)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_gpu_sol_rl"))
    args = p.parse_args(argv)
    from diffalign.sol_rl.quantize import QUANT_FORMATS

    unknown = [f for f in args.formats.split(",") if f and f not in QUANT_FORMATS]
    if unknown:
        p.error(f"unknown formats {unknown}; known: {', '.join(QUANT_FORMATS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu for a smoke run")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    t_build = time.perf_counter()
    adapter, spec = build(args.size, args.device, dtype, args.lora_rank, args.seed)
    res = spec.resolution
    n_params = sum(q.numel() for n, q in adapter.denoiser.named_parameters() if "lora_" not in n)
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
            "capability": list(torch.cuda.get_device_capability()) if args.device == "cuda" else None,
            "torch": torch.__version__, "torchao": _version("torchao"), "size": args.size, "denoiser_params": n_params,
            "image_tokens": (res // 4) ** 2, "dtype": str(dtype), "build_s": time.perf_counter() - t_build}
    print(json.dumps(info))
    reward = reward_models.build("brightness", device=args.device)
    prompts = ["a cat", "a dog", "a red car", "a tree on a hill", "a blue house", "two small stars"][: args.prompts]
    n = args.pool
    seeds = torch.randint(0, 2**31 - 1, (len(prompts), n), generator=torch.Generator().manual_seed(args.seed)).flatten()
    pool_prompts = [x for x in prompts for _ in range(n)]
    embeds = adapter.encode_prompts(prompts, with_uncond=False).repeat_interleave(n)

    def run_pool(steps: int) -> tuple[torch.Tensor, float]:
        sync(args.device)
        t0 = time.perf_counter()
        traj = sample_seeded(adapter, embeds, seeds, num_steps=steps, guidance_scale=1.0, resolution=res, batch_size=args.batch)
        sync(args.device)
        seconds = time.perf_counter() - t0
        return reward(traj.images, pool_prompts, None).float().reshape(len(prompts), n).cpu(), seconds

    def warm_up() -> None:
        sample_seeded(adapter, embeds.select(slice(0, args.batch)), seeds[: args.batch], num_steps=2, guidance_scale=1.0,
                      resolution=res, batch_size=args.batch)

    if args.compile:
        adapter.pipeline.transformer = torch.compile(adapter.denoiser)
    warm_up()
    truth, t_truth = run_pool(args.stage2_steps)  # the BF16 policy with full steps: the ranking to reproduce
    x, _ = seed_noise(seeds[: args.batch], adapter.latent_shape(res, res))
    x = x.to(args.device)
    t0 = adapter.make_schedule(args.stage1_steps, res, res)[0].expand(len(x)).to(args.device)
    rows = []

    def measure(name: str, status: str, copy=None) -> dict:
        ctx = copy.swapped_into(adapter) if copy is not None else contextlib.nullcontext()
        with ctx:
            warm_up()
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            r1, seconds = run_pool(args.stage1_steps)
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        k = max(1, args.select // 2)
        row = {"format": name, "status": status, "stage1_s": seconds, "img_per_s": len(seeds) / seconds, "peak_gib": peak,
               "tau": _nanmean([kendall_tau(r1[i], truth[i]) for i in range(len(prompts))]),
               "topk_hit": _nanmean([topk_hit_rate(r1[i], truth[i], k) for i in range(len(prompts))])}
        if copy is not None:
            row["vel_err"] = velocity_error(adapter, copy, x, t0, embeds.select(slice(0, len(x))), 1.0)["rel_l2"]
            row["copy_gib"] = copy.report.bytes / 2**30
            row["quantized_fraction"] = copy.report.quantized_param_fraction
            row["build_s"] = copy.report.build_seconds
            w = time.perf_counter()
            copy.sync()
            sync(args.device)
            row["sync_s"] = time.perf_counter() - w
        else:
            row["vel_err"] = 0.0
            row["copy_gib"] = module_bytes(adapter.denoiser) / 2**30
        print(json.dumps(row), flush=True)
        return row

    rows.append(measure("peft", "BF16 policy, LoRA un-merged"))
    for fmt in [f for f in args.formats.split(",") if f]:
        cfg = QuantConfig(format=fmt, on_unsupported=args.on_unsupported, skip=[s for s in args.skip.split(",") if s], min_dim=args.min_dim)
        try:
            resolved = resolve_format(cfg, args.device)
        except UnsupportedFormatError as exc:
            rows.append({"format": fmt, "status": "skipped", "reason": str(exc)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        denoiser = adapter.pipeline.transformer
        source = getattr(denoiser, "_orig_mod", denoiser)
        copy = LowPrecisionCopy(source, cfg, resolved=resolved, model_dtype=dtype)
        if args.compile:
            copy.module = torch.compile(copy.module)
        rows.append(measure(fmt, resolved.mode, copy))
        del copy
        if args.device == "cuda":
            torch.cuda.empty_cache()

    print()
    print(f"{info['device']} (capability {info['capability']}), torch {info['torch']}, torchao {info['torchao']}; "
          f"{args.size}: {n_params / 1e9:.2f}B params, {info['image_tokens']} image tokens, {len(seeds)} samples x "
          f"{args.stage1_steps} steps, batch {args.batch}{', compiled' if args.compile else ''}; "
          f"BF16 policy with {args.stage2_steps} steps (the ranking reference): {t_truth:.1f} s")
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"info": info, "args": vars(args), "reference_seconds": t_truth, "rows": rows}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'result.json'}")
    return result


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _nanmean(values) -> float:
    v = torch.tensor(values, dtype=torch.float64)
    v = v[torch.isfinite(v)]
    return float(v.mean()) if v.numel() else float("nan")


def format_table(rows) -> str:
    lines = [f"{'format':<8} {'status':<28} {'stage-1 img/s':>13} {'x peft':>7} {'peak GiB':>9} {'copy GiB':>9} {'vel err':>8} "
             f"{'tau':>6} {'top-k hit':>9}"]
    base = next((r["img_per_s"] for r in rows if r["format"] == "peft"), None)
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['format']:<8} skipped: {r['reason']}")
            continue
        lines.append(f"{r['format']:<8} {r['status']:<28} {r['img_per_s']:>13.2f} {r['img_per_s'] / base:>7.2f} {r['peak_gib']:>9.2f} "
                     f"{r['copy_gib']:>9.2f} {r['vel_err']:>8.4f} {r['tau']:>6.3f} {r['topk_hit']:>9.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
