"""Every GPU measurement in one command, one JSON: sized to finish in at most 8 minutes on one H100 / H200.

    python benchmarks/gpu/run_all.py [--out runs/bench_gpu/run_all.json]     # on a GPU machine
    python benchmarks/gpu/run_all.py --smoke                                  # CPU, tiny sizes, < 60 s

Sections (each timed; one that fails is recorded with its error and the others still run):

- ``sol_rl_stage1``: Sol-RL stage-1 throughput of FP8 (torchao) and the other formats against the
  BF16 copy on a random SD3.5-Medium-sized MMDiT at 512 px token count (1,024 image tokens), with
  rank fidelity (Kendall tau, top-K/2 hit rate) against the BF16 policy
  (``benchmarks/gpu/sol_rl_stage1.py``); ``fp8_over_bf16`` is the throughput ratio (goal >= 1.8);
- ``rollout_vs_pipeline``: diffalign's SDE rollout with log-probs against the stock
  ``StableDiffusion3Pipeline.__call__`` on the same model, in BF16, same forwards
  (``benchmarks/rollout_vs_pipeline.py``; ``ratio`` is its paired ratio with ``ratio_interval``,
  ``fastest_ratio`` the ratio of the fastest repeats), plus the peak CUDA memory per image of each side;
- ``overhead``: one Flow-GRPO iteration against its bare denoiser work at the same size
  (``benchmarks/overhead.py``);
- ``attention``: one attention call at the MMDiT's shape (joint image + text tokens): PyTorch SDPA
  (whatever backend it picks) against xformers' ``memory_efficient_attention`` when installed.

The JSON holds the machine (GPU name, capability, torch / diffusers / torchao / xformers versions),
each section's result and seconds, and the total. Nothing is downloaded: every model is built in
code with random weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

BUDGET_S = 8 * 60


def _load(name: str, relpath: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def machine(device: str) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
        "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        **{pkg: _version(pkg) for pkg in ("diffusers", "torchao", "xformers", "bitsandbytes", "peft")},
    }


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------


def sol_rl_section(args, out: Path) -> dict:
    bench = _load("bench_gpu_sol_rl", "benchmarks/gpu/sol_rl_stage1.py")
    argv = ["--device", args.device, "--size", args.size, "--formats", args.formats, "--out", str(out / "sol_rl")]
    if args.smoke:
        argv += ["--prompts", "1", "--pool", "2", "--select", "2", "--batch", "2", "--stage1-steps", "1",
                 "--stage2-steps", "2", "--on-unsupported", "emulate"]
    result = bench.main(argv)
    rows = {r["format"]: r for r in result["rows"]}
    speed = {f: r.get("img_per_s") for f, r in rows.items()}
    ratio = None
    if speed.get("fp8") and speed.get("bf16"):
        ratio = speed["fp8"] / speed["bf16"]
    return {"rows": result["rows"], "fp8_over_bf16": ratio, "goal": 1.8}


def sd3_spec(size: str):
    overhead = _load("benchmarks_overhead", "benchmarks/overhead.py")
    if size == "sd35m":  # SD3.5-Medium's width (24 heads x 64) and depth; 128 px = 1,024 image tokens (tiny VAE 2x, patch 2)
        return overhead, overhead.ModelSize(layers=24, heads=24, head_dim=64, resolution=128, text_len=16)
    return overhead, overhead.SIZES[size]


def rollout_section(args, out: Path) -> dict:
    from diffalign.adapters.sd3 import SD3Adapter

    bench = _load("benchmarks_rollout_vs_pipeline", "benchmarks/rollout_vs_pipeline.py")
    overhead, spec = sd3_spec(args.size)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    pipe = overhead.build_sd3_pipeline(spec).to(args.device, dtype)
    adapter = SD3Adapter(pipe, device=args.device, dtype=dtype)
    sides = bench.Sides("sd3", adapter, images=args.images, steps=args.steps, guidance=4.5, resolution=spec.resolution)
    m = bench.measure(sides, args.repeats)
    memory = {}
    for side in ("pipeline", "rollout"):
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            getattr(sides, side)()
            memory[side] = (torch.cuda.max_memory_allocated() - base) / 2**20 / args.images
        else:
            memory[side] = None
    return {"images": args.images, "steps": args.steps, "resolution": spec.resolution, "dtype": str(dtype),
            "forwards": m["forwards"], "pipeline_s": m["pipeline"][0], "rollout_s": m["rollout"][0],
            "ratio": m["paired_ratio"], "ratio_interval": list(m["paired_interval"]), "fastest_ratio": m["wall_ratio"],
            "goal": bench.PARITY_GOAL, "peak_mib_per_image": memory}


def overhead_section(args, out: Path) -> dict:
    overhead, spec = sd3_spec(args.size)
    if args.size not in overhead.SIZES:
        overhead.SIZES[args.size] = spec
    overrides = [] if args.device == "cpu" else ["model.dtype=bf16"]
    result = overhead.benchmark(overhead.parse_args(["--size", args.size, "--iterations", "1",
                                                     "--repeats", str(max(1, args.repeats // 2)), *overrides]))
    return {"toolkit_s": result.toolkit.median("wall"), "raw_s": result.raw.median("wall"), "ratio": result.ratio("wall"),
            "nfe": result.toolkit.nfe, "goal": overhead.OVERHEAD_GOAL}


def attention_section(args, out: Path) -> dict:
    _, spec = sd3_spec(args.size)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens = (spec.resolution // 4) ** 2 + 2 * spec.text_len  # joint attention: image + text tokens
    batch = 2 * args.images  # CFG rows
    gen = torch.Generator("cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, spec.heads, spec.head_dim, generator=gen).to(args.device, dtype) for _ in range(3))

    def time_it(fn) -> float:
        fn()
        _sync(args.device)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            _sync(args.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    # SDPA takes (B, heads, tokens, dim); xformers (B, tokens, heads, dim)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    result = {"shape": [batch, tokens, spec.heads, spec.head_dim], "dtype": str(dtype),
              "sdpa_ms": time_it(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))}
    try:
        import xformers.ops as xops

        result["xformers_ms"] = time_it(lambda: xops.memory_efficient_attention(q, k, v))
        result["xformers_over_sdpa"] = result["xformers_ms"] / result["sdpa_ms"]
    except Exception as exc:  # not installed (CPU machines) or no kernel for this device
        result["xformers_ms"] = None
        result["xformers_note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return result


SECTIONS = {"sol_rl_stage1": sol_rl_section, "rollout_vs_pipeline": rollout_section,
            "overhead": overhead_section, "attention": attention_section}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks that every section runs (< 60 s)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --smoke)")
    p.add_argument("--size", default=None, help="sd35m (default), or tiny / small / medium of benchmarks/overhead.py")
    p.add_argument("--formats", default="bf16,fp8,int8")
    p.add_argument("--images", type=int, default=None, help="images per rollout call (default 8; 2 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 10; 2 with --smoke)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; 1 with --smoke)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_gpu" / "run_all.json"))
    args = p.parse_args(argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke else "cuda")
    args.size = args.size or ("tiny" if smoke else "sd35m")
    args.images = args.images or (2 if smoke else 8)
    args.steps = args.steps or (2 if smoke else 10)
    args.repeats = args.repeats or (1 if smoke else 5)
    if smoke:
        args.formats = "bf16,fp8"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --smoke (CPU) or on a GPU machine")
    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    out_file = Path(args.out)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(args.device), "args": vars(args), "sections": {}}
    t_start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            section = SECTIONS[name](args, out_file.parent)
            section["status"] = "ok"
        except Exception as exc:
            section = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:500],
                       "traceback": traceback.format_exc()[-2000:]}
        section["seconds"] = time.perf_counter() - t0
        result["sections"][name] = section
        print(f"{name}: {section['status']} in {section['seconds']:.1f} s", flush=True)
        out_file.write_text(json.dumps(result, indent=2, default=str))  # a section at a time: a crash keeps the rest
    result["total_seconds"] = time.perf_counter() - t_start
    result["within_budget"] = result["total_seconds"] <= BUDGET_S
    out_file.write_text(json.dumps(result, indent=2, default=str))
    summary = result["sections"]
    print(json.dumps({n: {k: v for k, v in s.items() if k in ("status", "ratio", "fp8_over_bf16", "sdpa_ms", "xformers_ms",
                                                               "peak_mib_per_image", "error")} for n, s in summary.items()}, indent=1, default=str))
    print(f"total {result['total_seconds']:.0f} s (budget {BUDGET_S} s); wrote {out_file}")
    return result


if __name__ == "__main__":
    main()
