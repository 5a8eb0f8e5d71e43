"""Fidelity of a low-precision copy: its velocity error, size and speed against the full model.

:func:`fidelity_report` gives one row per format (the table of ``benchmarks/sol_rl_quant.py``);
:func:`velocity_error` is the per-state measure the Sol-RL recipe logs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

from diffalign.sampling import build_kernel
from diffalign.sol_rl.policy_copy import LowPrecisionCopy
from diffalign.sol_rl.quantize import QuantConfig, UnsupportedFormatError, resolve_format

# --------------------------------------------------------------------------------------------
# Fidelity
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def velocity_error(adapter, copy: LowPrecisionCopy, x: torch.Tensor, t: torch.Tensor, embeds, guidance_scale: float) -> dict[str, float]:
    """Output error of the copy against the full-precision denoiser at ``(x, t)``.

    ``rel_l2 = ||v_copy - v|| / ||v||`` over the batch; ``cosine`` the mean per-sample cosine
    similarity; ``max_abs`` the largest absolute difference."""
    ref = adapter.predict(x, t, embeds, guidance_scale).float()
    with copy.swapped_into(adapter):
        out = adapter.predict(x, t, embeds, guidance_scale).float()
    diff = out - ref
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1), dim=1)
    return {"rel_l2": float(diff.norm() / ref.norm().clamp_min(1e-12)), "cosine": float(cos.mean()),
            "max_abs": float(diff.abs().max())}


@torch.no_grad()
def fidelity_report(adapter, formats: Sequence[str], prompts: Sequence[str], *, resolution: int, num_steps: int = 6,
                    guidance_scale: float = 1.0, seed: int = 0, base: Optional[QuantConfig] = None,
                    on_unsupported: str = "emulate", adapter_name: str = "default", repeats: int = 3) -> list[dict]:
    """One row per format: how far the copy's velocity is from the full-precision model's.

    The states are those of a full-precision ODE trajectory (``num_steps`` steps, one sample per
    prompt, noise from ``seed``); at each state both models predict and the relative L2 error,
    cosine and max abs error are averaged over the steps. Formats that cannot run here are
    reported as ``skipped`` with the reason (``on_unsupported`` as in :class:`QuantConfig`).
    Rows also hold the layer counts, the quantised parameter share, bytes, build and re-sync
    seconds, and the median seconds per copy forward vs per full-precision forward (``repeats``
    timed forwards each, after one warm-up).
    """
    base = base or QuantConfig()
    device = adapter.device
    embeds = adapter.encode_prompts(list(prompts), with_uncond=guidance_scale > 1)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn((len(prompts), *adapter.latent_shape(resolution, resolution)), generator=gen).to(device)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    states = []
    for i in range(num_steps):
        t = schedule[i].expand(len(prompts)).to(device)
        states.append((x, t))
        v = adapter.predict(x, t, embeds, guidance_scale)
        x = kernel.step(v, x, t, schedule[i + 1].expand(len(prompts)).to(device), sde=False).prev_sample.float()
    rows = []
    for fmt in formats:
        cfg = QuantConfig(**{**base.__dict__, "format": fmt, "on_unsupported": on_unsupported})
        try:
            resolved = resolve_format(cfg, device)
        except UnsupportedFormatError as exc:
            rows.append({"format": fmt, "status": "skipped", "reason": str(exc)})
            continue
        copy = LowPrecisionCopy(adapter.denoiser, cfg, resolved=resolved, adapter_name=adapter_name, model_dtype=adapter.dtype)
        errs = [velocity_error(adapter, copy, xs, ts, embeds, guidance_scale) for xs, ts in states]
        sync_s = copy.sync()
        t_copy = _time_forward(adapter, states[0], embeds, guidance_scale, copy, repeats)
        t_full = _time_forward(adapter, states[0], embeds, guidance_scale, None, repeats)
        rows.append({
            "format": fmt, "status": resolved.mode, "used": resolved.used, "reason": resolved.reason,
            "rel_l2": float(sum(e["rel_l2"] for e in errs) / len(errs)),
            "rel_l2_max": max(e["rel_l2"] for e in errs),
            "cosine": float(sum(e["cosine"] for e in errs) / len(errs)),
            "max_abs": max(e["max_abs"] for e in errs),
            "quantized_layers": len(copy.report.quantized), "kept_layers": len(copy.report.skipped),
            "quantized_param_fraction": copy.report.quantized_param_fraction,
            "bytes": copy.report.bytes, "source_bytes": copy.report.source_bytes,
            "build_s": copy.report.build_seconds, "sync_s": sync_s,
            "forward_s": t_copy, "full_forward_s": t_full,
        })
    return rows


def _time_forward(adapter, state, embeds, guidance_scale, copy: Optional[LowPrecisionCopy], repeats: int = 3) -> float:
    x, t = state
    ctx = copy.swapped_into(adapter) if copy is not None else contextlib.nullcontext()
    with ctx:
        adapter.predict(x, t, embeds, guidance_scale)  # warm-up (lazy kernels, caches)
        times = []
        for _ in range(repeats):
            _sync_device(x.device)
            t0 = time.perf_counter()
            adapter.predict(x, t, embeds, guidance_scale)
            _sync_device(x.device)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_fidelity_table(rows: Sequence[dict]) -> str:
    """Plain-text table of :func:`fidelity_report` rows."""
    head = f"{'format':<12} {'status':<9} {'rel L2':>8} {'cosine':>8} {'quant %':>8} {'MiB':>8} {'fwd ms':>8} {'x full':>7} {'sync ms':>8}"
    lines = [head]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['format']:<12} skipped   {r['reason']}")
            continue
        lines.append(f"{r['format']:<12} {r['status']:<9} {r['rel_l2']:>8.4f} {r['cosine']:>8.4f} {100 * r['quantized_param_fraction']:>8.0f} "
                     f"{r['bytes'] / 2**20:>8.2f} {1000 * r['forward_s']:>8.1f} {r['forward_s'] / max(r['full_forward_s'], 1e-12):>7.2f} "
                     f"{1000 * r['sync_s']:>8.1f}")
    return "\n".join(lines)
